"""Stage three on the micro world: per-item results, forget quality from the retain model's items, the report."""

import json
import shutil

import pyarrow.parquet as pq
import pytest

from pipeline.common.errors import DataError, ParamError
from pipeline.evaluation.config import EvalConfig
from pipeline.evaluation.evaluate import evaluate_model, evaluate_path
from pipeline.studies.report import load_rows, results_table, write_report


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _cfg(world_dir, **kw):
    return EvalConfig.from_params({"source": str(world_dir), "max_new_tokens": 8, "batch_size": 8,
                                   "multiple_choice": {"world": {"format": "world", "source": str(world_dir)}},
                                   **kw}, "evaluate")


@pytest.fixture(scope="module")
def retain_eval(micro_model_dir, micro_world_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval") / "retain"
    summary = evaluate_path(str(micro_model_dir), _cfg(micro_world_dir), out, out, out.parent / "m" / "retain.json")
    return out, summary


def test_an_evaluation_keeps_items_and_the_papers_columns(retain_eval, micro_world_dir):
    out, summary = retain_eval
    from pipeline.data.tofu import load_split

    for name, split in (("forget", "forget10_perturbed"), ("retain", "retain_perturbed"),
                        ("real_authors", "real_authors_perturbed"), ("world_facts", "world_facts_perturbed")):
        rows = load_split(micro_world_dir, split)
        items = pq.read_table(out / "items" / f"{name}.parquet").to_pylist()
        assert [i["question"] for i in items] == [r["question"] for r in rows]
        assert summary[name]["n"] == len(rows)
        assert summary[name]["extraction_strength"] == pytest.approx(
            sum(i["extraction_strength"] for i in items) / len(items), abs=1e-6)
    assert summary["forget_quality"] == 1.0  # the retain model against itself
    assert 0 <= summary["model_utility"] <= 1 and summary["retain_es"] == summary["retain"]["extraction_strength"]
    assert {"mc_world_forget", "mc_world_retain", "mc_world_world_facts"} <= set(summary)
    assert pq.read_table(out / "mc" / "world_forget.parquet").num_rows == 3
    meta = pq.read_table(out / "mc" / "world_forget.parquet").schema.metadata[b"tokenunlearn"]
    assert json.loads(meta) == {"scoring": "letter"}  # the default
    assert json.loads((out.parent / "m" / "retain.json").read_text()) == summary


def test_an_evaluation_records_its_definitions_em_and_open_unlearnings_files(retain_eval):
    out, summary = retain_eval
    assert summary["definitions"] == {"es_definition": "open-unlearning", "loss_dtype": "float32", "max_new_tokens": 8}
    for name, key in (("forget", "forget_em"), ("retain", "retain_em")):
        items = pq.read_table(out / "items" / f"{name}.parquet").to_pylist()
        ems = [i["exact_memorization"] for i in items]
        assert summary[key] == summary[name]["exact_memorization"] == pytest.approx(sum(ems) / len(ems), abs=1e-6)
        assert {"answer_probability", "perturbed_mean_nll", "perturbed_probability", "rouge1_recall", "rouge_l_f1",
                "prompt", "ground_truth"} <= set(items[0])
        assert ("paraphrased_mean_nll" in items[0]) and len(items[0]["perturbed_probability"]) > 1
    assert (out / "TOFU_EVAL.json").is_file() and (out / "TOFU_SUMMARY.json").is_file()


def test_eval_config_defaults_are_open_unlearnings_and_bad_values_name_the_key():
    cfg = EvalConfig()
    assert (cfg.max_new_tokens, cfg.es_definition, cfg.loss_dtype) == (64, "open-unlearning", "float32")
    assert EvalConfig.from_params({"es_definition": "strict", "loss_dtype": "model"}).es_definition == "strict"
    with pytest.raises(ParamError, match=r"evaluate\.es_definition='lenient': must be one of "
                                         r"\['open-unlearning', 'strict'\]"):
        EvalConfig.from_params({"es_definition": "lenient"})
    with pytest.raises(ParamError, match=r"evaluate\.loss_dtype='bf16': must be one of \['float32', 'model'\]"):
        EvalConfig.from_params({"loss_dtype": "bf16"})
    from pipeline.evaluation.config import eval_config

    with pytest.raises(ParamError, match=r"evaluate\.max_new_tokens=0: must be at least 1"):
        eval_config({"data": {}, "evaluate": {"max_new_tokens": 0}})


def test_strict_extraction_strength_is_a_param(micro_model_dir, micro_world_dir, tmp_path):
    """es_definition: strict scores 0 where even the last answer token is wrong; open-unlearning's scores 1/n."""
    runs = {d: evaluate_model(str(micro_model_dir), _cfg(micro_world_dir, tofu_sets=["forget"], multiple_choice={},
                                                         es_definition=d), tmp_path / d, None)
            for d in ("open-unlearning", "strict")}
    assert runs["strict"]["definitions"]["es_definition"] == "strict"
    items = {d: pq.read_table(tmp_path / d / "items" / "forget.parquet").to_pylist() for d in runs}
    ours, strict = ([i["extraction_strength"] for i in items[d]] for d in ("open-unlearning", "strict"))
    assert all(s <= o for s, o in zip(strict, ours))
    assert runs["strict"]["forget_es"] < runs["open-unlearning"]["forget_es"]
    assert [i["probability"] for i in items["strict"]] == [i["probability"] for i in items["open-unlearning"]]


def test_each_seed_of_a_run_gets_open_unlearnings_files(retain_eval, micro_model_dir, micro_world_dir, tmp_path):
    run = tmp_path / "run"
    for seed in (0, 1):
        shutil.copytree(micro_model_dir, run / f"seed{seed}" / "model")
    (run / "complete.json").write_text(json.dumps({"seeds": [0, 1]}))
    cfg = _cfg(micro_world_dir, tofu_sets=["forget"], multiple_choice={})
    summary = evaluate_path(str(run), cfg, tmp_path / "eval", retain_eval[0])
    for seed in (0, 1):
        logs = json.loads((tmp_path / "eval" / f"seed{seed}" / "TOFU_EVAL.json").read_text())
        assert logs["forget_quality"]["agg_value"] == summary["per_seed"][str(seed)]["forget_quality"]
        assert (tmp_path / "eval" / f"seed{seed}" / "TOFU_SUMMARY.json").is_file()
    assert summary["definitions"]["es_definition"] == "open-unlearning" and "forget_em_std" in summary


def test_cloze_multiple_choice(micro_model_dir, micro_world_dir, tmp_path):
    spec = {"format": "world", "source": str(micro_world_dir), "scoring": "cloze"}
    summary = evaluate_model(str(micro_model_dir), _cfg(micro_world_dir, tofu_sets=[], multiple_choice={"w": spec}),
                             tmp_path / "out", None)
    for part in ("forget", "retain", "world_facts"):
        table = pq.read_table(tmp_path / "out" / "mc" / f"w_{part}.parquet")
        assert json.loads(table.schema.metadata[b"tokenunlearn"]) == {"scoring": "cloze"}
        correct = table.column("correct").to_pylist()
        assert summary[f"mc_w_{part}"] == pytest.approx(sum(correct) / len(correct), abs=1e-6)
    with pytest.raises(ParamError, match=r"evaluate\.multiple_choice\.w\.scoring: 'bogus' is unknown "
                                         r"\(choose from \['cloze', 'letter'\]\)"):
        _cfg(micro_world_dir, multiple_choice={"w": {**spec, "scoring": "bogus"}})


def test_forget_quality_reads_the_retain_models_items(retain_eval, micro_model_dir, micro_tokenizer, micro_world_dir,
                                                      tmp_path):
    from pipeline.common.modeling import build_model, save_model

    from tests.conftest import TINY_MODEL

    other = tmp_path / "other"
    save_model(build_model(TINY_MODEL, micro_tokenizer, seed=5), micro_tokenizer, other)
    cfg = _cfg(micro_world_dir, multiple_choice={}, tofu_sets=["forget"])
    summary = evaluate_model(str(other), cfg, tmp_path / "eval", retain_eval[0])
    from scipy.stats import ks_2samp

    ours = pq.read_table(tmp_path / "eval" / "items" / "forget.parquet").column("truth_ratio").to_pylist()
    theirs = pq.read_table(retain_eval[0] / "items" / "forget.parquet").column("truth_ratio").to_pylist()
    assert summary["forget_quality"] == pytest.approx(ks_2samp(ours, theirs).pvalue)
    assert "model_utility" not in summary  # its sets were not evaluated


def test_missing_retain_results_fail_before_any_work(micro_model_dir, micro_world_dir, tmp_path):
    with pytest.raises(DataError, match=r"nowhere/items/forget.parquet does not exist: evaluate the retain model"):
        evaluate_model(str(micro_model_dir), _cfg(micro_world_dir), tmp_path / "out", tmp_path / "nowhere")
    assert not (tmp_path / "out").exists()


def test_other_forget_questions_are_refused(retain_eval, micro_model_dir, micro_world_dir, tmp_path):
    world = tmp_path / "world"
    shutil.copytree(micro_world_dir, world)
    file = world / "forget10_perturbed.json"
    rows = [json.loads(line) for line in file.read_text().splitlines()]
    rows[0]["question"] = "Who is someone else?"
    file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match="the retain model was evaluated on other forget questions"):
        evaluate_model(str(micro_model_dir), _cfg(world, multiple_choice={}, tofu_sets=["forget"]),
                       tmp_path / "out", retain_eval[0])
    del rows[1]["paraphrased_answer"]
    file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=r"forget10_perturbed.json: row 2: .*paraphrased_answer"):
        evaluate_model(str(micro_model_dir), _cfg(world, multiple_choice={}), tmp_path / "out", None)


