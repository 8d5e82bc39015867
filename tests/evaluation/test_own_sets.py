"""Evaluation of a user's own question-answer splits (`evaluate.perturbed: false`): forget.json, retain.json and
holdout.json with question and answer only. What applies is computed by TOFU's code, what does not is named under
`skipped` with its reason, and an explicit request that cannot run is one ParamError line."""

import json
import math

import numpy as np
import pyarrow.parquet as pq
import pytest

from pipeline.common.errors import DataError, ParamError
from pipeline.data.templates import get_template
from pipeline.evaluation import registry
from pipeline.evaluation.config import TOFU_SETS, EvalConfig
from pipeline.evaluation.evaluate import evaluate_model, headline_metrics
from pipeline.evaluation.tofu_sets import PERTURBED_ONLY, evaluate_set, set_aggregates

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

TEMPLATE = get_template("plain")
PLAIN_COLUMNS = {"question", "answer", "index", "probability", "rouge_l_recall", "extraction_strength",
                 "exact_memorization", "answer_mean_nll", "answer_probability", "rouge1_recall", "rouge_l_f1",
                 "prompt", "ground_truth", "generated"}
SET_KEYS = {"n", "probability", "rouge_l_recall", "extraction_strength", "exact_memorization"}


@pytest.fixture(scope="module")
def own_dir(micro_world_dir, tmp_path_factory):
    """A user's directory: forget, retain and holdout splits of 6 rows each, JSON Lines of question and answer."""
    from pipeline.data.tofu import load_split

    rows = load_split(micro_world_dir, "full")
    out = tmp_path_factory.mktemp("own") / "data"
    out.mkdir()
    for i, split in enumerate(("forget", "retain", "holdout")):
        part = [{"question": r["question"], "answer": r["answer"]} for r in rows[6 * i: 6 * i + 6]]
        assert len(part) == 6
        (out / f"{split}.json").write_text("".join(json.dumps(r) + "\n" for r in part))
    return out


def _cfg(own_dir, **kw):
    return EvalConfig.from_params({"source": str(own_dir), "perturbed": False, "forget_split": "forget",
                                   "retain_split": "retain", "max_new_tokens": 8, "batch_size": 8, **kw}, "evaluate")


@pytest.fixture(scope="module")
def own_eval(micro_model_dir, own_dir, tmp_path_factory):
    """The micro model as its own retain model on the user's splits, every attack that applies on."""
    out = tmp_path_factory.mktemp("own_eval") / "retain"
    cfg = _cfg(own_dir, mia={"holdout_split": "holdout"}, sampling={"k": [1, 2]},
               quantize={"bits": [8], "group_size": 16, "method": "rtn"})
    return out, evaluate_model(str(micro_model_dir), cfg, out, out)


# --- the params -----------------------------------------------------------------------------------------------

def test_the_default_reads_tofus_perturbed_splits_and_skips_nothing():
    cfg = EvalConfig()
    assert cfg.perturbed and cfg.retain_split == "retain90" and cfg.skipped == {}
    assert cfg.set_splits == {name: split.format(forget="forget10") for name, split in TOFU_SETS.items()}


def test_plain_splits_read_forget_and_retain_and_name_what_they_skip(own_dir):
    cfg = _cfg(own_dir)  # tofu_sets: the default four, as params.yaml lists them
    assert cfg.set_splits == {"forget": "forget", "retain": "retain"}
    assert set(cfg.skipped) == {"truth_ratio", "forget_quality", "model_utility", "real_authors", "world_facts",
                                "paraphrase", "multiple_choice"}
    assert all(isinstance(why, str) and why for why in cfg.skipped.values())
    assert "multiple_choice" not in _cfg(own_dir, multiple_choice={
        "w": {"format": "mmlu", "source": "cais/mmlu"}}).skipped
    assert set(_cfg(own_dir, tofu_sets=["forget"]).set_splits) == {"forget"}
    with pytest.raises(ParamError, match=r"^evaluate\.paraphrase: needs TOFU's paraphrased questions.*"
                                         r"set evaluate\.paraphrase: false$"):
        _cfg(own_dir, paraphrase=True)
    with pytest.raises(ParamError, match=r"^evaluate\.retain_split='retain': read only with evaluate\.perturbed: "
                                         r"false"):
        EvalConfig.from_params({"retain_split": "retain"}, "evaluate")


