"""Learning-rate tuning: the selection rule on hand-made trials, and a rerun that finds every trial done."""

import json

import pytest

from pipeline.common.errors import ParamError
from pipeline.training.tuning import TuneConfig, choice_table, choose, forget_es_at_utility, plot_tradeoff, tune_group

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
    assert forget_es_at_utility(TRIALS, 0.685) == pytest.approx(0.225)
    # the first crossing in lr order: 1e-4 -> 2e-4 falls from 0.88 to 0.86
    assert forget_es_at_utility(TRIALS, 0.87) == pytest.approx(0.60)
    assert forget_es_at_utility(TRIALS, 0.95) is None and forget_es_at_utility(TRIALS, 0.1) is None


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
