"""The metrics registry: one entry per metric, whose title, direction and range serve the report's tables, its
summary checks and the table over model seeds alike."""

import numpy as np
import pytest

from pipeline.common.errors import DataError
from pipeline.evaluation.metrics import (HIGHER, LMEVAL, LOWER, MAIN, MC, NEAREST, REGISTRY, ROBUSTNESS, SEEDS,
                                         columns, family_columns, metric, value_range)


def test_each_metric_is_registered_once_and_its_title_says_its_direction():
    assert len({m.key for m in REGISTRY}) == len(REGISTRY)
    arrows = {HIGHER: "↑", LOWER: "↓", NEAREST: "(→"}
    for m in REGISTRY:
        assert arrows[m.better] in m.title and not any(a in m.title for d, a in arrows.items() if d != m.better), m
        assert set(m.tables) <= {MAIN, ROBUSTNESS, SEEDS}, m
    # a paired test calls a difference better or worse: only in a column with a direction
    assert all(m.better in (HIGHER, LOWER) for m in columns(SEEDS))
    # in no table: checked in the summaries, not shown (the privleak of the attacks without a column)
    assert [m.key for m in REGISTRY if not m.tables] == ["privleak_loss", "privleak_zlib", "privleak_min_k_plus_plus"]


def test_columns_keep_registry_order_and_the_families():
    assert [m.key for m in columns(MAIN)] == ["retain_es", "forget_es", "model_utility", "log10_forget_quality"]
    assert [m.key for m in columns(SEEDS)][-2:] == ["mc_world_forget", "mc_world_retain"]
    assert [m.key for m in columns(ROBUSTNESS)][:4] == ["privleak", "mia_min_k_plus_plus_auc", "privleak_gradnorm",
                                                        "privleak_reference"]
    assert MC.column("mc_wmdp_bio").title == "wmdp_bio acc"
    assert MC.keys([{"mc_b": 1, "mc_a": 0, "mc_a_std": 0, "forget_es": 1}, {"mc_c": 0}]) == ["mc_a", "mc_b", "mc_c"]
    assert LMEVAL.column("lmeval_mmlu_acc").title == "lm-eval mmlu_acc"
    summaries = [{"lmeval_gsm8k_exact_match": 0.5, "lmeval_gsm8k_exact_match_stderr": 0.1, "mc_b": 1.0},
                 {"lmeval_gsm8k_exact_match_std": 0.0, "lmeval_arc_acc": 0.25, "mc_a": 0.0, "forget_es": 0.5}]
    # family by family (multiple choice first), each sorted; no stderr nor _std column
    assert [m.key for m in family_columns(MAIN, summaries)] == ["mc_a", "mc_b", "lmeval_arc_acc",
                                                                "lmeval_gsm8k_exact_match"]
    assert family_columns(ROBUSTNESS, summaries) == []
    with pytest.raises(ValueError, match="table 'plots': unknown"):
        columns("plots")


@pytest.mark.parametrize("key, expected", [
    ("forget_es", (0.0, 1.0)), ("mia_min_k_plus_plus_auc", (0.0, 1.0)), ("log10_forget_quality", (None, 0.0)),
    ("privleak", (None, None)), ("mc_wmdp_bio", (0.0, 1.0)), ("q4_mc_world_forget", (0.0, 1.0)),
    ("privleak_std", (0.0, None)), ("seconds", (None, None)), ("privleak_gradnorm", (None, None)),
    ("privleak_zlib", (None, None)), ("lmeval_wikitext_word_perplexity", (None, None)),
    ("lmeval_mmlu_acc_stderr", (0.0, None)), ("lmeval_mmlu_acc_stderr_std", (0.0, None)),
])
def test_value_ranges(key, expected):
    assert value_range(key) == expected


def test_only_registered_keys_and_the_families_are_metrics():
    assert metric("forget_es").better == LOWER and metric("mc_world_forget").title == "forget MC, cloze ↓"
    assert metric("mc_mmlu").title == "mmlu acc" and metric("forget_em") is None and metric("seconds") is None
    assert metric("lmeval_mmlu_acc").title == "lm-eval mmlu_acc" and metric("privleak_loss").tables == ()
    assert metric("mia_loss_auc") is None  # of the AUCs, only Min-K%++'s is registered


def test_the_report_checks_a_registered_metrics_range(tmp_path):
    from pipeline.studies.report import check_summary

    check_summary({"forget_es": 0.5, "privleak": -250.0, "seconds": 12.0, "privleak_loss": -80.0,
                   "lmeval_wikitext_word_perplexity": 35.5}, tmp_path / "m.json")
    with pytest.raises(DataError, match=r"m.json: mia_min_k_plus_plus_auc: 1.5 is out of range \[0, 1\]"):
        check_summary({"mia_min_k_plus_plus_auc": 1.5}, tmp_path / "m.json")
    with pytest.raises(DataError, match=r"m.json: privleak_zlib"):
        check_summary({"privleak_zlib": float("nan")}, tmp_path / "m.json")
    with pytest.raises(DataError, match=r"m.json: lmeval_mmlu_acc_stderr: -0.1 is out of range"):
        check_summary({"lmeval_mmlu_acc_stderr": -0.1}, tmp_path / "m.json")


def test_a_metric_has_one_title_in_the_report_and_in_the_table_over_seeds():
    """The report's robustness table and report-seeds' table title the forget authors' multiple choice alike."""
    from pipeline.studies.report import Row, results_table
    from pipeline.studies.significance import Cells, main_table

    rows = [Row("t", "before unlearning", "", "", {"mc_world_forget": 1.0, "q4_forget_es": 0.9})]
    report_header = results_table(rows, [metric("mc_world_forget")])[0].splitlines()[0]
    values = {m.key: np.full((1, 1), 1.0 if m.key == "mc_world_forget" else np.nan) for m in columns(SEEDS)}
    seeds_header = main_table({"t": Cells("t", values)}, {})[0].splitlines()[0]
    assert report_header == "| model | run | forget MC, cloze ↓ |" and seeds_header == report_header
