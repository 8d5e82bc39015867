"""The bisections' trade-off curves compared as curves: interpolation on a hand-made curve, the variant − method
comparison on two model seeds, a sweep under way (choice.json files missing), the plots, and report-seeds."""

import json

import pytest

from pipeline.common.errors import DataError
from pipeline.studies.tradeoff import (LEVELS, Curve, compare_curves, compare_fronts, curves_csv, curves_markdown,
                                          forget_es_at, fronts_markdown, load_curves, plot_methods)

# (model utility, forget ES) per lr 1e-4, 2e-4, 4e-4: MU falls, and forget ES with it
CURVE = [(0.90, 0.80), (0.86, 0.50), (0.80, 0.20)]


def trials(points):
    return [{"lr": 1e-4 * 2 ** i, "model_utility": mu, "forget_es": es} for i, (mu, es) in enumerate(points)]


def write_choice(root, m, name, utility_min, points, chosen=1, past=()):
    """A tuning's choice.json; `past`: (MU, forget ES) of the probes past the crossing, at 8e-4, 1.6e-3, ..."""
    d = root / f"m{m}" / "tuning" / name
    d.mkdir(parents=True, exist_ok=True)
    t = trials(points)
    probes = [{"lr": 8e-4 * 2 ** i, "model_utility": mu, "forget_es": es} for i, (mu, es) in enumerate(past)]
    (d / "choice.json").write_text(json.dumps({"utility_min": utility_min, "runs": {name: {
        "trials": t[::-1], "chosen": {**t[chosen], "meets_floor": True},  # any order: read in lr order
        **({"past_crossing": probes} if past else {})}}}))


def test_forget_es_is_interpolated_where_the_curve_first_falls_to_a_level():
    t = trials(CURVE)
    assert forget_es_at(t, 0.85) == pytest.approx(0.45)   # 1/6 of the way from (0.86, 0.50) to (0.80, 0.20)
    assert forget_es_at(t, 0.84) == pytest.approx(0.40)   # 1/3 of the way
    assert forget_es_at(t, 0.86) == pytest.approx(0.50)   # on a trial
    assert forget_es_at(t, 0.87) == pytest.approx(0.575)  # 3/4 of the way from (0.90, 0.80) to (0.86, 0.50)
    assert forget_es_at(t, 0.95) is None and forget_es_at(t, 0.70) is None  # beyond the trials: not extrapolated
    # utility not monotone in the rate: the first crossing, as the bisection meets it
    bumpy = trials([(0.90, 0.9), (0.80, 0.5), (0.88, 0.4), (0.70, 0.1)])
    assert forget_es_at(bumpy, 0.85) == pytest.approx(0.7)


def test_a_variant_is_compared_with_its_method_at_every_level_on_two_model_seeds(tmp_path):
    write_choice(tmp_path, 0, "ga", 0.85, CURVE)
    write_choice(tmp_path, 0, "t_ga", 0.85, [(mu, es - 0.1) for mu, es in CURVE])  # 0.1 lower everywhere
    base1 = [(0.80, 0.6), (0.76, 0.4), (0.70, 0.1)]
    write_choice(tmp_path, 1, "ga", 0.75, base1)
    write_choice(tmp_path, 1, "t_ga", 0.75, [(0.76, 0.45), (0.70, 0.15)], chosen=0)  # 0.05 higher; starts at 0.76
    curves = load_curves(tmp_path, [0, 1], ["ga", "t_ga"])
    assert [t["lr"] for t in curves[("ga", 0)].trials] == [1e-4, 2e-4, 4e-4]
    results = compare_curves(curves, [("t_ga", "ga")], [0, 1])
    by = {r["offset"]: r for r in results}
    assert list(by) == list(LEVELS) == [-0.01, 0.0, 0.01, 0.02]
    for d in (-0.01, 0.0, 0.01):  # both model seeds: −0.1 and +0.05
        assert by[d]["n"] == 2 and by[d]["lower"] == 1 and by[d]["mean"] == pytest.approx(-0.025)
        assert by[d]["per_model"] == {0: pytest.approx(-0.1), 1: pytest.approx(0.05)}
    # floor + 0.02 = 0.77 on model seed 1: above T-GA's first trial, so only model seed 0 counts
    assert by[0.02]["n"] == 1 and by[0.02]["lower"] == 1 and by[0.02]["mean"] == pytest.approx(-0.1)
    text = curves_markdown(curves, results, [0, 1], ["ga", "t_ga"])
    assert "| variant − method | floor -0.01 | floor | floor +0.01 | floor +0.02 |" in text
    assert "| t_ga − ga | -0.025 (1/2) | -0.025 (1/2) | -0.025 (1/2) | -0.100 (1/1) |" in text
    assert "Curves reaching each level: floor -0.01 4, floor 4, floor +0.01 4, floor +0.02 3." in text
    rows = curves_csv(curves).splitlines()
    assert rows[0] == "run,model_seed,utility_min,offset,utility,forget_es,trials"
    assert "t_ga,1,0.75,0.02,0.77,,2" in rows and "ga,0,0.85,0.0,0.85,0.45,3" in rows


