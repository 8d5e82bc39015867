"""Evaluation during unlearning: the selection rule on hand-made rows, the monitor's rows in a run, and the
weights of the selected step written in place of the last step's."""

import csv
import json

import pytest

from pipeline.common.errors import ParamError
from pipeline.data.config import DataConfig
from pipeline.evaluation.monitor import MonitorConfig, TrainingMonitor, monitor_from_params
from pipeline.training.engine import TrainConfig
from pipeline.training.unlearn import UnlearnConfig, run_unlearn

TRAIN = {"epochs": 3, "lr": 3e-3, "micro_batch_size": 2, "warmup_ratio": 0.0, "seed": 0}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _rule_monitor(**select) -> TrainingMonitor:
    monitor = TrainingMonitor.__new__(TrainingMonitor)  # the rule alone: no data or model
    monitor.cfg = MonitorConfig.from_params({"every": 1, "select": select})
    monitor.best, monitor.reference = None, None
    return monitor


def test_the_rule_keeps_the_lowest_forget_es_above_the_utility_floor():
    m = _rule_monitor(floor=0.9)
    rows = [{"step": 0, "eval_forget_es": 0.8, "eval_retain_mu": 0.50},   # reference MU 0.5: floor 0.45
            {"step": 2, "eval_forget_es": 0.5, "eval_retain_mu": 0.48},   # better: kept
            {"step": 4, "eval_forget_es": 0.2, "eval_retain_mu": 0.40},   # below the floor: not kept
            {"step": 6, "eval_forget_es": 0.5, "eval_retain_mu": 0.46},   # a tie with step 2: the earlier stays
            {"step": 8, "eval_forget_es": 0.3, "eval_retain_mu": 0.45}]   # exactly at the floor: kept
    assert [m.keep(r) for r in rows] == [True, True, False, False, True]
    assert m.best["step"] == 8
    # no unlearned step keeps the floor: the model before unlearning is the rule's choice
    m = _rule_monitor(floor=1.0)
    assert [m.keep(r) for r in rows] == [True, False, False, False, False]


def test_monitor_params_name_the_key():
    with pytest.raises(ParamError, match=r"unlearn.monitor.select.minimize"):
        MonitorConfig.from_params({"every": 2, "select": {"minimize": "accuracy"}})
    with pytest.raises(ParamError, match=r"unlearn.monitor.select: needs unlearn.monitor.every > 0"):
        MonitorConfig.from_params({"select": {"floor": 0.9}})
    with pytest.raises(ParamError, match=r"unlearn.monitor.select.floor"):
        MonitorConfig.from_params({"every": 1, "select": {"floor": 1.5}})
    with pytest.raises(ParamError, match=r"unlearn.monitor.n_item"):
        MonitorConfig.from_params({"every": 1, "n_item": 3})


def _run(tmp_path, attribution_dir, model_dir, world_dir, tag, monitor_cfg, **train):
    spec = monitor_from_params({"data": {"source": str(world_dir)},
                                "unlearn": {"monitor": {"batch_size": 8, "max_new_tokens": 8, **monitor_cfg}}})
    out = tmp_path / tag
    run_unlearn(tag, UnlearnConfig(method="ga", weighting="hard"), TrainConfig.from_params({**TRAIN, **train}, "t"),
                DataConfig(source=str(world_dir)), str(model_dir), attribution_dir[0] / "shards", out,
                tmp_path / f"ckpt-{tag}", tmp_path / f"{tag}.csv", False, None, spec, tmp_path / f"{tag}-monitor.csv",
                spec.selection)
    with open(tmp_path / f"{tag}-monitor.csv") as f:
        return out, spec, list(csv.DictReader(f))


def test_a_run_is_evaluated_every_n_steps_and_at_the_end(attribution_dir, micro_model_dir, micro_world_dir,
                                                         tmp_path):
    out, _, rows = _run(tmp_path, attribution_dir, micro_model_dir, micro_world_dir, "watched", {"every": 2})
    loss_rows = list(csv.DictReader(open(tmp_path / "watched.csv")))
    last = int(loss_rows[-1]["step"])
    steps = [int(r["step"]) for r in rows]
    assert steps == [0] + list(range(2, last + 1, 2)) + ([last] if last % 2 else [])
    assert all(0 <= float(r["eval_retain_mu"]) <= 1 for r in rows)
    assert not any(k.startswith("eval_") for k in loss_rows[0])  # the loss curve keeps its own columns
    assert "selected_step" not in json.loads((out / "run.json").read_text())


def test_on_plain_splits_the_monitor_reads_them_and_has_no_retain_mu(attribution_dir, micro_model_dir,
                                                                    micro_world_dir, tmp_path):
    """A user's own data has no perturbed answers: the forget and retain splits themselves, ES and the retain
    probability and ROUGE, no truth ratio, so no MU; a rule reading MU there is refused."""
    out, spec, rows = _run(tmp_path, attribution_dir, micro_model_dir, micro_world_dir, "plain",
                           {"every": 2, "perturbed": False, "forget_split": "forget10", "retain_split": "retain90",
                            "n_items": 4})
    assert list(rows[0]) == ["step", "eval_forget_es", "eval_retain_es", "eval_retain_probability",
                             "eval_retain_rouge"]
    monitor = spec(None)
    assert "perturbed_answer" not in monitor.forget[0] and len(monitor.retain) == 4
    with pytest.raises(ParamError, match=r"unlearn.monitor.select: eval_retain_mu needs perturbed answers, which "
                                         r"plain splits \(unlearn.monitor.perturbed: false\) do not have"):
        MonitorConfig.from_params({"every": 1, "perturbed": False, "select": {"floor": 0.9}})
    assert MonitorConfig.from_params({"every": 1, "perturbed": False,
                                      "select": {"floor_metric": "eval_retain_es"}}).rule.floor_metric == \
        "eval_retain_es"


def test_the_selected_steps_weights_are_written(attribution_dir, micro_model_dir, micro_world_dir, tmp_path):
    """With a rule, the written model is the selected step's: evaluated again, it gives that step's row."""
    from pipeline.common.modeling import load_model, load_tokenizer

    # every step eligible (floor 0): the lowest forget ES, whichever step that is
    out, spec, rows = _run(tmp_path, attribution_dir, micro_model_dir, micro_world_dir, "chosen",
                           {"every": 1, "select": {"floor": 0.0}, "n_items": 6})
    chosen = json.loads((out / "run.json").read_text())["selected_step"]
    best = min(rows, key=lambda r: (float(r["eval_forget_es"]), int(r["step"])))
    assert chosen == int(best["step"])
    monitor = spec(load_tokenizer(str(out / "model")))
    again = monitor.evaluate(load_model(str(out / "model")), chosen)
    for key in ("eval_forget_es", "eval_retain_mu", "eval_retain_es"):
        assert again[key] == pytest.approx(float(best[key]), abs=1e-5)


def test_selection_refuses_checkpoints_it_could_not_restore(attribution_dir, micro_model_dir, micro_world_dir,
                                                            tmp_path):
    with pytest.raises(ParamError, match="checkpoint_every to 0"):
        _run(tmp_path, attribution_dir, micro_model_dir, micro_world_dir, "ckpt",
             {"every": 1, "select": {"floor": 0.5}}, checkpoint_every=2)
    assert not (tmp_path / "ckpt").exists()
