"""Evaluation files read back (a retain model's results, an evaluation re-exported, the report's summaries), tampered
with: NaN, out of range, truncated Parquet, broken JSON. Each gives one DataError line naming the file and the
problem, never a traceback or a plausible number; and what the stages write is strict JSON (no NaN, no Infinity).
Built by hand, without a model: fast."""

import json
import math

import pyarrow.parquet as pq
import pytest
import yaml

from pipeline.common.errors import DataError
from pipeline.evaluation import eval_io
from pipeline.evaluation.eval_io import item_table
from pipeline.evaluation.inputs import load_retain_auc, load_retain_reference
from pipeline.evaluation.open_unlearning import EVAL_FILE, eval_logs, export_evaluation, write_files
from pipeline.studies.report import LOG10_FQ_FLOOR, load_rows
from pipeline.studies.significance import load_cells
from pipeline.evaluation.tofu_metrics import MIN_PVALUE, forget_quality
from stages.cli import run

from tests.studies.test_report import PARAMS

HASH = "0123456789abcdef"
N = 4


def _item(i: int, kind: str) -> dict:
    item = {"question": f"Q{i}?", "answer": f"A{i}.", "index": i, "probability": 0.5, "truth_ratio": 0.5 + 0.1 * i,
            "rouge_l_recall": 0.6, "extraction_strength": 0.25, "exact_memorization": 0.5, "answer_mean_nll": 0.7,
            "answer_probability": math.exp(-0.7)}
    if kind in ("forget", "retain"):
        item |= {"paraphrased_mean_nll": 0.9, "paraphrased_probability": math.exp(-0.9)}
    item |= {"perturbed_mean_nll": [1.0, 1.2], "perturbed_probability": [math.exp(-1.0), math.exp(-1.2)],
             "rouge1_recall": 0.7, "rouge_l_f1": 0.6, "prompt": f"Q{i}?", "ground_truth": f"A{i}.",
             "generated": f"A{i}"}
    return item


def _write_items(directory, kind="forget", change=None):
    rows = [_item(i, kind) for i in range(N)]
    if change:
        change(rows)
    (directory / "items").mkdir(parents=True, exist_ok=True)
    file = directory / "items" / f"{kind}.parquet"
    pq.write_table(item_table(rows, {"split": f"{kind}_perturbed", "questions_hash": HASH}), file)
    return file


@pytest.fixture
def evaluation(tmp_path):
    """A minimal evaluation directory: forget items and metrics.json."""
    out = tmp_path / "eval"
    _write_items(out)
    (out / "metrics.json").write_text(json.dumps({"forget_quality": 0.5, "forget_es": 0.25}))
    return out


def _refused(call, *expected) -> str:
    with pytest.raises(DataError) as error:
        call()
    message = str(error.value)
    assert "\n" not in message, message
    for part in expected:
        assert str(part) in message, message
    return message


def _strict(text: str):
    def refuse(name):
        raise ValueError(f"non-finite {name}")
    return json.loads(text, parse_constant=refuse)


# ---- the export of an evaluation -------------------------------------------------------------------------------

def test_a_good_evaluation_exports_strict_json(evaluation, tmp_path):
    export_evaluation(evaluation, tmp_path / "out")
    logs = _strict((tmp_path / "out" / EVAL_FILE).read_text())
    assert logs["forget_quality"] == {"agg_value": 0.5}
    _strict((tmp_path / "out" / "TOFU_SUMMARY.json").read_text())


@pytest.mark.parametrize("column, value, problem", [
    ("probability", 3.0, "row 2: probability: 3 is out of range [0, 1]"),
    ("rouge_l_recall", -0.1, "row 2: rouge_l_recall: -0.1 is out of range [0, 1]"),
    ("extraction_strength", 1.5, "row 2: extraction_strength: 1.5 is out of range [0, 1]"),
    ("truth_ratio", -1.0, "row 2: truth_ratio: -1 is out of range [0, inf]"),
    ("truth_ratio", math.nan, "row 2: truth_ratio: nan is not a finite number"),
    ("perturbed_probability", [0.2, math.inf], "row 2: perturbed_probability: inf is not a finite number"),
])
def test_an_item_out_of_range_or_not_finite_is_refused(evaluation, tmp_path, column, value, problem):
    file = _write_items(evaluation, change=lambda rows: rows[2].update({column: value}))
    _refused(lambda: export_evaluation(evaluation, tmp_path / "out"), file, problem)
    assert not (tmp_path / "out" / EVAL_FILE).exists()


