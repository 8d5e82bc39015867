"""Mass shift on the forget answers (pipeline/studies/mass_shift.py): the summary on hand-made records, the
records of a hand-made sample, and `tokenunlearn diagnose` end to end on the micro world."""

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from pipeline.common.errors import DataError
from pipeline.data.config import DataConfig
from pipeline.studies.mass_shift import (ForgetSample, load_forget_samples, load_run_weights, selected_tokens,
                                            summarize, token_records)
from pipeline.training.engine import TrainConfig
from pipeline.training.unlearn import UnlearnConfig, run_unlearn
from stages.cli import cli


def _record(sample_id, index, fact, selected, position, delta, top_before, top_after, seed=None):
    return {"seed": seed, "sample_id": sample_id, "index": index, "fact": fact, "selected": selected,
            "position": position, "delta": delta, "argmax_target": top_before, "argmax_unlearned": top_after}


# Sample 0: a drop of 3.5 (0.5 on the first token, 3 on the fact's first); sample 1: a drop of 4, half and half.
RECORDS = [
    _record(0, 0, False, False, "answer_first", -0.5, True, True),
    _record(0, 1, True, True, "fact_first", -3.0, True, False),
    _record(0, 2, True, True, "other", +0.5, False, False),
    _record(1, 0, False, False, "answer_first", -2.0, False, False),
    _record(1, 1, True, True, "fact_first", -2.0, True, False),
]


def test_summary_by_hand():
    summary = summarize(RECORDS)
    groups = {(g["fact"], g["selected"], g["position"]): g for g in summary["groups"]}
    assert set(groups) == {("not_fact", "unselected", "answer_first"), ("fact", "selected", "fact_first"),
                           ("fact", "selected", "other")}
    first = groups["not_fact", "unselected", "answer_first"]
    assert first["tokens"] == 2 and first["mean_delta"] == pytest.approx(-1.25)
    assert first["drop_share"] == pytest.approx((0.5 / 3.5 + 0.5) / 2)   # per sample, then averaged
    assert first["token_share"] == pytest.approx((1 / 3 + 1 / 2) / 2)
    assert first["flip_rate"] == 0.0                                     # its one target-argmax token stays first
    fact_first = groups["fact", "selected", "fact_first"]
    assert fact_first["mean_delta"] == pytest.approx(-2.5) and fact_first["flip_rate"] == 1.0
    assert fact_first["drop_share"] == pytest.approx((3 / 3.5 + 0.5) / 2)
    other = groups["fact", "selected", "other"]
    assert other["drop_share"] == 0.0 and other["token_share"] == pytest.approx(1 / 6) and other["flip_rate"] is None
    assert sum(g["drop_share"] for g in groups.values()) == pytest.approx(1.0)

    overall = summary["overall"]
    assert overall["tokens"] == 5 and overall["samples"] == 2
    assert overall["mean_delta"] == pytest.approx(-1.4)
    assert overall["mean_delta_fact"] == pytest.approx(-1.5) and overall["mean_delta_not_fact"] == pytest.approx(-1.25)
    assert overall["mean_delta_selected"] == pytest.approx(-1.5)
    assert overall["spill"] == pytest.approx(-1.25 / -1.5)
    assert overall["selected_share"] == pytest.approx(0.6) and overall["flip_rate"] == pytest.approx(2 / 3)
    assert overall["fact_selected"] == 1.0 and overall["selected_fact"] == 1.0
    assert overall["drop_on_facts"] == pytest.approx((3.0 + 2.0) / 7.5)            # pooled over both samples
    assert overall["flip_rate_fact_first"] == 1.0 and overall["flip_rate_answer_first"] == 0.0
    unselected_fact = summarize([{**RECORDS[1], "selected": False}, *RECORDS[2:]])["overall"]
    assert unselected_fact["fact_selected"] == pytest.approx(2 / 3) and unselected_fact["selected_fact"] == 1.0


def test_spill_is_undefined_when_every_token_is_selected_and_seeds_are_separate_samples():
    records = [{**r, "selected": True, "seed": seed} for seed in (0, 1) for r in RECORDS]
    summary = summarize(records)["overall"]
    assert summary["spill"] is None and summary["mean_delta_unselected"] is None and summary["samples"] == 4


def test_a_sample_without_a_drop_counts_in_the_means_but_not_in_the_shares():
    records = RECORDS + [_record(2, 0, None, True, "answer_first", 0.25, False, False)]
    summary = summarize(records)
    unknown = next(g for g in summary["groups"] if g["fact"] == "unknown")
    assert unknown["tokens"] == 1 and unknown["mean_delta"] == 0.25
    assert unknown["drop_share"] == 0.0 and unknown["token_share"] == 0.0  # only samples 0 and 1 have a drop
    assert summary["overall"]["samples"] == 3 and summary["overall"]["mean_delta_fact"] == pytest.approx(-1.5)


