"""Stage three's robustness options on the micro world: membership inference with privleak against the retain
model, the paraphrase probe, and the quantization attack; their per-item columns and open-unlearning's entries."""

import json
import shutil

import pyarrow.parquet as pq
import pytest

from pipeline.common.errors import DataError, ParamError
from pipeline.evaluation.config import EvalConfig
from pipeline.evaluation.evaluate import evaluate_model, evaluate_path
from pipeline.evaluation.mia import privleak


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


ROBUST = {"mia": {"holdout_split": "holdout10"}, "paraphrase": True, "quantize": {"bits": [8, 4], "group_size": 16}}


def _cfg(world_dir, **kw):
    return EvalConfig.from_params({"source": str(world_dir), "max_new_tokens": 8, "batch_size": 8,
                                   "multiple_choice": {"world": {"format": "world", "source": str(world_dir),
                                                                 "scoring": "cloze"}},
                                   **ROBUST, **kw}, "evaluate")


@pytest.fixture(scope="module")
def retain_eval(micro_model_dir, micro_world_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("robust") / "retain"
    return out, evaluate_path(str(micro_model_dir), _cfg(micro_world_dir), out, out)


def test_the_retain_models_privleak_against_itself_is_zero(retain_eval):
    out, summary = retain_eval
    assert summary["privleak"] == 0.0
    assert set(summary["mia"]) == {"loss", "zlib", "min_k", "min_k_plus_plus"}
    for attack, entry in summary["mia"].items():
        assert 0.0 <= entry["auc"] <= 1.0 and entry["privleak"] == 0.0
        assert "retain_auc" not in entry  # compared with itself: no other retain model's AUC
        assert summary[f"mia_{attack}_auc"] == entry["auc"]


def test_scores_are_kept_per_item_and_in_open_unlearnings_layout(retain_eval, micro_world_dir):
    out, summary = retain_eval
    from pipeline.data.tofu import load_split
    from pipeline.evaluation.mia import auc

    forget = pq.read_table(out / "items" / "forget.parquet").to_pylist()
    holdout = pq.read_table(out / "items" / "holdout.parquet").to_pylist()
    assert len(holdout) == len(load_split(str(micro_world_dir), "holdout10"))
    for attack in summary["mia"]:
        assert auc([r[f"mia_{attack}"] for r in forget], [r[f"mia_{attack}"] for r in holdout]) == \
            pytest.approx(summary["mia"][attack]["auc"], abs=1e-6)
    logs = json.loads((out / "TOFU_EVAL.json").read_text())
    assert logs["mia_min_k"]["agg_value"] == pytest.approx(summary["mia_min_k_auc"], abs=1e-6)
    assert len(logs["mia_min_k"]["holdout"]["value_by_index"]) == len(holdout)
    # open-unlearning evaluates a retain model without retain logs: privleak against its ref_value, an AUC of 0.5
    assert logs["privleak"]["agg_value"] == pytest.approx((1 - logs["mia_min_k"]["agg_value"] - 0.5) / 0.5 * 100)
    assert json.loads((out / "TOFU_SUMMARY.json").read_text())["privleak"] == logs["privleak"]["agg_value"]


def test_export_rebuilds_the_mia_entries_from_the_items(retain_eval, tmp_path):
    from pipeline.evaluation.open_unlearning import export_evaluation

    out, _ = retain_eval
    export_evaluation(out, tmp_path)
    ours, theirs = (json.loads((d / "TOFU_EVAL.json").read_text()) for d in (out, tmp_path))
    assert theirs["mia_min_k_plus_plus"] == ours["mia_min_k_plus_plus"] and theirs["privleak"] == ours["privleak"]


def test_paraphrase_probe_columns_and_means(retain_eval):
    out, summary = retain_eval
    forget = pq.read_table(out / "items" / "forget.parquet").to_pylist()
    es = [r["para_extraction_strength"] for r in forget]
    assert summary["forget_para_es"] == pytest.approx(sum(es) / len(es), abs=1e-6)
    assert all(isinstance(r["para_generated"], str) for r in forget)
    assert "retain_para_rouge" in summary


def test_quantization_attack_probes_each_width_and_restores_the_weights(retain_eval, micro_model_dir,
                                                                          micro_world_dir, tmp_path):
    out, summary = retain_eval
    for bits in (8, 4):
        assert {"forget_es", "forget_rouge", "forget_para_es", "retain_es", "mc_world_forget"} <= \
            set(summary["quantization"][str(bits)])
        assert summary[f"q{bits}_forget_es"] == summary["quantization"][str(bits)]["forget_es"]
        assert summary["quantization"][str(bits)]["weights"]["n_tensors"] > 0
    # 8 bits barely moves a random model's answers; the rounded weights were put back before the files were
    # written: the same model without the attack gives the same TOFU numbers
    plain = evaluate_model(str(micro_model_dir), _cfg(micro_world_dir, quantize={}), tmp_path / "plain", out)
    assert plain["forget"] == summary["forget"] and plain["retain"] == summary["retain"]
    assert "quantization" not in plain


def test_probes_score_only_the_chosen_sets(micro_model_dir, micro_world_dir, tmp_path):
    summary = evaluate_model(str(micro_model_dir), _cfg(micro_world_dir, mia={}, quantize={"bits": [8]},
                                                        probe_sets=["forget", "world_forget"]), tmp_path / "e", None)
    assert sorted(summary["quantization"]["8"]) == ["forget_em", "forget_es", "forget_para_es", "forget_para_rouge",
                                                    "forget_rouge", "mc_world_forget", "weights"]


def test_privleak_of_another_model_reads_the_retain_models_auc(retain_eval, micro_model_dir, micro_world_dir,
                                                                 tmp_path):
    from tests.conftest import scaled_model_copy

    out, retain = retain_eval
    other = scaled_model_copy(micro_model_dir, tmp_path / "other")
    summary = evaluate_model(str(other), _cfg(micro_world_dir, quantize={}), tmp_path / "eval", out)
    for attack, entry in summary["mia"].items():
        assert entry["retain_auc"] == retain["mia"][attack]["auc"]
        assert entry["privleak"] == pytest.approx(privleak(entry["auc"], entry["retain_auc"]), abs=1e-3)
    # open-unlearning's files: the same privleak, against the retain model's AUC, unrounded; and the export's too
    logs = json.loads((tmp_path / "eval" / "TOFU_EVAL.json").read_text())
    assert logs["privleak"]["agg_value"] == pytest.approx(summary["privleak"], abs=1e-5)
    from pipeline.evaluation.open_unlearning import export_evaluation

    export_evaluation(tmp_path / "eval", tmp_path / "export")
    assert json.loads((tmp_path / "export" / "TOFU_EVAL.json").read_text())["privleak"] == logs["privleak"]


def test_bad_robustness_params_name_the_key(micro_world_dir, tmp_path):
    with pytest.raises(ParamError, match=r"evaluate.mia.attacks"):
        _cfg(micro_world_dir, mia={"attacks": ["recall"]})
    with pytest.raises(ParamError, match=r"evaluate.mia.k"):
        _cfg(micro_world_dir, mia={"k": 0})
    with pytest.raises(ParamError, match=r"evaluate.quantize.bits"):
        _cfg(micro_world_dir, quantize={"bits": [16]})
    with pytest.raises(ParamError, match=r"evaluate.quantize.method"):
        _cfg(micro_world_dir, quantize={"method": "gptq"})
    with pytest.raises(ParamError, match=r"evaluate.mia: .*forget"):
        _cfg(micro_world_dir, tofu_sets=["retain"])
    from pipeline.evaluation.inputs import load_inputs

    with pytest.raises(ParamError, match=r"evaluate.probe_sets: \['wmdp'\]"):
        load_inputs(_cfg(micro_world_dir, probe_sets=["forget", "wmdp"]), None)


def test_a_retain_evaluation_without_mia_is_refused_before_any_work(micro_model_dir, micro_world_dir, tmp_path):
    shutil.copytree(micro_world_dir, tmp_path / "world")
    old = tmp_path / "old_retain"
    evaluate_path(str(micro_model_dir), _cfg(micro_world_dir, mia={}, paraphrase=False, quantize={},
                                             multiple_choice={}), old, old)
    with pytest.raises(DataError, match=r"no membership-inference AUC .*evaluate it again"):
        evaluate_model(str(tmp_path / "missing_model"), _cfg(micro_world_dir), tmp_path / "out", old)


def test_report_reads_the_relearning_summaries_and_writes_the_robustness_table(tmp_path):
    from pipeline.studies.report import load_rows, write_report

    metrics, relearn = tmp_path / "eval", tmp_path / "relearn"
    metrics.mkdir()
    relearn.mkdir()
    base = {"retain_es": 0.9, "forget_es": 0.3, "model_utility": 0.8, "log10_forget_quality": -1.0}
    for name, extra in {"target": {"privleak": -80.0}, "retain": {"privleak": 0.0},
                        "ga": {"privleak": -20.0, "q4_forget_es": 0.6, "mia_min_k_plus_plus_auc": 0.7}}.items():
        (metrics / f"{name}.json").write_text(json.dumps({**base, **extra}))
    (relearn / "ga.json").write_text(json.dumps({"before_forget_es": 0.3, "forget_forget_es": 0.7,
                                                 "forget_forget_es_std": 0.05, "retain_forget_es": 0.5,
                                                 "model": "artifacts/unlearn/ga"}))
    rows = load_rows(metrics, {"ga": {"method": "ga", "weighting": "uniform"}}, relearn)
    assert rows[2].summary["relearn_forget_forget_es"] == 0.7 and "relearn_model" not in rows[2].summary
    write_report(rows, tmp_path / "report", tmp_path / "plots")
    text = (tmp_path / "report" / "results.md").read_text()
    robust = text[text.index("Is it forgotten"):].splitlines()
    header = next(line for line in robust if line.startswith("| model"))
    assert "privleak (→0)" in header and "forget ES, 4-bit ↓" in header and "after relearning on forget" in header
    assert "forget MC, letter" not in header  # no row has it: no column
    ga = next(line for line in robust if line.startswith("| GA |"))
    assert "| -20.000 |" in ga and "| 0.700 ± 0.050 |" in ga
    assert (tmp_path / "plots" / "relearning.csv").read_text().splitlines()[1] == "GA,ga,0.3,0.7,0.5"
    assert (tmp_path / "report" / "relearning.png").read_bytes()[:4] == b"\x89PNG"