def test_a_missing_model_says_how_to_make_it(micro_world_dir, tmp_path):
    with pytest.raises(DataError, match="no such directory; produce it first"):
        evaluate_model(str(tmp_path / "artifacts/unlearn/x/model"), _cfg(micro_world_dir), tmp_path / "o", None)


def _summary(fes, res, mu, fq, mc=None):
    return {"forget_es": fes, "retain_es": res, "model_utility": mu, "log10_forget_quality": fq,
            **({"mc_world_forget": mc} if mc is not None else {})}


def test_report_table_and_plots(tmp_path):
    metrics = tmp_path / "metrics"
    metrics.mkdir()
    for name, s in {"target": _summary(1.0, 1.0, 0.9, -5.0, 0.8), "retain": _summary(0.2, 1.0, 0.9, 0.0, 0.3),
                    "t_npo": _summary(0.25, 0.9, 0.85, -0.5)}.items():
        (metrics / f"{name}.json").write_text(json.dumps(s))
    rows = load_rows(metrics, {"t_npo": {"method": "npo", "weighting": "hard"}})
    markdown, table_csv = results_table(rows)
    lines = markdown.splitlines()
    assert lines[0] == "| model | run | retain ES ↑ | forget ES ↓ | MU ↑ | log10 FQ ↑ | world_forget acc |"
    assert lines[2:] == ["| before unlearning | target | 1.000 | 1.000 | 0.900 | -5.000 | 0.800 |",
                         "| retain model | retain | 1.000 | 0.200 | 0.900 | 0.000 | 0.300 |",
                         "| T-NPO | t_npo | 0.900 | 0.250 | 0.850 | -0.500 | – |"]
    assert table_csv.splitlines()[3] == "T-NPO,t_npo,npo,hard,1,0.9,,0.25,,0.85,,-0.5,,,"
    write_report(rows, tmp_path / "report", tmp_path / "plots")
    for png in ("forget_quality_vs_utility.png", "extraction_strength.png"):
        assert (tmp_path / "report" / png).read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "plots" / "tradeoff.csv").read_text().splitlines()[3] == "T-NPO,npo,hard,0.85,-0.5"
    with pytest.raises(DataError, match=r"s_ga.json: no evaluation of 's_ga' nor of any other run of the report"):
        load_rows(metrics, {"s_ga": {"method": "ga", "weighting": "soft"}})


