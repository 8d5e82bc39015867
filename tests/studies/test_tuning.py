"""Learning-rate tuning: the selection rule on hand-made trials, the bisection onto the utility floor on a
hand-computed utility curve, and a rerun that finds every trial done."""

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from pipeline.common.errors import DataError, ParamError
from pipeline.common.params import LEARNING_RATE
from pipeline.training.engine import TrainConfig
from pipeline.studies.tradeoff import forget_es_at, front, recovers_at
from pipeline.studies.tuning import BisectConfig, TuneConfig, bisect_lr, choice_table, choose, tune_group
from pipeline.studies.tune_runs import chosen_lr, plot_tradeoff

TRIALS = [  # lr, forget ES, MU
    {"lr": 1e-4, "forget_es": 0.80, "model_utility": 0.88},
    {"lr": 2e-4, "forget_es": 0.40, "model_utility": 0.86},
    {"lr": 4e-4, "forget_es": 0.40, "model_utility": 0.87},
    {"lr": 8e-4, "forget_es": 0.05, "model_utility": 0.50},
]


def test_lowest_forget_es_above_the_utility_floor_ties_to_higher_utility():
    # floor 0.85: 8e-4 is out; 2e-4 and 4e-4 tie on forget ES, 4e-4 keeps more utility
    assert choose(TRIALS, 0.85) == {**TRIALS[2], "meets_floor": True}
    assert choose(TRIALS, 0.40)["lr"] == 8e-4
    assert choose(TRIALS, 0.875)["lr"] == 1e-4


def test_no_trial_above_the_floor_takes_the_highest_utility():
    assert choose(TRIALS, 0.95) == {**TRIALS[0], "meets_floor": False}
    with pytest.raises(ParamError):
        choose([], 0.5)


def test_forget_es_where_the_curve_crosses_a_utility():
    # between 4e-4 (MU 0.87, ES 0.40) and 8e-4 (MU 0.50, ES 0.05): at 0.685, halfway, ES 0.225
    assert forget_es_at(TRIALS, 0.685) == pytest.approx(0.225)
    # the first crossing in lr order: 1e-4 -> 2e-4 falls from 0.88 to 0.86
    assert forget_es_at(TRIALS, 0.87) == pytest.approx(0.60)
    assert forget_es_at(TRIALS, 0.95) is None and forget_es_at(TRIALS, 0.1) is None


def test_config_errors_name_the_key():
    with pytest.raises(ParamError, match="tune.lrs"):
        TuneConfig.from_params({"lrs": [1e-4, -1.0]})
    with pytest.raises(ParamError, match="tune.utility_floor"):
        TuneConfig.from_params({"utility_floor": 1.5})
    with pytest.raises(ParamError, match="tune.groups.ga"):
        TuneConfig.from_params({"groups": {"ga": []}})


def test_a_rerun_reuses_finished_trials_and_writes_the_choice(tmp_path):
    cfg = TuneConfig(lrs=[t["lr"] for t in TRIALS], utility_floor=0.95, groups={"ga": ["ga", "t_ga"]})
    for name in ("ga", "t_ga"):
        for t in TRIALS:
            path = tmp_path / "trials" / name / f"lr{t['lr']:.2e}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(t))

    def never(*args):
        raise AssertionError("a finished trial was run again")

    runs = {"ga": (None, None), "t_ga": (None, None)}
    result = tune_group("ga", runs, cfg, never, never, 0.9, tmp_path)
    assert result["utility_min"] == pytest.approx(0.855)
    assert {n: r["chosen"]["lr"] for n, r in result["runs"].items()} == {"ga": 4e-4, "t_ga": 4e-4}
    assert json.loads((tmp_path / "choice.json").read_text()) == json.loads(json.dumps(result))
    table = choice_table(result)
    # at the floor 0.855 the curve crosses between 4e-4 and 8e-4: 0.40 + (0.015 / 0.37) * (0.05 - 0.40) = 0.386
    assert "| ga | 0.800 / 0.880 | 0.400 / 0.860 | **0.400 / 0.870** | 0.050 / 0.500 | 4.0e-04 | 0.386 |" in table
    plot_tradeoff(result, tmp_path / "tradeoff.png")
    assert (tmp_path / "tradeoff.png").read_bytes()[:4] == b"\x89PNG"


