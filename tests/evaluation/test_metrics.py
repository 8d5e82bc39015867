"""The metrics registry: one entry per metric, whose title, direction and range serve the report's tables, its
summary checks and the table over model seeds alike."""

import numpy as np
import pytest

from pipeline.common.errors import DataError, TokenUnlearnError
from pipeline.evaluation.registry import (HEADLINE_KEYS, HIGHER, IN_EVALUATE_SUMMARY, LMEVAL, LOWER, MAIN, MC,
                                          METRICS, MIA_ATTACKS, MONITOR, MUSE, NEAREST, REGISTRY, ROBUSTNESS, SEEDS,
                                          TOFU_SET, check_registered, columns, family_columns, keys_of, metric, of,
                                          unregistered, value_range)


def test_each_metric_is_registered_once_and_its_title_says_its_direction():
    for scope in (METRICS.values(), of(MUSE), of(MONITOR), of(TOFU_SET)):
        keys = [m.key for m in scope]
        assert len(set(keys)) == len(keys)
    arrows = {HIGHER: "↑", LOWER: "↓", NEAREST: "→"}
    for m in REGISTRY:
        assert arrows[m.better] in m.direction and not any(a in m.title for d, a in arrows.items() if d != m.better), m
        assert set(m.tables) <= {MAIN, ROBUSTNESS, SEEDS}, m
        assert not m.tables or m.benchmark in IN_EVALUATE_SUMMARY, m  # the tables read `evaluate`'s summaries
    # a paired test calls a difference better or worse: only in a column with a direction
    assert all(m.better in (HIGHER, LOWER) for m in columns(SEEDS))
    # checked in the summaries, not shown: the privleak of the attacks without a column, among others
    assert {"privleak_loss", "privleak_zlib", "privleak_min_k_plus_plus"} <= {
        m.key for m in METRICS.values() if not m.tables}


def test_what_a_metric_is_computed_from_is_registered():
    keys = {m.key for m in REGISTRY}
    assert all(set(m.depends_on) <= keys for m in REGISTRY), [m for m in REGISTRY if set(m.depends_on) - keys]
    assert metric("forget_quality").depends_on == ("truth_ratio",)
    assert metric("log10_forget_quality").depends_on == ("forget_quality",)


def test_the_registry_is_the_list_each_evaluator_writes_from():
    """TOFU's per-set aggregates, membership inference's attacks and the monitor's numbers are the registry's."""
    from pipeline.evaluation.mia import MIA_ATTACKS as ATTACKS_SCORED
    from pipeline.evaluation.monitor import METRICS as MONITORED
    from pipeline.evaluation.tofu_sets import SET_METRICS

    assert set(SET_METRICS) <= set(keys_of(TOFU_SET))
    assert tuple(ATTACKS_SCORED) == MIA_ATTACKS
    assert MONITORED == keys_of(MONITOR)
    assert HEADLINE_KEYS == ("forget_es", "retain_es", "model_utility", "log10_forget_quality", "privleak")


def test_a_summary_key_no_metric_is_named_before_anything_is_written():
    summary = {"model": "m", "forget_es": 0.5, "forget_es_std": 0.0, "q8_forget_em": 0.1, "mc_mmlu": 0.3,
               "relearn_forget_forget_rouge": 0.2, "lmeval_arc_acc_stderr": 0.01, "seeds": [0], "n": 3}
    assert unregistered(summary) == ["n"]
    assert unregistered({"verbmem_f": 10.0, "knowmem_f": 2.0, "forget_es": 0.4}, MUSE) == ["forget_es"]
    with pytest.raises(TokenUnlearnError, match=r"evaluating m: \['forget_rate'\] are no metric"):
        check_registered({"forget_rate": 0.5}, "m")
    assert metric("q8_forget_em").title == "forget EM, q8 ↓" and metric("q8_forget_em").range == (0.0, 1.0)
    assert metric("relearn_before_mc_world_forget").better == LOWER and metric("q4_seconds") is None


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
    assert metric("mc_mmlu").title == "mmlu acc" and metric("seconds") is None
    assert metric("lmeval_mmlu_acc").title == "lm-eval mmlu_acc" and metric("privleak_loss").tables == ()
    assert metric("forget_em").tables == () and metric("mia_loss_auc").tables == ()  # checked, not shown


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