# --- the formulas on plain items --------------------------------------------------------------------------------

def test_plain_aggregates_on_a_hand_computed_case():
    items = [{"probability": 0.5, "rouge_l_recall": 1.0, "extraction_strength": 1.0, "exact_memorization": None},
             {"probability": 0.25, "rouge_l_recall": 0.5, "extraction_strength": 0.0, "exact_memorization": 0.5}]
    # the means: (0.5 + 0.25) / 2, (1 + 0.5) / 2, (1 + 0) / 2, and EM over the one answer that has tokens
    assert set_aggregates(items, "retain", perturbed=False) == {
        "probability": 0.375, "rouge_l_recall": 0.75, "extraction_strength": 0.5, "exact_memorization": 0.5}
    with pytest.raises(KeyError):  # a perturbed set's aggregates read the truth ratio: never a silent gap
        set_aggregates(items, "retain")


def test_a_plain_set_is_scored_by_the_perturbed_sets_code(micro_model_dir, micro_tokenizer, micro_world_dir):
    from pipeline.common.modeling import load_model
    from pipeline.data.tofu import load_split

    model = load_model(str(micro_model_dir))
    rows = load_split(micro_world_dir, "forget10_perturbed")
    full = evaluate_set(model, micro_tokenizer, TEMPLATE, rows, "forget", batch_size=4, max_new_tokens=6)
    plain = evaluate_set(model, micro_tokenizer, TEMPLATE, [{"question": r["question"], "answer": r["answer"]}
                                                             for r in rows], "forget", batch_size=4,
                         max_new_tokens=6, perturbed=False)
    assert plain.truth_ratios is None and "truth_ratio" not in plain.aggregates
    for ours, theirs in zip(plain.items, full.items):
        assert not set(PERTURBED_ONLY) & set(ours)
        assert ours == {k: theirs[k] for k in ours}  # every column it has, the perturbed set's value
    assert plain.aggregates == {k: v for k, v in full.aggregates.items() if k != "truth_ratio"}
    with pytest.raises(DataError, match=r"a world_facts set needs perturbed answers"):
        evaluate_set(model, micro_tokenizer, TEMPLATE, rows, "world_facts", perturbed=False)
    with pytest.raises(DataError, match=r"mine: row 2: missing or malformed field 'answer'"):
        evaluate_set(model, micro_tokenizer, TEMPLATE, [rows[0], {"question": "q"}], "retain", name="mine",
                     perturbed=False)


# --- an evaluation of a user's splits ---------------------------------------------------------------------------