def curve(calls: list):
    """MU = 0.9 − 0.1·log2(lr / 1e-4): utility falls 0.1 per doubling; forget ES falls with it."""
    def trial_at(lr):
        calls.append(lr)
        mu = 0.9 - 0.1 * math.log2(lr / 1e-4)
        return {"lr": lr, "model_utility": mu, "forget_es": 0.5 * mu}
    return trial_at


def test_bisection_brackets_then_lands_on_the_floor_by_false_position():
    calls = []
    found = bisect_lr(curve(calls), 1e-4, 0.855, BisectConfig(max_trials=7, tolerance=0.005, factor=2.0))
    # 1e-4 keeps the floor (0.9), 2e-4 breaks it (0.8); false position in log lr: 2^(0.045/0.1) = 1.366 -> 1.37e-4,
    # MU 0.9 − 0.1·log2(1.37) = 0.85458 < 0.855 breaks it; the next point, 99% of the way, is kept off the end at
    # 90%: 1e-4 · 1.37^0.9 = 1.328e-4 -> 1.33e-4, MU 0.85886, within 0.005 of the floor: done in four trials
    # then the probes past the crossing (1.37e-4 × 2 and × 4), beyond the budget: utility stays below the floor
    assert calls == [1e-4, 2e-4, 1.37e-4, 1.33e-4, 2.74e-4, 5.48e-4]
    assert found["chosen"]["lr"] == 1.33e-4 and found["chosen"]["meets_floor"] and found["converged"]
    assert found["chosen"]["model_utility"] == pytest.approx(0.858857, abs=1e-6)
    assert [t["lr"] for t in found["trials"]] == sorted(calls[:4])
    assert [t["lr"] for t in found["past_crossing"]] == [2.74e-4, 5.48e-4]
    assert recovers_at(found["trials"] + found["past_crossing"], 0.855) == []


# The trade-off a 5.3M Llama finetuned on real TOFU gave under NPO + KL (one seed): utility (its retain ES) falls
# below the floor at 1e-4 and is back above it at 2e-4 and 4e-4, where forget ES is lowest.
NON_MONOTONE = {5e-5: (0.918, 0.572), 1e-4: (0.442, 0.111), 2e-4: (0.851, 0.087), 4e-4: (0.958, 0.076)}


def non_monotone(lr: float) -> dict:
    """The table's points, log-linear between them (and flat beyond the ends)."""
    xs = sorted(NON_MONOTONE)
    x = min(max(lr, xs[0]), xs[-1])
    for a, b in zip(xs, xs[1:]):
        if a <= x <= b:
            w = math.log(x / a) / math.log(b / a)
            mu, fes = ((1 - w) * NON_MONOTONE[a][i] + w * NON_MONOTONE[b][i] for i in range(2))
            return {"lr": lr, "model_utility": mu, "forget_es": fes}


def test_a_utility_that_recovers_past_the_crossing_is_found_and_its_front_read_over_every_trial(tmp_path):
    """Floor 0.85: the bisection's first crossing lies between 5e-5 and 1e-4; the probes at its broken end × 2 and
    × 4 find utility back above the floor, and the front is the point of 4e-4, past the crossing."""
    cfg = BisectConfig(max_trials=4, tolerance=0.005, factor=2.0)
    found = bisect_lr(non_monotone, 5e-5, 0.85, cfg)
    # 5e-5 (0.918) keeps the floor, 1e-4 (0.442) breaks it; false position in log lr: 0.068/0.476 = 0.143 of the
    # way, 5e-5 · 2^0.143 = 5.52e-5, MU 0.85006: within 0.005 of the floor, converged in three trials. The probes
    # at the crossing × 2 and × 4, 2e-4 (0.851) and 4e-4 (0.958), both keep the floor: utility recovers
    assert [t["lr"] for t in found["trials"]] == [5e-5, 5.52e-5, 1e-4] and found["converged"]
    assert found["chosen"]["lr"] == 5.52e-5 and found["chosen"]["forget_es"] == pytest.approx(0.5062, abs=1e-4)
    assert [t["lr"] for t in found["past_crossing"]] == [2e-4, 4e-4]
    crossing = 1e-4
    everything = found["trials"] + found["past_crossing"]
    assert recovers_at(everything, 0.85) == [2e-4, 4e-4]  # the assumption fails here, and it is said
    best = front(everything, 0.85)
    assert best == {"lr": 4e-4, "model_utility": 0.958, "forget_es": pytest.approx(0.076)}  # 0.43 below the chosen
    # on the table's own rates (a grid): the front is 4e-4's point (0.076 at 0.958), the first crossing 5e-5's
    grid = [non_monotone(lr) for lr in NON_MONOTONE]
    assert front(grid, 0.85) == {"lr": 4e-4, "model_utility": 0.958, "forget_es": 0.076}
    assert recovers_at(grid, 0.85) == [2e-4, 4e-4] and choose(grid, 0.85)["lr"] == 4e-4
    assert front(grid, 0.99) is None and recovers_at(grid, 0.99) == []

    # a tuning records them, and its table says so
    def unlearn_one(name, ucfg, train, work):
        (work / "model").mkdir(parents=True)
        (work / "model" / "lr").write_text(repr(train.lr))

    def evaluate_one(model_dir, eval_dir):
        return non_monotone(float((model_dir / "lr").read_text()))

    tune_cfg = TuneConfig(utility_floor=0.85, search="bisect", bisect={"max_trials": 4})
    result = tune_group("npo", {"npo": (None, TrainConfig(lr=5e-5))}, tune_cfg, unlearn_one, evaluate_one, 1.0, tmp_path)
    entry = result["runs"]["npo"]
    assert entry["front"]["lr"] > crossing and entry["recovers_at"] and entry["lr_span"] >= 4
    assert result["bisect"]["probe_past"] == [2.0, 4.0]
    assert "(utility recovers)" in choice_table(result)
    assert json.loads((tmp_path / "choice.json").read_text())["runs"]["npo"]["front"] == entry["front"]