def test_a_sweep_under_way_leaves_out_the_missing_curves(tmp_path):
    write_choice(tmp_path, 0, "ga", 0.85, CURVE)
    write_choice(tmp_path, 0, "t_ga", 0.85, [(mu, es - 0.1) for mu, es in CURVE])
    write_choice(tmp_path, 1, "t_ga", 0.75, CURVE)  # model seed 1 without GA's; model seed 2 without any
    curves = load_curves(tmp_path, [0, 1, 2], ["ga", "t_ga", "s_ga"])
    assert sorted(curves) == [("ga", 0), ("t_ga", 0), ("t_ga", 1)]
    results = compare_curves(curves, [("t_ga", "ga"), ("s_ga", "ga")], [0, 1, 2])
    assert all(r["n"] == 1 for r in results if r["variant"] == "t_ga")
    assert all(r["n"] == 0 and r["mean"] is None for r in results if r["variant"] == "s_ga")
    text = curves_markdown(curves, results, [0, 1, 2], ["ga", "t_ga", "s_ga"])
    assert "3 of 9 curves" in text and "| s_ga − ga | – | – | – | – |" in text
    # trials without numbers are no points; a choice.json of another shape is refused
    (tmp_path / "m1" / "tuning" / "ga").mkdir(parents=True)
    (tmp_path / "m1" / "tuning" / "ga" / "choice.json").write_text(json.dumps(
        {"utility_min": 0.8, "runs": {"ga": {"trials": [{}, {"lr": 1e-4}], "chosen": {"lr": 1e-4}}}}))
    curve = load_curves(tmp_path, [1], ["ga"])[("ga", 1)]
    assert curve.trials == [] and curve.chosen is None
    (tmp_path / "m1" / "tuning" / "ga" / "choice.json").write_text(json.dumps({"utility_min": 0.8, "runs": {}}))
    with pytest.raises(DataError, match="runs.ga.trials expected"):
        load_curves(tmp_path, [1], ["ga"])


