"""open-unlearning's layout: TOFU_EVAL.json and TOFU_SUMMARY.json beside every evaluation, their values against
open-unlearning's own expressions, the re-export command, and a retain model's TOFU_EVAL.json read back for forget
quality (a round trip gives forget quality 1), with its refusals."""

import json
import logging

import numpy as np
import pytest
from click.testing import CliRunner

from pipeline.common.errors import DataError
from pipeline.evaluation.config import EvalConfig
from pipeline.evaluation.evaluate import evaluate_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

SETS = ("forget", "retain", "real_authors", "world_facts")
PROB = ("prob", "avg_loss")
ROUGE = ("rouge1_recall", "rougeL_f1", "rougeL_recall", "input", "ground_truth", "generation")
SCORE = ("score",)
# Every entry of TOFU_EVAL.json for the four sets, and the keys of its per-item dicts (None: agg_value only).
LAYOUT = {
    "forget_Q_A_Prob": PROB, "forget_Q_A_PARA_Prob": PROB, "forget_Q_A_PERT_Prob": PROB, "forget_truth_ratio": SCORE,
    "forget_Q_A_ROUGE": ROUGE, "forget_quality": None, "extraction_strength": SCORE, "exact_memorization": SCORE,
    "retain_Q_A_Prob": PROB, "retain_Q_A_PARA_Prob": PROB, "retain_Q_A_PERT_Prob": PROB,
    "retain_Truth_Ratio": SCORE, "retain_Q_A_ROUGE": ROUGE,
    **{k: v for p in ("ra", "wf") for k, v in {
        f"{p}_Q_A_Prob": PROB, f"{p}_Q_A_PERT_Prob": PROB, f"{p}_Q_A_Prob_normalised": ("prob",),
        f"{p}_Truth_Ratio": SCORE, f"{p}_Q_A_ROUGE": ROUGE}.items()},
    "model_utility": None,
}
SUMMARY = ["exact_memorization", "extraction_strength", "forget_Q_A_Prob", "forget_Q_A_ROUGE", "forget_quality",
           "forget_truth_ratio", "model_utility"]


def _cfg(world_dir, **kw):
    return EvalConfig.from_params({"source": str(world_dir), "max_new_tokens": 8, "batch_size": 8, **kw}, "evaluate")


@pytest.fixture(scope="module")
def evaluation(micro_model_dir, micro_world_dir, tmp_path_factory):
    """The micro model evaluated as its own retain model: (directory, summary, TOFU_EVAL.json)."""
    out = tmp_path_factory.mktemp("ou") / "retain"
    summary = evaluate_model(str(micro_model_dir), _cfg(micro_world_dir), out, out)
    return out, summary, json.loads((out / "TOFU_EVAL.json").read_text())


def test_tofu_eval_json_has_open_unlearnings_layout(evaluation, micro_world_dir):
    from pipeline.data.tofu import load_split

    out, summary, logs = evaluation
    text = (out / "TOFU_EVAL.json").read_text()
    assert text.startswith('{\n    "') and list(logs) == sorted(LAYOUT)  # indent 4, top-level keys sorted
    sizes = {p: len(load_split(micro_world_dir, s)) for p, s in (
        ("forget", "forget10_perturbed"), ("retain", "retain_perturbed"), ("ra", "real_authors_perturbed"),
        ("wf", "world_facts_perturbed"), ("extraction", "forget10_perturbed"), ("exact", "forget10_perturbed"))}
    for key, inner in LAYOUT.items():
        if inner is None:
            assert list(logs[key]) == ["agg_value"]
            continue
        assert list(logs[key]) == ["agg_value", "value_by_index"]
        by_index = logs[key]["value_by_index"]
        assert list(by_index) == [str(i) for i in range(sizes[key.split("_")[0]])]  # string indices, in order
        assert all(list(v) == list(inner) for v in by_index.values()), key
    assert all(isinstance(v["prob"], list) and len(v["prob"]) == len(v["avg_loss"])
               for v in logs["forget_Q_A_PERT_Prob"]["value_by_index"].values())
    assert logs["forget_quality"] == {"agg_value": 1.0}  # the retain model against itself

    tofu_summary = json.loads((out / "TOFU_SUMMARY.json").read_text())
    assert list(tofu_summary) == SUMMARY and all(tofu_summary[k] == logs[k]["agg_value"] for k in SUMMARY)
    # metrics.json keeps its rounded numbers of the same values
    assert summary["forget"]["probability"] == round(logs["forget_Q_A_Prob"]["agg_value"], 6)
    assert summary["real_authors"]["probability"] == round(logs["ra_Q_A_Prob_normalised"]["agg_value"], 6)
    assert summary["forget_es"] == round(logs["extraction_strength"]["agg_value"], 6)
    assert summary["forget_em"] == round(logs["exact_memorization"]["agg_value"], 6)
    assert summary["model_utility"] == round(logs["model_utility"]["agg_value"], 6)


