"""The table over model seeds and its significance: spreads, the two-level paired bootstrap and the verdicts on
hand-computed cases, and the report-seeds command on a small tree of evaluations."""

import json

import numpy as np
import pytest

from pipeline.common.errors import DataError
from pipeline.studies.significance import (compare, comparisons, hierarchical_bootstrap, load_cells, spread,
                                              variant_pairs)
from stages.cli import run


def test_spread_separates_model_seeds_from_unlearning_seeds():
    s = spread(np.array([[1.0, 3.0], [5.0, 7.0]]))
    # model seeds' means 2 and 6: std sqrt(8); within each, std of (1, 3) and (5, 7): sqrt(2)
    assert s["mean"] == 4.0 and s["per_model"] == [2.0, 6.0]
    assert s["between"] == pytest.approx(8 ** 0.5) and s["within"] == pytest.approx(2 ** 0.5)


def test_the_bootstrap_draws_model_seeds_then_unlearning_seeds():
    rng = np.random.default_rng(0)
    assert np.all(hierarchical_bootstrap(np.full((3, 2), 0.25), 100, rng) == 0.25)
    # two model seeds of one cell each: means 1, 2, 3 with probabilities 1/4, 1/2, 1/4
    boot = hierarchical_bootstrap(np.array([[1.0], [3.0]]), 20000, rng)
    assert set(np.unique(boot)) == {1.0, 2.0, 3.0}
    assert np.mean(boot == 2.0) == pytest.approx(0.5, abs=0.02)
    # within a model seed the unlearning seeds are redrawn: seed (0, 4) gives means 0, 2, 4
    assert set(np.unique(hierarchical_bootstrap(np.array([[0.0, 4.0]]), 2000, rng))) == {0.0, 2.0, 4.0}


def test_a_verdict_needs_the_interval_and_every_model_seed():
    rng = np.random.default_rng(0)
    base = np.zeros((3, 3))
    lower = base - np.array([[0.10], [0.20], [0.15]]) + np.array([0.01, -0.01, 0.0])
    assert compare(lower, base, -1, 0.99, 4000, rng)["verdict"] == "better"      # forget ES down: better
    assert compare(lower, base, +1, 0.99, 4000, rng)["verdict"] == "worse"       # MU down: worse
    mixed = base + np.array([[-0.2], [-0.2], [0.05]])                            # one model seed disagrees
    result = compare(mixed, base, -1, 0.99, 4000, rng)
    assert result["verdict"] == "undecided" and result["per_model"] == pytest.approx([-0.2, -0.2, 0.05])
    assert result["mean"] == pytest.approx(-0.35 / 3)


def test_comparisons_are_counted_for_the_family_wise_level():
    def cells(v):
        from pipeline.studies.significance import COLUMNS, Cells
        return Cells("x", {m.key: np.full((3, 2), v if m.key in ("forget_es", "model_utility") else np.nan)
                           for m in COLUMNS})
    results, level = comparisons({"ga": cells(0.5), "t_ga": cells(0.4)}, [("t_ga", "ga")], 0.95, 200, 0)
    assert len(results) == 2 and level == pytest.approx(0.975)
    assert {r["key"]: r["verdict"] for r in results} == {"forget_es": "better", "model_utility": "worse"}


def test_variant_pairs_match_each_token_level_run_to_its_method():
    specs = {"ga": {"method": "ga", "weighting": "uniform"}, "t_ga": {"method": "ga", "weighting": "hard"},
             "s_npo": {"method": "npo", "weighting": "soft"}}
    assert variant_pairs(specs, list(specs)) == [("t_ga", "ga")]


def test_each_attribution_is_also_paired_with_its_random_control_at_the_same_budget():
    run = lambda w, score, **kw: {"method": "ga", "weighting": w, "score": score, "train": {"lr": 1e-4}, **kw}
    specs = {"ga": {"method": "ga", "weighting": "uniform"},
             "t_ga_random": run("hard", "random"), "s_ga_random": run("soft", "random", train={"lr": 3e-4}),
             "t_ga": run("hard", "phi"), "s_ga_learned": run("soft", "learned+span"),
             "s_ga_mix": run("soft", "phi", mix=0.5),                    # no random run mixes: no control
             "t_npo": {"method": "npo", "weighting": "hard", "score": "phi"}}   # nor for another method
    assert variant_pairs(specs, list(specs)) == [
        ("t_ga_random", "ga"), ("s_ga_random", "ga"), ("t_ga", "ga"), ("s_ga_learned", "ga"), ("s_ga_mix", "ga"),
        ("t_ga", "t_ga_random"), ("s_ga_learned", "s_ga_random")]
    # without the random runs in the study, only the sequence-level pairs
    assert variant_pairs(specs, ["ga", "t_ga", "s_ga_learned"]) == [("t_ga", "ga"), ("s_ga_learned", "ga")]