# A hand-made trade-off, looked up at exact rates: utility falls with the rate, forget ES does not (lowest at 1e-5).
BELOW = {1e-5: (0.90, 0.30), 2e-5: (0.88, 0.50), 4e-5: (0.86, 0.45), 8e-5: (0.80, 0.20), 1.6e-4: (0.70, 0.10),
         3.2e-4: (0.60, 0.05), 6.4e-4: (0.50, 0.04)}


def test_probes_below_the_crossing_widen_the_front_to_the_grid_asked_for(tmp_path):
    """probe_past [2, 4, 8] and probe_below [0.5, 0.25]: from 4e-5 the bisection keeps 4e-5 (0.86 ≥ 0.85) and
    breaks at 8e-5 in its 2 trials; the probes try 1.6e-4, 3.2e-4, 6.4e-4 above and 2e-5, 1e-5 below, a span of
    6.4e-4 / 1e-5 = 64, and the front is 1e-5's point (forget ES 0.30, against 0.45 at the crossing)."""
    calls = []

    def trial_at(lr):
        calls.append(lr)
        mu, fes = BELOW[lr]
        return {"lr": lr, "model_utility": mu, "forget_es": fes}

    cfg = BisectConfig(max_trials=2, factor=2.0, probe_past=[2.0, 4.0, 8.0], probe_below=[0.5, 0.25])
    found = bisect_lr(trial_at, 4e-5, 0.85, cfg)
    assert found["chosen"]["lr"] == 4e-5 and [t["lr"] for t in found["past_crossing"]] == [1.6e-4, 3.2e-4, 6.4e-4]
    assert [t["lr"] for t in found["below_crossing"]] == [1e-5, 2e-5]
    everything = found["trials"] + found["past_crossing"] + found["below_crossing"]
    assert front(everything, 0.85)["lr"] == 1e-5 and recovers_at(everything, 0.85) == []
    # where the bisection already went that low, nothing is tried again: from 1e-5 up, 4e-5 kept, 8e-5 broken
    calls.clear()
    found = bisect_lr(trial_at, 1e-5, 0.85, replace(cfg, max_trials=4))
    assert calls == [1e-5, 2e-5, 4e-5, 8e-5, 1.6e-4, 3.2e-4, 6.4e-4] and found["below_crossing"] == []
    # a tuning records them, reads its front and span over them, and the report's curve has them
    def unlearn_one(name, ucfg, train, work):
        (work / "model").mkdir(parents=True)
        (work / "model" / "lr").write_text(repr(train.lr))

    tune_cfg = TuneConfig(utility_floor=0.85, search="bisect",
                          bisect={"max_trials": 2, "probe_past": [2, 4, 8], "probe_below": [0.5, 0.25]})
    result = tune_group("npo", {"npo": (None, TrainConfig(lr=4e-5))}, tune_cfg, unlearn_one,
                        lambda model, _: trial_at(float((model / "lr").read_text())), 1.0, tmp_path)
    entry = result["runs"]["npo"]
    assert entry["front"]["lr"] == 1e-5 and entry["lr_span"] == 64.0 and result["bisect"]["probe_below"] == [0.5, 0.25]
    from pipeline.studies.tradeoff import read_curve
    assert read_curve(tmp_path / "choice.json", "npo", 0).front["lr"] == 1e-5
    # and without probe_below, the choice.json is as before: no below_crossing key
    assert "below_crossing" not in bisect_lr(trial_at, 4e-5, 0.85, replace(cfg, probe_below=[]))
    with pytest.raises(ParamError, match=r"tune.bisect.probe_below=\[2\]: must be a list of factors between 0 and 1"):
        BisectConfig.from_params({"probe_below": [2]})


