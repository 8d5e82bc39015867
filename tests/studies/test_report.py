"""The report of a sweep still under way: rows for the runs evaluated, the others named with the command that makes
them, a sentence where a comparison has no baseline, ablations skipped below two runs, and every declared output."""

import json
import logging

import pytest
import yaml
from click.testing import CliRunner

from pipeline.common.errors import DataError
from pipeline.studies.report import (Row, comparison_table, load_ablations, load_rows, missing_evaluations,
                                        missing_note)
from stages.cli import cli


def _summary(fes, mu=0.8):
    return {"forget_es": fes, "retain_es": 0.9, "model_utility": mu, "log10_forget_quality": -1.0}


def _metrics(tmp_path, names) -> object:
    metrics = tmp_path / "eval"
    metrics.mkdir()
    for i, name in enumerate(names):
        (metrics / f"{name}.json").write_text(json.dumps(_summary(0.1 * i)))
    return metrics


SPECS = {"npo": {"method": "npo", "weighting": "uniform"}, "t_npo": {"method": "npo", "weighting": "hard"},
         "s_npo": {"method": "npo", "weighting": "soft"},
         "t_npo_l": {"method": "npo", "weighting": "hard", "score": "learned"}}


def test_rows_are_the_runs_evaluated_and_the_others_are_named(tmp_path):
    metrics = _metrics(tmp_path, ["target", "retain", "t_npo", "t_npo_l"])
    rows = load_rows(metrics, SPECS)
    assert [(r.name, r.label) for r in rows] == [("target", "before unlearning"), ("retain", "retain model"),
                                                 ("t_npo", "T-NPO"), ("t_npo_l", "T-NPO [learned]")]
    assert missing_evaluations(metrics, [*SPECS, "npo"]) == ["npo", "s_npo"]
    assert missing_note(["npo", "s_npo"]) == ("Not evaluated yet, so not in this report: npo, s_npo; make them with "
                                              "`dvc repro evaluate@npo evaluate@s_npo`.")


@pytest.mark.parametrize("absent, stage", [("target", "evaluate_target"), ("retain", "evaluate_retain")])
def test_the_target_and_the_retain_model_are_required(tmp_path, absent, stage):
    metrics = _metrics(tmp_path, [n for n in ("target", "retain", "npo") if n != absent])
    with pytest.raises(DataError, match=rf"{absent}.json: no evaluation of '{absent}' \(make it with "
                                        rf"`dvc repro {stage}`"):
        load_rows(metrics, SPECS)


def test_no_run_evaluated_is_an_error_naming_the_file(tmp_path):
    metrics = _metrics(tmp_path, ["target", "retain"])
    with pytest.raises(DataError, match=r"eval/npo.json: no evaluation of 'npo' nor of any other run of the report "
                                        r"\(4 runs\)"):
        load_rows(metrics, SPECS)
    assert len(load_rows(metrics, {})) == 2  # a report of no runs asks for none


def _row(name, weighting, fes, score="phi"):
    return Row(name, name.upper(), "npo", weighting, {"forget_es": fes, "seeds": [0]}, score)


def test_a_comparison_without_its_baseline_says_so_in_a_sentence():
    only_variants = comparison_table([_row("t_npo", "hard", 0.2), _row("s_npo", "soft", 0.3)])
    assert only_variants == ("No comparison for T_NPO (against NPO), S_NPO (against NPO): the baseline is not "
                             "among the evaluated runs.\n")
    some = comparison_table([_row("npo", "uniform", 0.5), _row("t_npo", "hard", 0.2),
                             _row("t_npo_l", "hard", 0.1, "learned")]).splitlines()
    assert some[2].startswith("| T_NPO − NPO | –") and "| -0.300 |" in some[2]
    assert some[3].startswith("| T_NPO_L − NPO |") and "| -0.400 |" in some[3]
    assert some[4].startswith("| T_NPO_L − T_NPO |") and "| -0.100 |" in some[4]
    assert len(some) == 5  # every baseline there: the table alone
    partial = comparison_table([_row("npo", "uniform", 0.5), _row("t_npo_l", "hard", 0.1, "learned")])
    assert partial.splitlines()[2].startswith("| T_NPO_L − NPO |")
    assert partial.splitlines()[3:] == ["", "No comparison for T_NPO_L (against T-NPO): the baseline is not among "
                                            "the evaluated runs."]
    assert comparison_table([_row("npo", "uniform", 0.5)]).startswith("No token-level run or other attribution")


def test_an_ablation_needs_two_evaluated_runs(tmp_path, caplog):
    specs = {"t_r10": {"method": "npo", "weighting": "hard", "r": 0.1},
             "t_r40": {"method": "npo", "weighting": "hard", "r": 0.4},
             "t_r20": {"method": "npo", "weighting": "hard", "r": 0.2}}
    metrics = _metrics(tmp_path, ["target", "retain", "t_r40"])
    with caplog.at_level(logging.WARNING, logger="pipeline.studies.report"):
        assert load_ablations(metrics, {"r": list(specs)}, specs) == []
    assert "ablation of r skipped: 1 of its 3 runs evaluated (not yet: t_r10, t_r20)" in caplog.text
    (metrics / "t_r10.json").write_text(json.dumps(_summary(0.5)))
    (ablation,) = load_ablations(metrics, {"r": list(specs)}, specs)
    assert [(x, r.name) for x, r in ablation.points] == [(0.1, "t_r10"), (0.4, "t_r40")]
    with pytest.raises(DataError, match=r"report.ablations.r: \['t_r99'\] are not runs of unlearn.runs"):
        load_ablations(metrics, {"r": ["t_r99"]}, specs)