def test_values_are_open_unlearnings_expressions_of_its_own_entries(evaluation):
    """Each derived entry recomputed from the file's own per-item values with open-unlearning's expressions
    (memorization.py, utility.py), bit for bit."""
    from scipy.stats import hmean

    logs = evaluation[2]
    values = lambda key, stat: [v[stat] for v in logs[key]["value_by_index"].values()]
    for p in ("forget", "retain", "ra", "wf"):
        assert logs[f"{p}_Q_A_Prob"]["agg_value"] == np.mean(values(f"{p}_Q_A_Prob", "prob"))
        pert_prob, pert_loss = np.array(values(f"{p}_Q_A_PERT_Prob", "prob")), values(f"{p}_Q_A_PERT_Prob", "avg_loss")
        assert logs[f"{p}_Q_A_PERT_Prob"]["agg_value"] == np.mean(np.mean(pert_prob, axis=1))
        correct = f"{p}_Q_A_PARA_Prob" if p in ("forget", "retain") else f"{p}_Q_A_Prob"
        tr = np.exp(-np.mean(np.array(pert_loss), axis=1)) / (np.exp(-np.array(values(correct, "avg_loss"))) + 1e-10)
        tr_key = "forget_truth_ratio" if p == "forget" else f"{p}_Truth_Ratio"
        assert values(tr_key, "score") == tr.tolist()
        aggregate = np.mean(np.minimum(tr, 1 / (tr + 1e-10))) if p == "forget" else np.mean(np.maximum(0, 1 - tr))
        assert logs[tr_key]["agg_value"] == aggregate
        assert logs[f"{p}_Q_A_ROUGE"]["agg_value"] == np.mean(values(f"{p}_Q_A_ROUGE", "rougeL_recall"))
        assert all(v["prob"] == pytest.approx(np.exp(-v["avg_loss"]), rel=1e-6)
                   for v in logs[f"{p}_Q_A_Prob"]["value_by_index"].values())
        if p in ("ra", "wf"):
            correct_prob = np.array(values(f"{p}_Q_A_Prob", "prob"))
            normalised = correct_prob / (correct_prob + np.sum(pert_prob, axis=1) + 1e-10)
            assert values(f"{p}_Q_A_Prob_normalised", "prob") == normalised.tolist()
            assert logs[f"{p}_Q_A_Prob_normalised"]["agg_value"] == np.mean(normalised)
    order = ["retain_Q_A_Prob", "retain_Q_A_ROUGE", "retain_Truth_Ratio", "ra_Q_A_Prob_normalised", "ra_Q_A_ROUGE",
             "ra_Truth_Ratio", "wf_Q_A_Prob_normalised", "wf_Q_A_ROUGE", "wf_Truth_Ratio"]
    assert logs["model_utility"]["agg_value"] == hmean([logs[k]["agg_value"] for k in order])
    assert logs["extraction_strength"]["agg_value"] == np.mean(values("extraction_strength", "score"))
    assert logs["exact_memorization"]["agg_value"] == np.mean(values("exact_memorization", "score"))


def test_the_export_command_rewrites_the_same_files(evaluation, tmp_path):
    from stages.cli import cli

    out = evaluation[0]
    result = CliRunner().invoke(cli, ["export-open-unlearning", str(out), "--out", str(tmp_path / "export")])
    assert result.exit_code == 0, result.output
    for name in ("TOFU_EVAL.json", "TOFU_SUMMARY.json"):
        assert (tmp_path / "export" / name).read_bytes() == (out / name).read_bytes()
    result = CliRunner().invoke(cli, ["export-open-unlearning", str(tmp_path / "export")])
    assert result.exit_code != 0 and "not an evaluation directory" in str(result.exception)