def test_bisection_steps_down_when_the_start_breaks_the_floor_and_keeps_to_its_budget():
    calls = []
    found = bisect_lr(curve(calls), 8e-4, 0.855, BisectConfig(max_trials=3, tolerance=1e-9, factor=2.0))
    # 8e-4 (0.6), 4e-4 (0.7), 2e-4 (0.8): never kept within three trials; the highest utility is chosen
    assert calls == [8e-4, 4e-4, 2e-4]
    assert found["chosen"]["lr"] == 2e-4 and not found["chosen"]["meets_floor"] and not found["converged"]


def test_bisection_that_never_breaks_the_floor_keeps_the_highest_rate_tried():
    found = bisect_lr(lambda lr: {"lr": lr, "model_utility": 0.9, "forget_es": 0.3}, 1e-4, 0.855,
                      BisectConfig(max_trials=3))
    assert [t["lr"] for t in found["trials"]] == [1e-4, 2e-4, 4e-4]
    assert found["chosen"]["lr"] == 4e-4 and found["chosen"]["meets_floor"] and not found["converged"]


def test_a_bisection_whose_utility_never_falls_stops_at_the_rates_edge_not_converged():
    # utility never falls: 0.3 -> 0.6 -> (1.2 is outside (0, 1)) stop; nothing past the edge is tried, even as a probe
    calls = []

    def flat(lr):
        calls.append(lr)
        return {"lr": lr, "model_utility": 0.9, "forget_es": 0.3}

    found = bisect_lr(flat, 0.3, 0.855, BisectConfig(max_trials=7), LEARNING_RATE)
    assert calls == [0.3, 0.6]
    assert found["chosen"]["lr"] == 0.6 and found["chosen"]["meets_floor"] and not found["converged"]
    assert "outside the allowed rates (in (0, 1))" in found["stopped"]
    # a crossing just below the edge: its probes (x2, x4) would leave (0, 1), so none is tried
    calls.clear()
    found = bisect_lr(lambda lr: flat(lr) | {"model_utility": 0.9 if lr < 0.5 else 0.8}, 0.3, 0.855,
                      BisectConfig(max_trials=3), LEARNING_RATE)
    assert max(calls) == 0.6 and found["past_crossing"] == [] and "stopped" not in found


def test_a_rate_read_from_a_choice_file_is_checked_as_the_param_it_stands_for(tmp_path):
    def choice(run: dict) -> Path:
        file = tmp_path / "choice.json"
        file.write_text(json.dumps({"runs": {"npo": run}}))
        return file

    good = {"chosen": {"lr": 2e-4, "model_utility": 0.86, "meets_floor": True}, "converged": True}
    assert chosen_lr(choice(good), "npo") == 2e-4
    for lr in (2.4, -1e-4, 0, "fast", None, float("nan")):
        with pytest.raises(DataError, match=r"runs\.npo\.chosen\.lr=.*must be in \(0, 1\) \(as unlearn\.train\.lr\)"):
            chosen_lr(choice({"chosen": {"lr": lr, "meets_floor": True}}), "npo")
    with pytest.raises(DataError, match="no rate the tuning tried keeps the utility floor"):
        chosen_lr(choice({"chosen": {"lr": 2e-4, "model_utility": 0.5, "meets_floor": False}}), "npo")
    (tmp_path / "bad.json").write_text("lr: 2e-4\n")
    with pytest.raises(DataError, match=r"bad\.json: the tuning choice is not JSON \(.* at line 1, column 1\)"):
        chosen_lr(tmp_path / "bad.json", "npo")