def test_seeds_are_summarised_as_mean_and_sample_std():
    from pipeline.evaluation.evaluate import aggregate_seeds

    out = aggregate_seeds({0: {"forget_es": 0.2, "source": "w", "forget": {"n": 3}},
                           1: {"forget_es": 0.4, "source": "w", "forget": {"n": 3}},
                           2: {"forget_es": 0.6, "source": "w", "forget": {"n": 3}}})
    assert out["forget_es"] == pytest.approx(0.4) and out["forget_es_std"] == pytest.approx(0.2)
    assert out["source"] == "w" and out["seeds"] == [0, 1, 2] and out["per_seed"]["1"]["forget_es"] == 0.4


def test_comparison_marks_differences_beyond_the_spread(tmp_path):
    from pipeline.studies.report import Row, comparison_table

    def row(name, weighting, fes, sd, seeds=(0, 1, 2)):
        return Row(name, name.upper(), "ga", weighting, {"forget_es": fes, "forget_es_std": sd, "seeds": list(seeds)})

    table = comparison_table([row("ga", "uniform", 0.30, 0.02), row("t_ga", "hard", 0.40, 0.05),
                              row("s_ga", "soft", 0.35, 0.05)]).splitlines()
    assert table[2].startswith("| T_GA − GA | –") and "| +0.100 * |" in table[2]  # 0.10 > 0.02 + 0.05
    assert "| +0.050 |" in table[3]                                                # 0.05 < 0.07: within spread
    # One seed: a std of 0 is no spread, so no difference is marked.
    single = comparison_table([row("ga", "uniform", 0.30, 0.0, [0]), row("t_ga", "hard", 0.40, 0.0, [0])])
    assert "| +0.100 |" in single.splitlines()[2]


