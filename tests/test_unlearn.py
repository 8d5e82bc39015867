"""Stage two on the micro world: weights from φ, every method, RMU's frozen layers, shard checks, resume."""

import math

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from pipeline.engine import TrainConfig
from pipeline.errors import DataError, ParamError
from pipeline.finetune import DataConfig
from pipeline.unlearn import METHODS, UnlearnConfig, forget_samples, run_unlearn

from .conftest import load_weights

TRAIN = {"epochs": 2, "lr": 1e-3, "micro_batch_size": 2, "warmup_ratio": 0.0, "seed": 0}


def _run(tmp_path, model_dir, shards, world_dir, tag, resume=False, **cfg):
    cfg = UnlearnConfig.from_params({"rmu_layer": 2, **cfg}, "u")
    out = tmp_path / tag
    run_unlearn(tag, cfg, TrainConfig.from_params(TRAIN, "t"), DataConfig(source=str(world_dir)), str(model_dir),
                shards, out, tmp_path / f"ckpt-{tag}", tmp_path / f"{tag}.csv", resume)
    return out


@pytest.mark.parametrize("weighting", ["uniform", "hard", "soft"])
def test_weights_come_from_phi(attribution_dir, weighting):
    samples = forget_samples(attribution_dir[0] / "shards", UnlearnConfig(weighting=weighting, r=0.2, tau=0.5))
    for s in samples:
        w, n = s.weights[s.scored], s.scored.sum()
        assert (s.weights[~s.scored] == 0).all()
        if weighting == "uniform":
            assert (w == 1).all()
        elif weighting == "hard":
            assert sorted(set(w)) <= [0.0, 1.0] and w.sum() == max(1, math.ceil(0.2 * n))
            assert s.phi[s.scored][w == 1].min() >= s.phi[s.scored][w == 0].max(initial=-1)
        else:
            assert w.sum() == pytest.approx(1.0) and np.argmax(w) == np.argmax(s.phi[s.scored])


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_trains_and_writes_model_weights_and_curve(attribution_dir, micro_model_dir, micro_world_dir,
                                                                 tmp_path, method):
    out = _run(tmp_path, micro_model_dir, attribution_dir[0] / "shards", micro_world_dir, method, method=method,
               weighting="hard")
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out / "model", use_safetensors=True)
    weights = pq.read_table(out / "token_weights.parquet").to_pylist()
    assert weights and all(sum(row["weight"]) >= 1 for row in weights)
    curve = (tmp_path / f"{method}.csv").read_text().splitlines()
    assert curve[0].startswith("step,forget_loss") and len(curve) > 2
    before, after = load_weights(micro_model_dir), load_weights(out / "model")
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed
    if method == "rmu":  # only layers 0 and 1 (below rmu_layer 2) are trained
        assert all(k.startswith(("model.layers.0.", "model.layers.1.")) for k in changed), sorted(changed)


def test_shards_of_another_model_are_refused(attribution_dir, micro_tokenizer, micro_world_dir, tmp_path):
    from pipeline.modeling import build_model, save_model

    from .conftest import TINY_MODEL

    save_model(build_model(TINY_MODEL, micro_tokenizer, seed=1), micro_tokenizer, tmp_path / "other")
    with pytest.raises(DataError, match="shards were made with model_hash="):
        _run(tmp_path, tmp_path / "other", attribution_dir[0] / "shards", micro_world_dir, "x", method="npo")
    assert not (tmp_path / "x").exists()


def test_unknown_method_is_an_error():
    with pytest.raises(ParamError, match=r"u.method='dpo': out of range \(choose from"):
        UnlearnConfig.from_params({"method": "dpo"}, "u")


def test_killed_and_resumed_unlearning_ends_with_the_same_weights(attribution_dir, micro_model_dir,
                                                                  micro_world_dir, tmp_path, monkeypatch):
    import pipeline.engine as engine_mod

    shards = attribution_dir[0] / "shards"
    monkeypatch.setitem(TRAIN, "checkpoint_every", 1)
    full = load_weights(_run(tmp_path, micro_model_dir, shards, micro_world_dir, "full", method="npo",
                             weighting="soft") / "model")
    real_step, calls = engine_mod.Engine.train_step, {"n": 0}

    def dying_step(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(engine_mod.Engine, "train_step", dying_step)
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path, micro_model_dir, shards, micro_world_dir, "resumed", method="npo", weighting="soft")
    monkeypatch.setattr(engine_mod.Engine, "train_step", real_step)
    resumed = load_weights(_run(tmp_path, micro_model_dir, shards, micro_world_dir, "resumed", resume=True,
                                method="npo", weighting="soft") / "model")
    for name in full:
        assert torch.equal(full[name], resumed[name]), name