def test_a_diverged_trial_breaks_the_floor_and_the_bracket_is_halved_below_it():
    calls = []
    smooth = curve(calls)

    def trial_at(lr):  # training diverges from 2e-4 up
        return {"lr": lr, "diverged": "step 9: non-finite loss"} if lr >= 2e-4 else smooth(lr)

    found = bisect_lr(trial_at, 1e-4, 0.855, BisectConfig(max_trials=7, tolerance=0.005, factor=2.0))
    # 1e-4 keeps the floor (0.9); 2e-4 diverges, so it breaks it with no utility: the next point halves the bracket
    # in log lr, √2 · 1e-4 -> 1.41e-4, MU 0.9 − 0.1·log2(1.41) = 0.85043, below; false position between 1e-4 (0.9)
    # and 1.41e-4 lands 91% of the way, kept at 90%: 1e-4 · 1.41^0.9 = 1.362e-4 -> 1.36e-4, MU 0.85564, kept and
    # within 0.005 of the floor
    assert calls == [1e-4, 1.41e-4, 1.36e-4]
    assert found["diverged"] == [2e-4] and [t["lr"] for t in found["trials"]] == [1e-4, 1.36e-4, 1.41e-4]
    assert found["chosen"]["lr"] == 1.36e-4 and found["converged"]
    assert found["chosen"]["model_utility"] == pytest.approx(0.9 - 0.1 * math.log2(1.36), abs=1e-12)
    # the budget counts diverged trials: with two, 1e-4 and 2e-4, the bracket is never narrowed
    assert bisect_lr(trial_at, 1e-4, 0.855, BisectConfig(max_trials=2))["chosen"]["lr"] == 1e-4


def test_a_tuning_keeps_a_diverged_trial_resumes_it_and_fails_only_when_all_diverge(tmp_path):
    class Diverged(Exception):
        pass

    cfg = TuneConfig(lrs=[1e-4, 2e-4, 4e-4, 8e-4], utility_floor=0.95)
    evaluated = []

    def unlearn_one(name, ucfg, train, work):
        if train.lr >= 4e-4:
            raise Diverged(f"unlearn {name}: step 3: non-finite loss\nmore")
        (work / "model").mkdir(parents=True)

    def evaluate_one(model_dir, eval_dir):
        lr = float(model_dir.parent.name[2:])
        evaluated.append(lr)
        return {"forget_es": 0.5, "model_utility": 0.9 - 0.1 * math.log2(lr / 1e-4)}

    runs = {"ga": (None, TrainConfig(lr=1e-4))}
    result = tune_group("ga", runs, cfg, unlearn_one, evaluate_one, 0.9, tmp_path, diverges=(Diverged,))
    entry = result["runs"]["ga"]
    assert entry["diverged"] == [4e-4, 8e-4] and [t["lr"] for t in entry["trials"]] == [1e-4, 2e-4]
    assert entry["chosen"]["lr"] == 1e-4  # 2e-4 (MU 0.8) is below 0.855
    assert evaluated == [1e-4, 2e-4]  # a diverged trial has no model to evaluate
    assert json.loads((tmp_path / "trials" / "ga" / "lr4.00e-04.json").read_text()) == {
        "lr": 4e-4, "diverged": "unlearn ga: step 3: non-finite loss"}
    assert "| ga | **0.500 / 0.900** | 0.500 / 0.800 | diverged | diverged | 1.0e-04 |" in choice_table(result)

    def never(*args):
        raise AssertionError("a finished trial was run again")

    assert tune_group("ga", runs, cfg, never, never, 0.9, tmp_path, diverges=(Diverged,)) == result
    # without `diverges` the error is the stage's, as before
    with pytest.raises(Diverged):
        tune_group("ga", runs, cfg, unlearn_one, evaluate_one, 0.9, tmp_path / "strict")

    cfg_high = TuneConfig(lrs=[4e-4, 8e-4], utility_floor=0.95)
    with pytest.raises(ParamError, match=r"unlearn.runs.ga: every tuning trial diverged \(lr 4.00e-04, 8.00e-04"):
        tune_group("ga", runs, cfg_high, unlearn_one, evaluate_one, 0.9, tmp_path / "high", diverges=(Diverged,))