def test_an_evaluation_of_own_splits_has_the_metrics_that_apply(own_eval):
    out, summary = own_eval
    assert summary["perturbed"] is False and (summary["forget_split"], summary["retain_split"]) == ("forget",
                                                                                                   "retain")
    for name in ("forget", "retain"):
        assert set(summary[name]) == SET_KEYS and summary[name]["n"] == 6
        assert 0 <= summary[f"{name}_es"] <= 1 and summary[f"{name}_es"] == summary[name]["extraction_strength"]
        assert summary[f"{name}_em"] == summary[name]["exact_memorization"]
        assert summary[f"{name}_rouge"] == summary[name]["rouge_l_recall"]
        table = pq.read_table(out / "items" / f"{name}.parquet")
        items = table.to_pylist()
        assert PLAIN_COLUMNS <= set(items[0]) and not set(PERTURBED_ONLY) & set(items[0])
        meta = json.loads(table.schema.metadata[b"tokenunlearn"])
        assert meta["split"] == name and meta["perturbed"] is False
        assert summary[f"{name}_rouge"] == pytest.approx(np.mean([i["rouge_l_recall"] for i in items]), abs=1e-6)
        assert all(i["probability"] == pytest.approx(math.exp(-i["answer_mean_nll"])) for i in items)
    assert not {"forget_quality", "log10_forget_quality", "model_utility", "real_authors", "world_facts",
                "forget_para_es"} & set(summary)
    assert set(summary[registry.SKIPPED]) == {"truth_ratio", "forget_quality", "model_utility", "real_authors",
                                              "world_facts", "paraphrase", "multiple_choice"}
    assert summary[registry.SKIPPED]["truth_ratio"].startswith("no perturbed answers")
    assert registry.unregistered(summary) == [] and registry.metric("retain_rouge").better == registry.HIGHER
    assert set(headline_metrics(summary)) == {"forget_es", "retain_es", "privleak"}
    assert json.loads((out / "metrics.json").read_text()) == summary


def test_the_attacks_run_on_own_splits(own_eval):
    out, summary = own_eval
    # sampling: no annotations in a user's directory, so the ROUGE rule
    assert summary["sampling"]["rule"] == "rouge" and summary["leak_at_1"] <= summary["leak_at_2"]
    assert pq.read_table(out / "sampling" / "forget.parquet").num_rows == 6
    # membership inference of forget against the holdout split; the retain model against itself: privleak 0
    assert 0 <= summary["mia_min_k_auc"] <= 1 and summary["privleak"] == 0
    holdout = pq.read_table(out / "items" / "holdout.parquet")
    assert holdout.num_rows == 6 and json.loads(holdout.schema.metadata[b"tokenunlearn"])["split"] == "holdout"
    assert "mia_min_k" in pq.read_table(out / "items" / "forget.parquet").column_names
    # the quantization attack's probes read question and answer only
    assert {"q8_forget_es", "q8_forget_rouge", "q8_retain_es"} <= set(summary)


def test_open_unlearnings_files_hold_what_needs_no_perturbed_answers(own_eval, tmp_path):
    from pipeline.evaluation.open_unlearning import export_evaluation

    out, summary = own_eval
    logs = json.loads((out / "TOFU_EVAL.json").read_text())
    assert {"forget_Q_A_Prob", "forget_Q_A_ROUGE", "extraction_strength", "exact_memorization", "retain_Q_A_Prob",
            "retain_Q_A_ROUGE", "mia_min_k", "privleak"} <= set(logs)
    assert not [k for k in logs if "Truth_Ratio" in k or "truth_ratio" in k or "PERT" in k or "PARA" in k]
    assert "forget_quality" not in logs and "model_utility" not in logs
    assert logs["forget_Q_A_ROUGE"]["agg_value"] == pytest.approx(summary["forget_rouge"], abs=1e-6)
    export_evaluation(out, tmp_path / "again")  # the re-export reads the plain items back
    assert json.loads((tmp_path / "again" / "TOFU_EVAL.json").read_text()) == logs


def test_a_retain_evaluation_gives_privleak_and_no_forget_quality(own_eval, own_dir, micro_model_dir, tmp_path):
    retain, _ = own_eval
    summary = evaluate_model(str(micro_model_dir), _cfg(own_dir, tofu_sets=["forget"],
                                                        mia={"holdout_split": "holdout"}), tmp_path / "eval", retain)
    assert "privleak" in summary and summary["mia"]["min_k"]["retain_auc"] == summary["mia_min_k_auc"]
    assert "forget_quality" not in summary and "retain" not in summary and "retain_rouge" not in summary
    assert set(summary["skipped"]) == {"truth_ratio", "forget_quality", "model_utility", "paraphrase",
                                       "multiple_choice"}