def write_tree(root, model_seeds, runs, unlearn_seeds, value):
    for m in model_seeds:
        for name in ["target", "retain", *runs]:
            dirs = [root / f"m{m}" / "eval" / name] if name in ("target", "retain") else \
                [root / f"m{m}" / "eval" / name / f"seed{s}" for s in unlearn_seeds]
            for d in dirs:
                d.mkdir(parents=True, exist_ok=True)
                (d / "metrics.json").write_text(json.dumps(value(m, name)))
        for name in runs:
            tuning = root / f"m{m}" / "tuning" / name
            tuning.mkdir(parents=True, exist_ok=True)
            (tuning / "choice.json").write_text(json.dumps({"utility_min": 0.84, "runs": {name: {
                "chosen": {"lr": 1e-4 * (m + 1), "model_utility": 0.845, "meets_floor": True},
                "trials": [{}, {}, {}], "converged": True}}}))


def run_report_seeds(root, out, samples: int) -> int:
    """`tokenunlearn report-seeds` on the paper's params over the tree at `root`: model seeds 0-2, GA and T-GA,
    unlearning seeds 0 and 1, `samples` bootstrap samples."""
    from tests.conftest import REPO

    return run(["report-seeds", "--params", str(REPO / "configs" / "paper.yaml"), "--overlay",
                str(REPO / "configs" / "seeds.yaml"), "-S", "seeds.models=[0, 1, 2]", "-S", "seeds.runs=[ga, t_ga]",
                "-S", "unlearn.seeds=[0, 1]", "-S", f"seeds.bootstrap={{samples: {samples}}}",
                "--root", str(root), "--out", str(out)])


def test_the_report_names_a_missing_evaluation(tmp_path):
    write_tree(tmp_path, [0], ["ga"], [0, 1], lambda m, n: {"forget_es": 0.5})
    with pytest.raises(DataError, match=r"m1/eval/target/metrics.json: no evaluation of 'target' for model seed 1"):
        load_cells(tmp_path, [0, 1], ["ga"], [0, 1])


def test_report_seeds_writes_the_table_comparisons_and_learning_rates(tmp_path):
    def value(m, name):
        es = {"target": 1.0, "retain": 0.15, "ga": 0.5, "t_ga": 0.4 - 0.01 * m}[name]
        return {"forget_es": es, "retain_es": 0.9, "model_utility": 0.85, "log10_forget_quality": -1.0}
    write_tree(tmp_path / "seeds", [0, 1, 2], ["ga", "t_ga"], [0, 1], value)
    out = tmp_path / "report"
    assert run_report_seeds(tmp_path / "seeds", out, samples=500) == 0
    text = (out / "results.md").read_text()
    assert "| T-GA | t_ga | 0.900 ± 0.000 / 0.000 | 0.390 ± 0.010 / 0.000 | 0.850 ± 0.000 / 0.000 |" in text
    assert "4 comparisons" in text and "| T-GA − GA |" in text
    summary = json.loads((out / "comparisons.json").read_text())
    assert summary["comparisons"] == 4 and summary["level"] == pytest.approx(1 - 0.05 / 4)
    by_key = {r["key"]: r for r in summary["results"]}
    assert by_key["forget_es"]["verdict"] == "better" and by_key["forget_es"]["mean"] == pytest.approx(-0.11)
    assert by_key["model_utility"]["verdict"] == "undecided"  # equal everywhere: no difference to call
    assert "| T-GA | 1.00e-04 (0.845 / 0.840, 3) | 2.00e-04 (0.845 / 0.840, 3) | 3.00e-04 (0.845 / 0.840, 3) |" in text
    assert (out / "comparisons.csv").read_text().startswith("variant,base,key,mean,lo,hi,verdict,per_model\n")


def test_the_models_table_says_where_each_target_stopped_and_whether_it_memorised(tmp_path):
    from pipeline.studies.significance import models_table

    for m, (stopped, epochs, loss, es) in enumerate([("stop_loss", 35, 0.0192, 0.991), ("cap", 60, 0.0413, 0.9)]):
        (tmp_path / f"m{m}/models/target").mkdir(parents=True)
        (tmp_path / f"m{m}/models/target/finetune.json").write_text(json.dumps(
            {"stopped_by": stopped, "epochs": epochs, "last_epoch_loss": loss}))
        (tmp_path / f"m{m}/eval/target").mkdir(parents=True)
        (tmp_path / f"m{m}/eval/target/metrics.json").write_text(json.dumps({"forget_es": es, "model_utility": 0.8}))
    text = models_table(tmp_path, [0, 1, 2])
    assert "| 0 | stop_loss (35) | 0.0192 | 0.991 | 0.800 | yes | – (–) | – | – |" in text
    assert "| 1 | cap (60) | 0.0413 | 0.900 | 0.800 | **no** |" in text
    assert "| 2 | – (–) | – | – | – | – |" in text  # a model seed not trained yet


