"""The real-model presets in configs/ are valid params files for the stages (checked without any download)."""

import pytest

from pipeline.attribution.run import AttributionConfig
from pipeline.common.params import SECTIONS, load_params, section
from pipeline.data.config import DataConfig

from .conftest import REPO


def _presets():
    """(params file, overlay) for every file of configs/ and each of its overlays (None: the file as it is)."""
    for path in sorted((REPO / "configs").glob("*.yaml")):
        raw = load_params(path)
        yield path.name, None
        yield from ((path.name, name) for name, value in raw.items() if name not in SECTIONS)


@pytest.mark.parametrize("preset, overlay", list(_presets()))
def test_preset_builds_every_stage_config(preset, overlay):
    from pipeline.data.templates import template_from_params
    from pipeline.evaluation.evaluate import eval_config
    from pipeline.training.unlearn import run_configs
    from stages.finetune import job_from_params

    params = load_params(REPO / "configs" / preset, overlay)
    data = DataConfig.from_params(section(params, "data"))
    template_from_params(data.template)
    AttributionConfig.from_params(section(params, "attribution"))
    for name in section(params, "finetune.models"):
        job = job_from_params(params, name)
        assert job.train.micro_batch_size * job.train.grad_accum == 32
    for name in section(params, "unlearn.runs"):
        _, train = run_configs(params, name)
        assert train.micro_batch_size * train.grad_accum == 32  # the paper's effective batch on one GPU
    eval_config(params)
    from pipeline.evaluation.monitor import monitor_from_params
    from pipeline.training.relearn import relearn_config

    assert relearn_config(params).train.lora_spec is not None  # every family relearns with LoRA on one GPU
    monitor_from_params(params)


def test_every_family_of_the_paper_and_open_unlearning_has_a_preset():
    overlays = {o for p, o in _presets() if p == "tofu.yaml"}
    assert {"llama2-7b-chat", "llama3.2-1b-instruct", "llama3.1-8b-instruct", "qwen2.5-7b-instruct", "qwen3-8b",
            "zephyr-7b-beta", "gemma-2-2b-it", "phi-3.5-mini-instruct"} <= overlays  # and Phi-1.5 without one


@pytest.mark.parametrize("overlay", [None, "corpus", "tofu"])
def test_params_and_its_overlays_build_every_stage_config(overlay):
    """params.yaml as `make demo` reads it, and with each overlay of the experiments' pipelines."""
    from pipeline.evaluation.evaluate import eval_config
    from pipeline.training.tuning import TuneConfig
    from pipeline.training.unlearn import run_configs
    from stages.finetune import job_from_params

    params = load_params(REPO / "params.yaml", overlay)
    DataConfig.from_params(section(params, "data"))
    AttributionConfig.from_params(section(params, "attribution"))
    for name in section(params, "finetune.models"):
        job_from_params(params, name)
    for name in section(params, "unlearn.runs"):
        run_configs(params, name)
    eval_config(params)
    from pipeline.evaluation.evaluate import load_inputs
    from pipeline.evaluation.monitor import monitor_from_params
    from pipeline.training.relearn import relearn_config

    relearn_config(params)
    assert monitor_from_params(params).cfg.every > 0
    if overlay == "tofu" and (REPO.parent / "shared" / "data" / "tofu").is_dir():
        load_inputs(eval_config(params), None)  # the probe sets, holdout and paraphrases of real TOFU are there
    TuneConfig.from_params(section(params, "tune"))
    table = section(params, "report.table")
    assert set(table) <= set(section(params, "unlearn.runs"))
    if overlay == "corpus":
        assert params["attribution"]["mode"] == "corpus" and params["unlearn"]["defaults"]["retain_corpus"]
        assert len(table) == 12 and params["unlearn"]["runs"]["ga"]["method"] == "ga"
    if overlay == "tofu":
        assert job_from_params(params, "target").init == "artifacts/tofu/models/base"
        assert eval_config(params).multiple_choice == {}


@pytest.mark.parametrize("rung,millions", [("ladder_3m", 3.67), ("ladder_30m", 29.4), ("ladder_150m", 158.4)])
def test_the_seeds_and_ladder_overlays_build_their_stage_configs(rung, millions):
    """experiments/seeds (overlay seeds_overlay) and experiments/ladder (tofu, the rung, seeds_overlay): every run
    configured, the tuning a bisection, no paraphrase probe (an overlay's {} merges: membership inference and the
    quantization probes stay, and the runs' evaluate stages turn them off with -S), and each rung the size the
    README gives."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline.evaluation.evaluate import eval_config
    from pipeline.training.tuning import TuneConfig
    from pipeline.training.unlearn import run_configs

    for overlays in (["seeds_overlay"], ["tofu", rung, "seeds_overlay"]):
        params = load_params(REPO / "params.yaml", overlays)
        tune = TuneConfig.from_params(section(params, "tune"))
        assert tune.search == "bisect" and tune.bisect_config.max_trials >= 2
        cfg = eval_config(params)
        assert not cfg.paraphrase and cfg.mia and cfg.quantize
        experiment = section(params, "seeds" if len(overlays) == 1 else "ladder")
        for name in experiment["runs"]:
            run_configs(params, name)
    config = LlamaConfig(**section(params, "model.config"), vocab_size=4096)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    assert sum(p.numel() for p in model.parameters()) / 1e6 == pytest.approx(millions, rel=0.01)
    assert section(params, "unlearn.defaults")["rmu_layer"] < config.num_hidden_layers
