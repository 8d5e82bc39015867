"""Every stage on every model family a user of this field brings (tests/families.py): attribute → unlearn (every
method; uniform, hard, soft; RMU under all three) → evaluate, each model saved and reloaded as a user's is."""

import pytest
import torch

from tests.families import FAMILIES
from tests.family_matrix import RUNS, run_family

pytestmark = pytest.mark.slow  # every stage on every model family


@pytest.fixture(scope="module")
def world_texts(micro_world_dir):
    from tests.family_matrix import world_texts_of

    return world_texts_of(micro_world_dir)


def _weights(model_dir):
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_stage_runs_on_the_family(family, micro_world_dir, world_texts, tmp_path):
    from transformers import AutoModelForCausalLM

    from pipeline.common.modeling import decoder_layers

    cells = run_family(family, micro_world_dir, tmp_path, world_texts)
    failed = {stage: cell.error for stage, cell in cells.items() if not cell.ok}
    assert not failed, "\n\n".join(f"{stage}: {error}" for stage, error in failed.items())

    before = _weights(tmp_path / "model")
    prefix = next(k for k in before if ".layers.0." in k).split(".layers.0.")[0]  # model / gpt_neox
    for run in RUNS:
        out = tmp_path / "unlearn" / run / "model"
        model = AutoModelForCausalLM.from_pretrained(out, use_safetensors=True)  # a user's reload
        if model.config.tie_word_embeddings:
            assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
        after = _weights(out)
        changed = {k for k in before if k in after and not torch.equal(before[k], after[k])}
        assert changed, f"{run}: no weight changed"
        if RUNS[run]["method"] == "rmu":  # only the layers below rmu_layer 2 are trained
            assert all(k.startswith((f"{prefix}.layers.0.", f"{prefix}.layers.1.")) for k in changed), sorted(changed)
        assert len(decoder_layers(model)) == 2
    import json

    summary = json.loads((tmp_path / "eval" / "t_wga" / "metrics.json").read_text())
    assert {"forget_es", "retain_es", "model_utility", "log10_forget_quality", "mc_world_forget"} <= set(summary)


@pytest.mark.parametrize("family", ["qwen2", "gemma2"])  # tied embeddings (Qwen 2.5 small, Gemma)
def test_zero3_and_bf16_on_tied_embeddings(family, micro_world_dir, world_texts, tmp_path):
    """ZeRO-3 partitions the one tensor that the embedding and the head share: one process under ZeRO-3 ends with
    the weights of ZeRO-0, still tied when reloaded; bf16 training (the GPU precision, here on CPU) runs and saves a
    model that reloads."""
    from transformers import AutoModelForCausalLM

    from pipeline.attribution.run import AttributionConfig, run_attribution
    from pipeline.data.config import DataConfig
    from pipeline.training.engine import TrainConfig
    from pipeline.training.unlearn import UnlearnConfig, run_unlearn

    from tests.families import build_family
    from tests.family_matrix import TRAIN

    model_dir = build_family(family, world_texts, tmp_path / "model")
    data = DataConfig(source=str(micro_world_dir), template=FAMILIES[family].template, max_length=256)
    shards = tmp_path / "shards"
    run_attribution(AttributionConfig(model=str(model_dir), split="forget10", tagger="spacy"), data, shards, None)
    outs = {}
    for tag, train in {"zero0": {}, "zero3": {"zero_stage": 3}, "bf16": {"precision": "bf16"}}.items():
        cfg = UnlearnConfig.from_params({"method": "npo", "weighting": "hard"}, "u")  # NPO + the KL retain term
        run_unlearn(tag, cfg, TrainConfig.from_params({**TRAIN, **train}, "t"), data, str(model_dir), shards,
                    tmp_path / tag, tmp_path / f"ckpt-{tag}", tmp_path / f"{tag}.csv", resume=False)
        outs[tag] = AutoModelForCausalLM.from_pretrained(tmp_path / tag / "model", use_safetensors=True)
        assert outs[tag].get_output_embeddings().weight is outs[tag].get_input_embeddings().weight
    zero0, zero3 = (dict(outs[t].named_parameters()) for t in ("zero0", "zero3"))
    for name, p in zero0.items():
        torch.testing.assert_close(zero3[name], p, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
    bf16 = dict(outs["bf16"].named_parameters())
    assert any(not torch.equal(bf16[n], p) for n, p in dict(_reload(model_dir).named_parameters()).items())


def _reload(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, use_safetensors=True)