def test_a_figure_per_method_is_written(tmp_path):
    curves = {("ga", 0): Curve("ga", 0, 0.85, trials(CURVE), trials(CURVE)[1]),
              ("t_ga", 1): Curve("t_ga", 1, 0.75, trials(CURVE), None)}
    specs = {"ga": {"method": "ga"}, "t_ga": {"method": "ga"}, "npo": {"method": "npo"}}
    written = plot_methods(curves, specs, ["ga", "t_ga", "npo"], [0, 1, 2], tmp_path)
    assert written == ["tradeoff_ga.png"]  # NPO has no curve yet: no figure
    assert (tmp_path / "tradeoff_ga.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_seeds_appends_the_curves(tmp_path):
    from tests.studies.test_significance import run_report_seeds, write_tree

    write_tree(tmp_path / "seeds", [0, 1, 2], ["ga", "t_ga"], [0, 1],
               lambda m, n: {"forget_es": 0.5, "retain_es": 0.9, "model_utility": 0.85})
    for m in (0, 1):
        write_choice(tmp_path / "seeds", m, "ga", 0.85, CURVE)
        write_choice(tmp_path / "seeds", m, "t_ga", 0.85, [(mu, es - 0.1) for mu, es in CURVE])
    (tmp_path / "seeds" / "m2" / "tuning" / "t_ga" / "choice.json").unlink()  # m2: GA's without trials, no T-GA's
    out = tmp_path / "report"
    assert run_report_seeds(tmp_path / "seeds", out, samples=200) == 0
    text = (out / "results.md").read_text()
    assert "### Trade-off curves: forget ES on each run's curve at equal utility" in text
    assert "| t_ga − ga | -0.100 (2/2) | -0.100 (2/2) | -0.100 (2/2) | -0.100 (2/2) |" in text
    assert "| T-GA | 2.00e-04 (0.860 / 0.850, 3) | 2.00e-04 (0.860 / 0.850, 3) | – |" in text  # as before
    assert (out / "tradeoff_ga.png").is_file() and "`tradeoff_ga.png`" in text
    assert (out / "curves.csv").is_file() and (out / "curve_comparisons.csv").read_text().startswith(
        "variant,base,offset,mean,n,lower,per_model\nt_ga,ga,-0.01,-0.1,2,2,0:-0.100000 1:-0.100000\n")


def test_the_demos_runs_at_equal_utility_are_read_on_their_curves(tmp_path):
    """The demo's report: each run's tuning (RUN/choice.json), forget ES where its curve falls to the floor, each
    token-level run against its method's sequence-level one, and which forgets the most there."""
    from pipeline.studies.tradeoff import write_equal_utility

    tuning = tmp_path / "tuning"
    for name, points in {"npo": CURVE, "s_npo": [(0.90, 0.70), (0.86, 0.40), (0.80, 0.10)],
                         "t_npo": [(0.90, 0.85), (0.87, 0.80)]}.items():  # t_npo never falls to the floor
        write_choice(tmp_path, 0, name, 0.85, points)
        (tuning / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "m0" / "tuning" / name).rename(tuning / name)
    specs = {"npo": {"method": "npo", "weighting": "uniform"}, "s_npo": {"method": "npo", "weighting": "soft"},
             "t_npo": {"method": "npo", "weighting": "hard"}, "ga": {"method": "ga", "weighting": "uniform"}}
    labels = {"npo": "NPO", "s_npo": "S-NPO", "t_npo": "T-NPO", "ga": "GA"}
    runs = ["npo", "t_npo", "s_npo", "ga"]  # ga: not tuned
    text = write_equal_utility(tuning, runs, specs, labels, [("t_npo", "npo"), ("s_npo", "npo")], tmp_path / "out",
                               tmp_path / "plots")
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| run")]
    # NPO: 1/6 of the way from (0.86, 0.50) to (0.80, 0.20) -> 0.45; S-NPO: from (0.86, 0.40) to (0.80, 0.10) -> 0.35
    # the front: the lowest forget ES at MU ≥ 0.85 over the trials, (0.86, 0.50) for NPO
    assert rows[0] == "| NPO | 2.00e-04 | 3 | 0.450 |  | 0.500 (2.00e-04) |"
    assert rows[1].startswith("| T-NPO | 2.00e-04 | 2 | – (its curve does not reach the floor)")
    assert rows[1].endswith("| 0.800 (2.00e-04) |")
    assert rows[2] == "| S-NPO | 2.00e-04 | 3 | 0.350 | -0.100: forgets more than NPO | 0.400 (2.00e-04) |"
    assert rows[3] == "| GA | – | – | – (not tuned) | | |"
    assert "At the same utility, S-NPO forgets the most (forget ES 0.350; NPO 0.450)." in text
    assert "model utility 0.850" in text and "`tradeoff_npo.png`" in text
    assert (tmp_path / "out" / "tradeoff_npo.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "plots" / "curves.csv").read_text().startswith("run,model_seed,utility_min")


def test_the_fronts_read_every_trial_past_the_crossing_and_are_compared_per_model_seed(tmp_path):
    """Model seed 0: GA's utility recovers past the crossing (0.88 at 8e-4, forget ES 0.05), so its front lies
    there and T-GA, 0.1 lower at every trial but without probes, is 0.35 worse at the front though better on the
    curve; model seed 1: neither recovers, T-GA 0.1 lower at the front."""
    write_choice(tmp_path, 0, "ga", 0.85, CURVE, past=[(0.88, 0.05), (0.70, 0.01)])
    write_choice(tmp_path, 0, "t_ga", 0.85, [(mu, es - 0.1) for mu, es in CURVE])
    write_choice(tmp_path, 1, "ga", 0.85, CURVE, past=[(0.70, 0.1)])
    write_choice(tmp_path, 1, "t_ga", 0.85, [(mu, es - 0.1) for mu, es in CURVE], past=[(0.60, 0.0)])
    curves = load_curves(tmp_path, [0, 1], ["ga", "t_ga"])
    assert curves[("ga", 0)].front == {"lr": 8e-4, "model_utility": 0.88, "forget_es": 0.05}
    assert curves[("ga", 0)].recovers_at == [8e-4] and curves[("ga", 1)].recovers_at == []
    assert curves[("t_ga", 0)].front == {"lr": 2e-4, "model_utility": 0.86, "forget_es": pytest.approx(0.4)}
    [r] = compare_fronts(curves, [("t_ga", "ga")], [0, 1])
    assert r["per_model"] == {0: pytest.approx(0.35), 1: pytest.approx(-0.1)} and r["lower"] == 1 and r["n"] == 2
    assert r["mean"] == pytest.approx(0.125)
    # the curves' reading is unchanged by the probes: at the floor, T-GA 0.1 lower on both model seeds
    by = {x["offset"]: x for x in compare_curves(curves, [("t_ga", "ga")], [0, 1])}
    assert by[0.0]["mean"] == pytest.approx(-0.1) and by[0.0]["lower"] == 2
    text = fronts_markdown(curves, [r])
    assert "| t_ga − ga | +0.125 (1/2) | m0 +0.350 m1 -0.100 |" in text
    assert "3 of 4 curves have such probes" in text and "on 1: ga (m0)." in text
    bad = tmp_path / "m0" / "tuning" / "ga" / "choice.json"
    data = json.loads(bad.read_text())
    data["runs"]["ga"]["past_crossing"] = {"lr": 1}
    bad.write_text(json.dumps(data))
    with pytest.raises(DataError, match="past_crossing: .* is not a list of trials"):
        load_curves(tmp_path, [0], ["ga"])