def test_a_run_exports_each_seed(evaluation, tmp_path):
    import shutil

    from pipeline.evaluation.open_unlearning import export_evaluation

    for seed in (0, 3):
        shutil.copytree(evaluation[0], tmp_path / "run" / f"seed{seed}", ignore=shutil.ignore_patterns("TOFU_*"))
    assert export_evaluation(tmp_path / "run", tmp_path / "out") == [tmp_path / "out" / "seed0",
                                                                       tmp_path / "out" / "seed3"]
    for seed in (0, 3):
        assert (tmp_path / "out" / f"seed{seed}" / "TOFU_EVAL.json").read_bytes() == \
            (evaluation[0] / "TOFU_EVAL.json").read_bytes()


def _forget_only(world_dir):
    return _cfg(world_dir, tofu_sets=["forget"])


@pytest.mark.parametrize("as_directory", [False, True])
def test_round_trip_forget_quality_against_its_own_export_is_one(evaluation, micro_model_dir, micro_world_dir,
                                                                 tmp_path, caplog, as_directory):
    """The same model, its own TOFU_EVAL.json as the retain model's: forget quality 1, and a log line says what
    could be checked. Entries in any order are read in index order."""
    logs = evaluation[2]
    by_index = logs["forget_truth_ratio"]["value_by_index"]
    logs = {**logs, "forget_truth_ratio": {**logs["forget_truth_ratio"],
                                           "value_by_index": dict(reversed(list(by_index.items())))}}
    (tmp_path / "ou").mkdir()
    (tmp_path / "ou" / "TOFU_EVAL.json").write_text(json.dumps(logs))
    retain = tmp_path / "ou" if as_directory else tmp_path / "ou" / "TOFU_EVAL.json"
    with caplog.at_level(logging.INFO, logger="pipeline.evaluation"):
        summary = evaluate_model(str(micro_model_dir), _forget_only(micro_world_dir), tmp_path / "e", retain)
    assert summary["forget_quality"] == 1.0
    assert json.loads((tmp_path / "e" / "TOFU_SUMMARY.json").read_text())["forget_quality"] == 1.0
    assert "has no question hash: checked the count and its forget prompts" in caplog.text
    assert f"the {len(by_index)} prompts of {tmp_path / 'ou' / 'TOFU_EVAL.json'} are this evaluation's" in caplog.text


def _refused(evaluation, micro_model_dir, micro_world_dir, tmp_path, monkeypatch, change):
    """Evaluate against a changed copy of the TOFU_EVAL.json; the refusal must come before the model loads."""
    import pipeline.evaluation.evaluate as evaluate_mod

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the retain evaluation was checked")

    monkeypatch.setattr(evaluate_mod, "load_model", no_model)
    logs = json.loads(json.dumps(evaluation[2]))
    file = tmp_path / "TOFU_EVAL.json"
    file.write_text(change(logs) or json.dumps(logs))
    with pytest.raises(DataError) as error:
        evaluate_model(str(micro_model_dir), _forget_only(micro_world_dir), tmp_path / "e", file)
    assert "\n" not in str(error.value) and str(file) in str(error.value)
    assert not (tmp_path / "e").exists()
    return str(error.value)


def test_a_count_mismatch_is_refused(evaluation, micro_model_dir, micro_world_dir, tmp_path, monkeypatch):
    n = len(evaluation[2]["forget_truth_ratio"]["value_by_index"])
    message = _refused(evaluation, micro_model_dir, micro_world_dir, tmp_path, monkeypatch,
                       lambda logs: logs["forget_truth_ratio"]["value_by_index"].pop("0") and None)
    assert f"{n - 1} forget truth ratios, but the forget set has {n} items" in message


def test_other_prompts_are_refused(evaluation, micro_model_dir, micro_world_dir, tmp_path, monkeypatch):
    def other_prompt(logs):
        logs["forget_Q_A_ROUGE"]["value_by_index"]["2"]["input"] = "Who is someone else?"

    message = _refused(evaluation, micro_model_dir, micro_world_dir, tmp_path, monkeypatch, other_prompt)
    assert "forget item 2: its prompt 'Who is someone else?' is not this evaluation's" in message


@pytest.mark.parametrize("change, message", [
    (lambda logs: "{not json", "not a readable open-unlearning TOFU_EVAL.json"),
    (lambda logs: logs.pop("forget_truth_ratio") and None, "no forget_truth_ratio.value_by_index"),
    (lambda logs: logs["forget_truth_ratio"]["value_by_index"]["1"].pop("score") and None,
     "no forget_truth_ratio.value_by_index with a numeric score"),
])
def test_a_malformed_file_is_refused(evaluation, micro_model_dir, micro_world_dir, tmp_path, monkeypatch, change,
                                     message):
    assert message in _refused(evaluation, micro_model_dir, micro_world_dir, tmp_path, monkeypatch, change)