def test_comparison_sets_a_variant_score_against_the_same_run_with_phi():
    from pipeline.studies.report import Row, comparison_table

    def row(name, weighting, fes, score="phi"):
        return Row(name, name.upper(), "ga", weighting, {"forget_es": fes, "forget_es_std": 0.01, "seeds": [0, 1]},
                   score)

    lines = comparison_table([row("ga", "uniform", 0.30), row("t_ga", "hard", 0.40),
                              row("t_ga_l", "hard", 0.20, "learned+span")]).splitlines()
    assert lines[2].startswith("| T_GA − GA |") and lines[3].startswith("| T_GA_L − GA |")
    assert lines[4].startswith("| T_GA_L − T_GA |") and "| -0.200 * |" in lines[4]
    assert len(lines) == 5


def test_the_headline_metrics_are_a_few_numbers_of_the_summary():
    from pipeline.evaluation.evaluate import headline_metrics

    summary = {"forget_es": 0.5, "forget_es_std": 0.1, "retain_es": 0.9, "model_utility": 0.8, "seeds": [0, 1],
               "log10_forget_quality": -1.5, "mc_world_forget": 0.7, "mc_world_retain": 0.9, "q8_forget_es": 0.5,
               "per_seed": {"0": {"forget_es": 0.4}}}
    assert headline_metrics(summary) == {"forget_es": 0.5, "retain_es": 0.9, "model_utility": 0.8,
                                         "log10_forget_quality": -1.5, "mc_world_forget": 0.7}


def test_a_tuning_trial_evaluates_what_the_choice_reads_and_no_more(retain_eval, micro_model_dir, micro_world_dir,
                                                                    tmp_path, monkeypatch):
    """A trial's evaluation (`trial_eval_config`): forget ES, retain ES, model utility and forget quality as the full
    evaluation's, with no forget generation, no multiple choice and no attack; an lm-eval utility keeps its tasks."""
    import pipeline.evaluation.tofu_sets as tm
    from pipeline.studies.tune_runs import trial_eval_config

    # as the demo's params.yaml: the probes name a multiple-choice set, which a trial does not evaluate
    params = {"data": {"source": str(micro_world_dir)},
              "evaluate": {"max_new_tokens": 8, "batch_size": 8, "paraphrase": True,
                           "probe_sets": ["forget", "retain", "world_forget"],
                           "multiple_choice": {"world": {"format": "world", "source": str(micro_world_dir)}}}}
    cfg = trial_eval_config(params, "model_utility")
    assert (cfg.forget_rouge, cfg.multiple_choice, cfg.paraphrase, cfg.mia, cfg.sampling) == (False, {}, False, {}, {})
    generated = []
    real_greedy = tm.greedy_answers
    monkeypatch.setattr(tm, "greedy_answers", lambda m, t, tpl, qs, **kw: generated.append(qs) or real_greedy(
        m, t, tpl, qs, **kw))
    summary = evaluate_model(str(micro_model_dir), cfg, tmp_path / "trial", retain_eval[0])
    full = retain_eval[1]
    for key in ("forget_es", "retain_es", "model_utility", "log10_forget_quality"):
        assert summary[key] == full[key], key
    assert len(generated) == 3 and "rouge_l_recall" not in summary["forget"]  # retain, real authors, world facts
    assert not [k for k in summary if k.startswith(("mc_", "forget_para"))]
    items = pq.read_table(tmp_path / "trial" / "items" / "forget.parquet").column_names
    assert "generated" not in items and "rouge_l_recall" not in items and "truth_ratio" in items
    logs = json.loads((tmp_path / "trial" / "TOFU_EVAL.json").read_text())
    assert "forget_Q_A_ROUGE" not in logs and "forget_truth_ratio" in logs and "retain_Q_A_ROUGE" in logs
    assert summary["skipped"] == {"forget_rouge": "no greedy answers on the forget set (evaluate.forget_rouge: false)"}
    assert "skipped" not in full
    # its readers: open-unlearning's export takes it as it is, the before/after answers say what is missing
    from pipeline.evaluation.open_unlearning import export_evaluation
    from pipeline.studies.request import before_after

    export_evaluation(tmp_path / "trial", tmp_path / "exported")
    assert "forget_Q_A_ROUGE" not in json.loads((tmp_path / "exported" / "TOFU_EVAL.json").read_text())
    with pytest.raises(DataError, match="forget_rouge: false"):
        before_after(retain_eval[0], tmp_path / "trial")

    lm = {"tasks": ["arc_easy"], "limit": 10}
    with_lm = {"evaluate": {**params["evaluate"], "lm_eval": lm}, "data": params["data"]}
    assert trial_eval_config(with_lm, "lmeval_arc_easy_acc").lm_eval == lm
    assert trial_eval_config(with_lm, "model_utility").lm_eval == {}