PARAMS = {
    "unlearn": {"defaults": {"retain_split": "retain90"},
                "weightings": {"uniform": {}, "hard": {"r": 0.2, "alpha": 0.7, "score": "learned"},
                               "soft": {"tau": 0.5, "alpha": 0.7, "score": "phi"}},
                "methods": {"npo": {"beta": 0.1}},
                "runs": {"npo": {"method": "npo", "weighting": "uniform"},
                         "t_npo": {"method": "npo", "weighting": "hard", "train": {"lr": 1e-4}},
                         "s_npo": {"method": "npo", "weighting": "soft"},
                         "t_npo_r40": {"method": "npo", "weighting": "hard", "r": 0.4}}},
    "report": {"table": ["npo", "t_npo", "s_npo"], "ablations": {"r": ["t_npo", "t_npo_r40"]}},
}


def test_the_report_of_a_sweep_under_way_makes_every_output(tmp_path):
    """One run evaluated: its row (labelled from the weighting's score), a line naming the others and how to make
    them, a sentence for the comparison, no ablation plot, and both output directories with every plot that has
    data."""
    metrics = _metrics(tmp_path, ["target", "retain", "t_npo"])
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump(PARAMS))
    out, plots = tmp_path / "report", tmp_path / "plots"
    result = CliRunner().invoke(cli, ["report", "--params", str(params), "--metrics-dir", str(metrics),
                                      "--out", str(out), "--plots", str(plots)])
    assert result.exit_code == 0, result.output
    note = ("Not evaluated yet, so not in this report: npo, s_npo, t_npo_r40; make them with "
            "`dvc repro evaluate@npo evaluate@s_npo evaluate@t_npo_r40`.")
    assert f"WARNING stages.report: {note}" in result.output
    assert "ablation of r skipped: 1 of its 2 runs evaluated (not yet: t_npo_r40)" in result.output
    text = (out / "results.md").read_text()
    assert text.splitlines()[0] == note
    assert "| T-NPO [learned] | t_npo |" in text  # its score from unlearn.weightings.hard
    assert ("No comparison for T-NPO [learned] (against NPO), T-NPO [learned] (against T-NPO): the baseline is "
            "not among the evaluated runs.") in text
    assert "Ablation" not in text and not list(out.glob("ablation_*"))
    assert sorted(p.name for p in out.iterdir()) == ["extraction_strength.png", "forget_quality_vs_utility.png",
                                                     "results.csv", "results.md"]
    assert sorted(p.name for p in plots.iterdir()) == ["extraction_strength.csv", "tradeoff.csv"]
    assert len((out / "results.csv").read_text().splitlines()) == 4  # header, target, retain, t_npo

    (metrics / "t_npo_r40.json").write_text(json.dumps(_summary(0.2)))
    result = CliRunner().invoke(cli, ["report", "--params", str(params), "--metrics-dir", str(metrics),
                                      "--out", str(out), "--plots", str(plots)])
    assert result.exit_code == 0, result.output
    assert (out / "ablation_r.png").is_file() and (plots / "ablation_r.csv").read_text().splitlines()[1:] == [
        "0.2,t_npo,0.9,,0.2,,0.8,,-1.0,", "0.4,t_npo_r40,0.9,,0.2,,0.8,,-1.0,"]
    assert "Ablation of r:" in (out / "results.md").read_text()


def test_the_robustness_table_needs_an_attack_not_plain_multiple_choice():
    from pipeline.studies.report import Row, robustness_keys

    plain = [Row("t", "before unlearning", "", "", {"forget_es": 1.0, "mc_world_forget": 1.0})]
    assert robustness_keys(plain) == []
    attacked = [Row("t", "before unlearning", "", "", {"mc_world_forget": 1.0, "q4_forget_es": 0.9})]
    assert [m.key for m in robustness_keys(attacked)] == ["q4_forget_es", "mc_world_forget"]


def test_every_registered_method_is_labelled_as_its_authors_write_it():
    from pipeline.studies.report import paper_name
    from pipeline.training.methods import METHODS

    untitled = [name for name, method in METHODS.items() if not method.title]
    assert not untitled, f"give these methods' Method a title (their name as their authors write it): {untitled}"
    assert [paper_name(m, "uniform") for m in ("simnpo", "satimp", "ceu", "idkdpo", "altpo", "idknll", "undial")] == \
        ["SimNPO", "SatImp", "CE-U", "IdkDPO", "AltPO", "IdkNLL", "UNDIAL"]
    assert (paper_name("graddiff", "hard"), paper_name("npo", "soft"), paper_name("ceu", "hard")) == \
        ("T-GradDiff", "S-NPO", "T-CE-U")