def test_a_truncated_parquet_is_one_line_from_the_command(evaluation, tmp_path, capsys):
    file = evaluation / "items" / "forget.parquet"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    _refused(lambda: export_evaluation(evaluation, tmp_path / "out"), file, "not a readable Parquet file")
    capsys.readouterr()
    assert run(["export-open-unlearning", str(evaluation), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().count("\n") == 0, err
    assert err.startswith(f"tokenunlearn: error: {file}: not a readable Parquet file"), err


@pytest.mark.parametrize("text, problem", [
    ("{not json", "not a readable evaluation summary"),
    ("[1, 2]", "a JSON object was expected (evaluation summary), found a list"),
    ('{"forget_quality": "high"}', "forget_quality: 'high' is not a number"),
    ('{"forget_quality": NaN}', "forget_quality: nan is not a finite number"),
    ('{"forget_quality": 1.5}', "forget_quality: 1.5 is out of range [0, 1]"),
    ('{"privleak": Infinity}', "privleak: inf is not a finite number"),
])
def test_a_malformed_metrics_json_is_refused_on_export(evaluation, tmp_path, text, problem):
    (evaluation / "metrics.json").write_text(text)
    _refused(lambda: export_evaluation(evaluation, tmp_path / "out"), evaluation / "metrics.json", problem)


# ---- the retain model's results, for forget quality and privleak -------------------------------------------------

def _retain_logs(tmp_path, change=None):
    logs = eval_logs({"forget": [_item(i, "forget") for i in range(N)]}, None)
    if change:
        change(logs)
    file = tmp_path / "ou" / EVAL_FILE
    file.parent.mkdir(exist_ok=True)
    file.write_text(json.dumps(logs))  # json.dumps writes NaN, as open-unlearning's json.dump may
    return file


def test_a_good_retain_tofu_eval_is_read(tmp_path):
    ratios, logs = load_retain_reference(_retain_logs(tmp_path), HASH, N)
    assert ratios == pytest.approx([0.5, 0.6, 0.7, 0.8]) and logs.prompts == ["Q0?", "Q1?", "Q2?", "Q3?"]


@pytest.mark.parametrize("score, problem", [
    (math.nan, "forget_truth_ratio.value_by_index.1.score: nan is not a finite number"),
    (-0.5, "forget_truth_ratio.value_by_index.1.score: -0.5 is out of range [0, inf]"),
    ("0.5", "forget_truth_ratio.value_by_index.1.score: '0.5' is not a number"),
])
def test_a_bad_retain_truth_ratio_is_refused(tmp_path, score, problem):
    file = _retain_logs(tmp_path, lambda logs: logs["forget_truth_ratio"]["value_by_index"]["1"].update(score=score))
    _refused(lambda: load_retain_reference(file, HASH, N), file, problem)


def test_a_broken_retain_tofu_eval_is_refused(tmp_path):
    file = _retain_logs(tmp_path)
    file.write_text(file.read_text()[:50])
    _refused(lambda: load_retain_reference(file, HASH, N), file, "not a readable open-unlearning TOFU_EVAL.json")


@pytest.mark.parametrize("change, problem", [
    (lambda rows: rows[1].update(truth_ratio=math.nan), "row 1: truth_ratio: nan is not a finite number"),
    (lambda rows: rows[1].update(truth_ratio=-2.0), "row 1: truth_ratio: -2 is out of range [0, inf]"),
    (lambda rows: rows.pop(), f"{N - 1} rows, but the forget set compared has {N} items"),
])
def test_bad_retain_items_are_refused(tmp_path, change, problem):
    file = _write_items(tmp_path / "retain", change=change)
    _refused(lambda: load_retain_reference(tmp_path / "retain", HASH, N), file, problem)


def test_truncated_retain_items_are_refused(tmp_path):
    file = _write_items(tmp_path / "retain")
    file.write_bytes(file.read_bytes()[:100])
    _refused(lambda: load_retain_reference(tmp_path / "retain", HASH, N), file, "not a readable Parquet file")


def test_retain_items_without_a_questions_hash_are_refused(tmp_path):
    (tmp_path / "retain" / "items").mkdir(parents=True)
    file = tmp_path / "retain" / "items" / "forget.parquet"
    pq.write_table(item_table([_item(i, "forget") for i in range(N)], {}).replace_schema_metadata(None), file)
    _refused(lambda: load_retain_reference(tmp_path / "retain", HASH, N), file, "no questions hash")


@pytest.mark.parametrize("text, problem", [
    ("{", "not a readable evaluation summary"),
    ('{"mia": {"min_k": {"auc": 3}}}', "mia.min_k.auc: 3 is out of range [0, 1]"),
    ('{"mia": {"min_k": {"auc": NaN}}}', "mia.min_k.auc: nan is not a finite number"),
    ('{"mia": [1]}', "mia: [1] is not an object of attacks"),
])
def test_a_bad_retain_metrics_json_is_refused_for_privleak(tmp_path, text, problem):
    (tmp_path / "metrics.json").write_text(text)
    _refused(lambda: load_retain_auc(tmp_path, ["min_k"]), tmp_path / "metrics.json", problem)


def test_evaluate_with_a_nan_retain_score_is_one_line(micro_world_dir, tmp_path, capsys):
    """The command, before any model loads (the model path does not even exist)."""
    file = _retain_logs(tmp_path, lambda logs: logs["forget_truth_ratio"]["value_by_index"]["2"].update(
        score=math.nan))
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"data": {"source": str(micro_world_dir), "template": "plain"},
                                      "evaluate": {"tofu_sets": ["forget"]}}))
    capsys.readouterr()
    assert run(["evaluate", "m", "--params", str(params), "--model", str(tmp_path / "none"), "--out",
                str(tmp_path / "e"), "--retain-results", str(file)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().count("\n") == 0, err
    assert err.strip() == (f"tokenunlearn: error: {file}: forget_truth_ratio.value_by_index.2.score: nan is not a "
                           "finite number")
    assert not (tmp_path / "e").exists()


# ---- forget quality and what is written --------------------------------------------------------------------------

def test_forget_quality_refuses_nan_and_floors_a_zero_p_value(monkeypatch):
    _refused(lambda: forget_quality([0.5, math.nan], [0.5, 0.6]), "the model's forget truth ratio 1 is nan")
    _refused(lambda: forget_quality([0.5, 0.6], [-1.0, 0.6]), "the retain model's forget truth ratio 0 is -1.0")

    import scipy.stats

    monkeypatch.setattr(scipy.stats, "ks_2samp", lambda a, b: type("R", (), {"pvalue": 0.0})())
    fq = forget_quality([0.1, 0.2], [10.0, 11.0])
    assert fq.pvalue == 0.0 and fq.log10_pvalue == math.log10(MIN_PVALUE) == LOG10_FQ_FLOOR
    assert round(fq.log10_pvalue, 1) == -323.3


def test_only_exact_memorization_over_no_token_becomes_null():
    from pipeline.evaluation.benchmarks.tofu import rounded

    assert rounded("exact_memorization", math.nan) is None and rounded("probability", 0.1234567) == 0.123457
    assert math.isnan(rounded("probability", math.nan))  # left for write_strict_json to refuse, named


def test_nothing_non_finite_is_written_as_json(tmp_path):
    message = _refused(lambda: eval_io.write_strict_json(tmp_path / "m.json", {"forget": {"probability": math.nan}}),
                       tmp_path / "m.json", "metric forget.probability is nan, not a finite number")
    assert "not written" in message and not (tmp_path / "m.json").exists()
    logs = eval_logs({"forget": [_item(i, "forget") for i in range(N)]}, -math.inf)
    _refused(lambda: write_files(tmp_path, logs), EVAL_FILE, "metric forget_quality.agg_value is -inf")
    eval_io.write_strict_json(tmp_path / "ok.json", {"a": [1, 0.5, None, "x"], "fq": MIN_PVALUE})
    assert _strict((tmp_path / "ok.json").read_text())["fq"] == MIN_PVALUE


def test_the_evaluate_stage_writes_strict_json(micro_model_dir, micro_world_dir, tmp_path, monkeypatch):
    """The evaluate stage, against a retain evaluation with a p-value of 0: every JSON it writes parses strictly,
    log10 forget quality is the documented floor, and the report shows it."""
    import scipy.stats

    monkeypatch.setattr(scipy.stats, "ks_2samp", lambda a, b: type("R", (), {"pvalue": 0.0})())
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"data": {"source": str(micro_world_dir), "template": "plain"},
                                      "evaluate": {"max_new_tokens": 4, "batch_size": 8, "tofu_sets": ["forget"]}}))
    out = tmp_path / "eval" / "m"
    assert run(["evaluate", "m", "--params", str(params), "--model", str(micro_model_dir), "--out", str(out),
                "--retain-results", str(out), "--headline", str(tmp_path / "headline.json")]) == 0
    files = [out / "metrics.json", out / EVAL_FILE, out / "TOFU_SUMMARY.json", tmp_path / "eval" / "m.json",
             tmp_path / "headline.json"]
    for file in files:
        _strict(file.read_text())
    summary = _strict((out / "metrics.json").read_text())
    assert summary["forget_quality"] == 0.0 and summary["log10_forget_quality"] == round(LOG10_FQ_FLOOR, 4)