def test_bisect_config_errors_name_the_key():
    with pytest.raises(ParamError, match="tune.bisect.max_trials"):
        TuneConfig.from_params({"search": "bisect", "bisect": {"max_trials": 1}})
    with pytest.raises(ParamError, match="tune.bisect.factor"):
        BisectConfig.from_params({"factor": 1.0})
    with pytest.raises(ParamError, match="tune.search"):
        TuneConfig.from_params({"search": "random"})


def test_a_bisecting_tuning_resumes_from_its_trials_and_unlearn_reads_its_choice(tmp_path):
    cfg = TuneConfig(utility_floor=0.95, search="bisect", bisect={"max_trials": 7, "tolerance": 0.005})
    calls = []
    trial_at = curve(calls)
    for lr in (1e-4, 2e-4, 1.37e-4, 1.33e-4, 2.74e-4, 5.48e-4):  # the bisection's, then the probes past it
        path = tmp_path / "trials" / "t_ga" / f"lr{lr:.2e}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(trial_at(lr)))

    def never(*args):
        raise AssertionError("a finished trial was run again")

    class Train:
        lr = 1e-4

    result = tune_group("t_ga", {"t_ga": (None, Train())}, cfg, never, never, 0.9, tmp_path)
    entry = result["runs"]["t_ga"]
    assert entry["chosen"]["lr"] == 1.33e-4 and entry["converged"] and entry["start_lr"] == 1e-4
    assert entry["recovers_at"] == [] and entry["front"] == {k: v for k, v in entry["chosen"].items()
                                                             if k != "meets_floor"}
    assert result["bisect"]["max_trials"] == 7 and result["lrs"] is None
    assert "**1.33e-04: 0.429 / 0.859**" in choice_table(result)
    assert chosen_lr(tmp_path / "choice.json", "t_ga") == 1.33e-4
    with pytest.raises(DataError, match="no tuning of run 'ga' in it"):
        chosen_lr(tmp_path / "choice.json", "ga")
    with pytest.raises(DataError, match="missing.json"):
        chosen_lr(tmp_path / "missing.json", "ga")


def test_the_floor_can_be_held_on_the_users_utility_not_tofus(tmp_path):
    # tune.utility: retain_es. The trials' model utility (absent on a user's own data) plays no part: with the
    # floor 0.95 × 0.8 = 0.76 on retain ES, 2e-4 keeps it (0.78) and 4e-4 does not (0.70)
    evaluations = {1e-4: {"forget_es": 0.8, "retain_es": 0.80}, 2e-4: {"forget_es": 0.5, "retain_es": 0.78},
                   4e-4: {"forget_es": 0.2, "retain_es": 0.70}}
    cfg = TuneConfig(lrs=sorted(evaluations), groups={"npo": ["npo"]}, utility="retain_es")
    seen = []

    def unlearn_one(name, ucfg, train, work):
        seen.append(train.lr)
        work.mkdir(parents=True)

    def evaluate_one(model_dir, eval_dir):
        return evaluations[seen[-1]]

    result = tune_group("npo", {"npo": (None, TrainConfig(lr=1e-4))}, cfg, unlearn_one, evaluate_one, 0.8, tmp_path)
    assert result["utility"] == "retain_es" and result["target_utility"] == 0.8
    assert "target_model_utility" not in result  # it would name what it is not
    assert result["runs"]["npo"]["chosen"] == {"lr": 2e-4, "forget_es": 0.5, "retain_es": 0.78, "meets_floor": True}
    # 0.5 + (0.02 / 0.08) * (0.2 - 0.5) = 0.425 where retain ES falls to 0.76
    assert result["runs"]["npo"]["forget_es_at_floor"] == pytest.approx(0.425)
    assert "cells: forget ES / retain_es" in choice_table(result)
    assert chosen_lr(tmp_path / "choice.json", "npo") == 2e-4  # unlearn --lr-from reads it as any other
    plot_tradeoff(result, tmp_path / "tradeoff.png")


@pytest.mark.parametrize("utility", ["forget_es", "privleak", "retain es", "lmeval_arc_easy_acc_stderr"])
def test_a_utility_that_is_no_higher_is_better_share_is_refused(utility):
    with pytest.raises(ParamError, match=r"tune.utility: .* is not a utility: one of model_utility, retain_es"):
        TuneConfig.from_params({"utility": utility})


def test_an_lm_eval_accuracy_is_a_utility():
    assert TuneConfig.from_params({"utility": "lmeval_arc_easy_acc_norm"}).utility == "lmeval_arc_easy_acc_norm"