def test_report_seeds_reads_the_models_of_another_experiment_and_names_every_method_as_its_authors(tmp_path,
                                                                                                    capsys):
    """experiments/methods: its runs under --root, the target and retain model (and their evaluations) the seeds
    experiment's, under --models-root; labels as the methods' authors write them (SimNPO, not SIMNPO)."""
    import shutil

    def value(m, name):
        es = {"target": 1.0, "retain": 0.15, "simnpo": 0.5, "t_simnpo": 0.4, "s_simnpo": 0.6, "idknll": 0.7}[name]
        return {"forget_es": es, "retain_es": 0.9, "model_utility": 0.85, "log10_forget_quality": -1.0}
    runs = ["simnpo", "t_simnpo", "s_simnpo", "idknll"]
    write_tree(tmp_path / "seeds", [0], [], [0, 1, 2], value)
    write_tree(tmp_path / "methods", [0], runs, [0, 1, 2], value)
    for name in ("target", "retain"):  # only the seeds experiment has them
        shutil.rmtree(tmp_path / "methods" / "m0" / "eval" / name)
    from tests.conftest import REPO

    args = ["report-seeds", "--params", str(REPO / "configs" / "paper.yaml"), "--overlay",
            str(REPO / "configs" / "seeds.yaml"), "--overlay", str(REPO / "configs" / "methods.yaml"),
            "-S", f"seeds.runs={runs}", "-S", "seeds.bootstrap={samples: 500}", "--root", str(tmp_path / "methods"),
            "--out", str(tmp_path / "report")]
    assert run(args) != 0
    assert "methods/m0/eval/target/metrics.json: no evaluation of 'target'" in capsys.readouterr().err
    assert run([*args, "--models-root", str(tmp_path / "seeds")]) == 0
    text = (tmp_path / "report" / "results.md").read_text()
    assert "| before unlearning | target | 0.900 ± 0.000 / 0.000 | 1.000 ± 0.000 / 0.000 |" in text
    assert "| SimNPO | simnpo |" in text and "| IdkNLL | idknll |" in text
    assert "| T-SimNPO [entropy+nocopy+span] − SimNPO |" in text  # the score that weighs it, as the seeds report's
    assert "| S-SimNPO [entropy+nocopy+span] − SimNPO |" in text and "IdkNLL −" not in text  # no variant to compare


def test_report_seeds_judges_each_attribution_against_its_random_control(tmp_path):
    """configs/controls.yaml's GA runs: beside each run − GA, the learned scorer − random tokens at its budget,
    in the same family of comparisons."""
    def value(m, name):
        es = {"target": 1.0, "retain": 0.15, "ga": 0.5, "t_ga_random": 0.45, "t_ga_learned": 0.35 - 0.01 * m}[name]
        return {"forget_es": es, "retain_es": 0.9, "model_utility": 0.85, "log10_forget_quality": -1.0}
    runs = ["ga", "t_ga_random", "t_ga_learned"]
    write_tree(tmp_path / "controls", [0, 1, 2], runs, [0, 1], value)
    from tests.conftest import REPO

    configs = REPO / "configs"
    assert run(["report-seeds", "--params", str(configs / "paper.yaml"), "--overlay", str(configs / "seeds.yaml"),
                "--overlay", str(configs / "controls.yaml"), "-S", "seeds.models=[0, 1, 2]", "-S", f"seeds.runs={runs}",
                "-S", "unlearn.seeds=[0, 1]", "-S", "seeds.bootstrap={samples: 500}",
                "--root", str(tmp_path / "controls"), "--out", str(tmp_path / "report")]) == 0
    text = (tmp_path / "report" / "results.md").read_text()
    assert "and each attribution against random tokens at its budget: 12 comparisons" in text
    row = next(line for line in text.splitlines() if line.startswith("| T-GA [learned+span] − T-GA [random] |"))
    assert "-0.110 [" in row and "▲" in row  # 0.35 - 0.01 m against 0.45 on every model seed
    summary = json.loads((tmp_path / "report" / "comparisons.json").read_text())
    assert {(r["variant"], r["base"]) for r in summary["results"]} == {
        ("t_ga_random", "ga"), ("t_ga_learned", "ga"), ("t_ga_learned", "t_ga_random")}


def test_report_seeds_without_the_seeds_overlay_names_the_overlay(tmp_path):
    from click.testing import CliRunner

    from stages.cli import cli
    from tests.conftest import REPO

    result = CliRunner().invoke(cli, ["report-seeds", "--params", str(REPO / "configs" / "paper.yaml"),
                                      "--root", str(tmp_path), "--out", str(tmp_path / "report")])
    assert result.exit_code != 0 and not (tmp_path / "report").exists()
    assert "no `seeds` section" in str(result.exception) and "--overlay configs/seeds.yaml" in str(result.exception)