def test_without_rouge_inputs_only_the_count_is_checked(evaluation, micro_model_dir, micro_world_dir, tmp_path,
                                                        caplog):
    logs = {k: v for k, v in evaluation[2].items() if k != "forget_Q_A_ROUGE"}
    (tmp_path / "TOFU_EVAL.json").write_text(json.dumps(logs))
    with caplog.at_level(logging.INFO, logger="pipeline.evaluation"):
        summary = evaluate_model(str(micro_model_dir), _forget_only(micro_world_dir), tmp_path / "e", tmp_path)
    assert summary["forget_quality"] == 1.0
    assert "checked the count only: it has no forget_Q_A_ROUGE inputs" in caplog.text


def test_no_retain_model_gives_a_null_forget_quality_left_out_of_the_summary(micro_model_dir, micro_world_dir,
                                                                             tmp_path):
    evaluate_model(str(micro_model_dir), _forget_only(micro_world_dir), tmp_path / "e", None)
    logs = json.loads((tmp_path / "e" / "TOFU_EVAL.json").read_text())
    assert logs["forget_quality"] == {"agg_value": None} and "model_utility" not in logs
    assert list(json.loads((tmp_path / "e" / "TOFU_SUMMARY.json").read_text())) == [
        "exact_memorization", "extraction_strength", "forget_Q_A_Prob", "forget_Q_A_ROUGE", "forget_truth_ratio"]