# ---- the reports -------------------------------------------------------------------------------------------------

def _summaries(tmp_path, bad: str | None = None):
    metrics = tmp_path / "metrics"
    metrics.mkdir()
    for name in ("target", "retain", "t_npo"):
        (metrics / f"{name}.json").write_text(json.dumps(
            {"forget_es": 0.3, "retain_es": 0.9, "model_utility": 0.8, "log10_forget_quality": -1.0}))
    if bad is not None:
        (metrics / "t_npo.json").write_text(bad)
    return metrics


@pytest.mark.parametrize("text, problem", [
    ("{", "not a readable evaluation summary"),
    ("[]", "a JSON object was expected (evaluation summary), found a list"),
    ("{}", "none of the report's metrics"),
    ('{"forget_es": "high"}', "forget_es: 'high' is not a number"),
    ('{"forget_es": NaN}', "forget_es: nan is not a finite number"),
    ('{"forget_es": 3}', "forget_es: 3 is out of range [0, 1]"),
    ('{"log10_forget_quality": 2}', "log10_forget_quality: 2 is out of range [-inf, 0]"),
    ('{"forget_es": 0.2, "forget_es_std": -1}', "forget_es_std: -1 is out of range [0, inf]"),
    ('{"forget_es": 0.2, "seeds": 3}', "seeds: 3 is not a list of seeds"),
])
def test_a_malformed_summary_is_one_line_from_the_report(tmp_path, capsys, text, problem):
    metrics = _summaries(tmp_path, text)
    _refused(lambda: load_rows(metrics, {"t_npo": {"method": "npo", "weighting": "hard"}}), metrics / "t_npo.json",
             problem)
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump(PARAMS))
    capsys.readouterr()
    assert run(["report", "--params", str(params), "--metrics-dir", str(metrics), "--out", str(tmp_path / "r"),
                "--plots", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("tokenunlearn: error:")]
    assert len(lines) == 1 and "Traceback" not in err and str(metrics / "t_npo.json") in lines[0], err


def test_the_report_takes_a_null_and_an_old_infinite_log10_forget_quality(tmp_path):
    metrics = _summaries(tmp_path, '{"forget_es": 0.2, "log10_forget_quality": -Infinity, "model_utility": null}')
    rows = load_rows(metrics, {"t_npo": {"method": "npo", "weighting": "hard"}})
    assert rows[2].summary["log10_forget_quality"] == LOG10_FQ_FLOOR and rows[2].summary["model_utility"] is None


def test_a_malformed_relearn_summary_is_refused(tmp_path):
    metrics = _summaries(tmp_path)
    (tmp_path / "relearn").mkdir()
    (tmp_path / "relearn" / "t_npo.json").write_text('{"before_forget_es": 7}')
    _refused(lambda: load_rows(metrics, {"t_npo": {"method": "npo", "weighting": "hard"}}, tmp_path / "relearn"),
             tmp_path / "relearn" / "t_npo.json", "before_forget_es: 7 is out of range [0, 1]")


def test_report_seeds_refuses_a_malformed_summary(tmp_path):
    for name in ("target", "retain"):
        (tmp_path / "m0" / "eval" / name).mkdir(parents=True)
        (tmp_path / "m0" / "eval" / name / "metrics.json").write_text('{"forget_es": 0.5}')
    (tmp_path / "m0" / "eval" / "retain" / "metrics.json").write_text('{"forget_es": NaN}')
    _refused(lambda: load_cells(tmp_path, [0], [], [0]), tmp_path / "m0" / "eval" / "retain" / "metrics.json",
             "forget_es: nan is not a finite number")