def test_selected_tokens_per_weighting():
    assert selected_tokens("uniform", np.ones(3)).all()
    assert selected_tokens("hard", np.array([0.0, 1.0, 0.0])).tolist() == [False, True, False]
    assert selected_tokens("soft", np.array([0.1, 0.2, 0.3, 0.4])).tolist() == [False, False, True, True]


def test_records_of_a_hand_made_sample():
    sample = ForgetSample(7, np.arange(6), np.array([0, 0, 1, 1, 1, 1], bool), np.array([0, 0, 1, 1, 0, 1], bool))
    target = (np.array([np.nan, -1, -1, -2, -3, -4]), np.array([0, 1, 1, 1, 0, 1], bool))
    unlearned = (np.array([np.nan, -1, -1.5, -2, -5, -4]), np.array([0, 1, 1, 0, 0, 1], bool))
    weights = np.array([0, 0, 0, 1, 0, 1.0])
    records = token_records(sample, "hard", weights, target, unlearned)
    assert [r["index"] for r in records] == [0, 1, 2, 3]
    assert [r["rel_position"] for r in records] == [0, 0.25, 0.5, 0.75]
    assert [r["position"] for r in records] == ["answer_first", "other", "other", "fact_first"]
    assert [r["first_of_fact"] for r in records] == [True, False, False, True]
    assert [r["selected"] for r in records] == [False, True, False, True]
    assert [r["delta"] for r in records] == [-0.5, 0.0, -2.0, 0.0]
    assert [r["argmax_unlearned"] for r in records] == [True, False, False, True]
    no_facts = token_records(ForgetSample(7, sample.input_ids, sample.scored, None), "uniform", np.ones(6), target,
                             unlearned)
    assert {r["fact"] for r in no_facts} == {None} and all(r["selected"] for r in no_facts)


def test_weights_of_other_shards_are_refused(tmp_path):
    import pyarrow as pa

    path = tmp_path / "token_weights.parquet"
    pq.write_table(pa.table({"sample_id": [1], "input_ids": [[1, 2]], "weight": [[0.0, 1.0]]}).replace_schema_metadata(
        {"tokenunlearn": json.dumps({"weighting": "hard"})}), path)
    sample = ForgetSample(1, np.array([1, 3]), np.array([False, True]), None)
    with pytest.raises(DataError, match="sample 1 has other token ids"):
        load_run_weights(path, [sample])


TRAIN = {"epochs": 2, "lr": 1e-2, "micro_batch_size": 2, "warmup_ratio": 0.0, "seed": 0}


def test_diagnose_end_to_end(attribution_dir, micro_model_dir, micro_world_dir, tmp_path):
    shards = attribution_dir[0] / "shards"
    runs = {}
    for name, weighting in (("npo", "uniform"), ("t_npo", "hard")):
        cfg = UnlearnConfig.from_params({"method": "npo", "weighting": weighting, "r": 0.3}, "u")
        runs[name] = tmp_path / name
        run_unlearn(name, cfg, TrainConfig.from_params(TRAIN, "t"), DataConfig(source=str(micro_world_dir)),
                    str(micro_model_dir), shards, runs[name] / "seed0", tmp_path / f"ckpt-{name}",
                    tmp_path / f"{name}.csv", False)
    out = tmp_path / "diagnose"
    args = ["diagnose", "--target", str(micro_model_dir), "--shards", str(shards), "--out", str(out),
            "--batch-size", "3", *[f"--run={name}={d}" for name, d in runs.items()]]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output

    samples = load_forget_samples(shards)
    scored = sum(int(s.scored.sum()) for s in samples)
    tokens = pq.read_table(out / "tokens.parquet").to_pylist()
    assert len(tokens) == 2 * scored and {(r["run"], r["seed"]) for r in tokens} == {("npo", 0), ("t_npo", 0)}
    # teacher forcing lines up with stage one's: the target's log p is the shards' logp_orig
    logp_orig = {row["sample_id"]: row["logp_orig"] for row in pq.read_table(shards).to_pylist()}
    positions = {s.sample_id: np.flatnonzero(s.scored) for s in samples}
    for r in tokens[:scored]:
        assert r["logp_target"] == pytest.approx(logp_orig[r["sample_id"]][positions[r["sample_id"]][r["index"]]],
                                                 abs=1e-4)
    assert all(r["selected"] for r in tokens if r["run"] == "npo")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["npo"]["weighting"] == "uniform" and summary["npo"]["overall"]["spill"] is None
    assert summary["t_npo"]["weighting"] == "hard" and summary["t_npo"]["overall"]["spill"] is not None
    assert summary["npo"]["overall"]["mean_delta"] < 0  # unlearning lowered the forget answers' log p
    assert "| npo | uniform |" in (out / "summary.md").read_text()

    bad = CliRunner().invoke(cli, [*args[:-2], f"--run=x={tmp_path / 'nothing'}"])
    assert bad.exit_code != 0 and "no seed*/ directory" in str(bad.exception)