def test_the_comparison_script_prints_both_definitions_side_by_side(micro_model_dir, micro_world_dir, tmp_path):
    """Target and retain model under open-unlearning's definitions and under es_definition=strict: the same
    numbers but extraction strength, which strict scores lower (0 where open-unlearning's loop gives 1/n)."""
    import yaml

    from pipeline.studies.compare_definitions import main

    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"data": {"source": str(micro_world_dir), "template": "plain"},
                                      "evaluate": {"max_new_tokens": 4, "batch_size": 8}}))
    result = CliRunner().invoke(main, ["--target", str(micro_model_dir), "--retain", str(micro_model_dir),
                                       "--params", str(params), "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    rows = {tuple(c.strip() for c in line.split("|")[1:3]): [c.strip() for c in line.split("|")[3:6]]
            for line in result.output.splitlines() if line.startswith("| ") and "---" not in line}
    assert list(rows)[0] == ("metric", "model") and rows[("metric", "model")][:2] == ["open-unlearning",
                                                                                       "es_definition=strict"]
    for model in ("target", "retain"):
        ours, strict, _ = rows[("extraction_strength", model)]
        assert float(strict) < float(ours)
        ours, strict, _ = rows[("retain_extraction_strength", model)]
        assert float(strict) < float(ours)
        for metric in ("forget_Q_A_Prob", "forget_truth_ratio", "model_utility", "forget_quality", "ra_Q_A_ROUGE"):
            first, second, diff = rows[(metric, model)]
            assert first == second and float(diff) == 0.0, metric
    assert rows[("forget_quality", "target")][0] == "1"  # the same model as its retain model


def test_an_evaluation_without_the_per_item_columns_is_refused(evaluation, tmp_path):
    """Items written before the export existed lack what open-unlearning's entries need: a one-line error."""
    import pyarrow.parquet as pq

    from pipeline.evaluation.open_unlearning import export_evaluation

    (tmp_path / "old" / "items").mkdir(parents=True)
    table = pq.read_table(evaluation[0] / "items" / "forget.parquet")
    pq.write_table(table.drop(["ground_truth", "perturbed_probability"]), tmp_path / "old" / "items" / "forget.parquet")
    with pytest.raises(DataError, match=r"its items lack \['ground_truth', 'perturbed_probability'\]: an evaluation "
                                        r"made before open-unlearning's export; evaluate the model again"):
        export_evaluation(tmp_path / "old", tmp_path / "out")


# ---- the last gaps found evaluating open-unlearning's own models, on hand-made cases (no model) ------------------

def test_the_summary_holds_forget_truth_ratio_as_open_unlearnings_does():
    from pipeline.evaluation.open_unlearning import summary_of

    logs = {"forget_truth_ratio": {"agg_value": 0.7, "value_by_index": {"0": {"score": 0.7}}},
            "retain_Truth_Ratio": {"agg_value": 0.3}, "forget_quality": {"agg_value": None}}
    assert summary_of(logs) == {"forget_truth_ratio": 0.7}  # a top-level metric; retain's is model utility's part


def test_open_unlearnings_privleak_takes_the_retain_auc_or_its_default():
    from pipeline.evaluation.open_unlearning import ou_privleak

    # s = 1 − AUC = 0.2; against the default s_ref = 1 − 0.5: (0.2 − 0.5) / 0.5 · 100; against AUC 0.6: / 0.4
    assert ou_privleak({"min_k": 0.8}, None) == pytest.approx(-60.0)
    assert ou_privleak({"min_k": 0.8}, 0.6) == pytest.approx(-50.0)
    assert ou_privleak({"min_k": 0.5, "loss": 0.9}, None) == pytest.approx(0.0)
    assert ou_privleak({"loss": 0.8}, None) is None  # privleak reads Min-K% alone


def test_a_retain_tofu_eval_json_with_min_k_alone_gives_its_privleak_and_names_the_rest(tmp_path, caplog):
    """open-unlearning's default TOFU config keeps mia_min_k alone (privleak's pre-compute): used, not refused."""
    from pipeline.evaluation.attacks.mia import summarise
    from pipeline.evaluation.inputs import load_retain_auc
    from pipeline.evaluation.mia import MIAResult

    (tmp_path / "TOFU_EVAL.json").write_text(json.dumps({"mia_min_k": {"agg_value": 0.6}}))
    with caplog.at_level(logging.WARNING):
        reference = load_retain_auc(tmp_path, ["loss", "min_k"])
    assert reference == {"min_k": 0.6}
    assert "no membership-inference AUC of ['loss'] for the retain model" in caplog.text
    scores = {"loss": np.array([1.0]), "min_k": np.array([2.0])}
    summary = summarise(MIAResult(scores, scores, {"loss": 0.7, "min_k": 0.8}), reference, False)
    assert summary["mia"]["min_k"]["privleak"] == pytest.approx(-50.0) == summary["privleak"]
    assert summary["mia"]["min_k"]["retain_auc"] == 0.6 and "privleak" not in summary["mia"]["loss"]
    caplog.clear()
    (tmp_path / "TOFU_EVAL.json").write_text(json.dumps({"mia_loss": {"agg_value": 0.6}}))
    with caplog.at_level(logging.WARNING):
        assert load_retain_auc(tmp_path, ["loss", "min_k"]) == {"loss": 0.6}
    assert "nor the summary's privleak (min_k's)" in caplog.text


@pytest.mark.parametrize("retain_auc, expected", [(None, -50.0), (0.6, -37.5)])
def test_the_export_writes_open_unlearnings_privleak(tmp_path, retain_auc, expected):
    """Forget scores 0.1 to 0.4 and holdout 0.25, 0.5: AUC 6/8 = 0.75 (holdout above forget in 6 of 8 pairs), so
    s = 0.25; against open-unlearning's default (the retain model's own evaluation: no retain_auc) and against 0.6."""
    import pyarrow.parquet as pq

    from pipeline.evaluation.eval_io import item_table
    from pipeline.evaluation.open_unlearning import export_evaluation

    from tests.evaluation.test_eval_inputs import _item

    out = tmp_path / "eval"
    (out / "items").mkdir(parents=True)
    forget = [{**_item(i, "forget"), "mia_min_k": 0.1 * (i + 1)} for i in range(4)]
    holdout = [{"index": i, "question": f"H{i}?", "answer": "h", "mia_min_k": v} for i, v in enumerate((0.25, 0.5))]
    for name, rows in (("forget", forget), ("holdout", holdout)):
        pq.write_table(item_table(rows, {}), out / "items" / f"{name}.parquet")
    entry = {"auc": 0.75, "privleak": 0.0, **({"retain_auc": retain_auc} if retain_auc is not None else {})}
    (out / "metrics.json").write_text(json.dumps({"mia": {"min_k": entry}, "privleak": 0.0}))
    export_evaluation(out, tmp_path / "ou")
    logs = json.loads((tmp_path / "ou" / "TOFU_EVAL.json").read_text())
    assert logs["mia_min_k"]["agg_value"] == pytest.approx(0.75)
    assert logs["privleak"]["agg_value"] == pytest.approx(expected)
