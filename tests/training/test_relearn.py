"""The relearning attack on the micro world: slices, finetuning in memory, probes before and after, per seed."""

import json
import shutil

import pytest
import torch

from pipeline.common.errors import ParamError
from pipeline.data.config import DataConfig
from pipeline.evaluation.attacks.relearning import evaluate_attack
from pipeline.evaluation.config import EvalConfig
from pipeline.training.relearn import relearn_config, relearning_attack, slice_rows

from tests.conftest import micro_params


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _params(world_dir, **relearn):
    params = micro_params(world_dir, world_dir)
    params["unlearn"] = {"train": {"lr": 1e-3, "micro_batch_size": 4, "zero_stage": 0, "checkpoint_every": 0,
                                   "warmup_ratio": 0.0}}
    params["relearn"] = {"seed": 0, "train": {"max_steps": 4, "lr": 3e-3},
                         "data": {"forget": {"split": "forget10", "fraction": 0.5},
                                  "retain": {"split": "retain90", "fraction": 0.2}}, **relearn}
    return params


def test_slices_are_seeded_and_never_empty():
    assert slice_rows(10, 0.2, 0) == slice_rows(10, 0.2, 0)
    assert len(slice_rows(10, 0.2, 0)) == 2 and len(slice_rows(3, 0.01, 0)) == 1
    assert slice_rows(10, 0.2, 0) != slice_rows(10, 0.2, 1)
    assert slice_rows(5, 1.0, 3) == [0, 1, 2, 3, 4]


def test_relearn_params_and_their_errors(micro_world_dir):
    cfg = relearn_config(_params(micro_world_dir))
    assert cfg.train.max_steps == 4 and cfg.train.lr == 3e-3 and cfg.train.micro_batch_size == 4  # over unlearn.train
    assert cfg.data["forget"].fraction == 0.5 and cfg.forget_split == "forget10"
    with pytest.raises(ParamError, match=r"relearn.data.forget.fraction"):
        relearn_config(_params(micro_world_dir, data={"forget": {"split": "forget10", "fraction": 0}}))
    with pytest.raises(ParamError, match=r"relearn.train.zero_stage=3"):
        relearn_config(_params(micro_world_dir, train={"zero_stage": 3}))
    with pytest.raises(ParamError, match=r"relearn: .*unknown|relearn.*steps"):
        relearn_config(_params(micro_world_dir, steps=3))


def test_relearning_attack_probes_unseen_forget_rows_before_and_after(micro_model_dir, micro_world_dir, tmp_path):
    params = _params(micro_world_dir)
    cfg, data = relearn_config(params), DataConfig.from_params(params["data"])
    seen_rows = []

    def probe(model, rows):
        seen_rows.append(list(rows))
        with torch.no_grad():  # a probe that reads the weights: relearning must have changed them
            return {"weight_sum": float(sum(p.double().sum() for p in model.parameters()))}

    from pipeline.data.tofu import load_split

    n = len(load_split(str(micro_world_dir), "forget10"))
    results = relearning_attack(str(micro_model_dir), probe, n, cfg, data)
    forget_slice = results["forget"]["rows"]
    assert len(forget_slice) == round(n / 2) and results["unseen_forget_rows"] == [i for i in range(n)
                                                                                  if i not in forget_slice]
    assert seen_rows == [results["unseen_forget_rows"]] * 3  # before, after each attack: the same rows
    assert results["forget"]["steps"] == results["retain"]["steps"] == 4
    before = results["before"]["weight_sum"]
    assert results["forget"]["probe"]["weight_sum"] != before != results["retain"]["probe"]["weight_sum"]
    with pytest.raises(ParamError, match="no forget row is left"):
        everything = _params(micro_world_dir, data={"forget": {"split": "forget10", "fraction": 1.0}})
        relearning_attack(str(micro_model_dir), probe, n, relearn_config(everything), data)


def test_relearning_on_the_forget_slice_brings_its_answers_back_and_is_summarised_per_seed(
        micro_model_dir, micro_world_dir, tmp_path):
    """Each seed of a run is attacked and probed; relearning on forget rows lowers their loss (the model learns
    them), and the summary holds before_* and <attack>_* keys with their spread."""
    from pipeline.common.runs import COMPLETE_RECORD

    run = tmp_path / "run"
    for seed in (0, 1):
        shutil.copytree(micro_model_dir, run / f"seed{seed}" / "model")
    (run / COMPLETE_RECORD).write_text(json.dumps({"seeds": [0, 1]}))
    params = _params(micro_world_dir, train={"max_steps": 6, "lr": 1e-2})
    cfg, data = relearn_config(params), DataConfig.from_params(params["data"])
    ecfg = EvalConfig.from_params({"source": str(micro_world_dir), "max_new_tokens": 8, "batch_size": 8,
                                   "tofu_sets": ["forget", "retain"], "multiple_choice": {}}, "evaluate")

    def attack(model_path, probe, n):
        return relearning_attack(model_path, probe, n, cfg, data)

    summary = evaluate_attack(str(run), attack, ecfg, tmp_path / "out", tmp_path / "m.json", "run")
    assert summary["seeds"] == [0, 1]
    for key in ("before_forget_es", "forget_forget_es", "retain_forget_es", "forget_retain_es"):
        assert key in summary and f"{key}_std" in summary
    assert summary["before_forget_es_std"] == 0.0  # the two seeds are the same model
    per_seed = json.loads((tmp_path / "out" / "seed0.json").read_text())
    assert per_seed["forget"]["final_loss"] < 6.0 and per_seed["forget"]["rows"]
    assert json.loads((tmp_path / "m.json").read_text()) == summary
