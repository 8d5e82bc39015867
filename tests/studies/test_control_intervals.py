"""experiments/controls/intervals.py: each comparison's difference per model seed, its mean and t-interval over
model seeds, on a hand-computed case; model seeds that lack a run are left out, not read as zero."""

import importlib.util
import json

from tests.conftest import REPO


def _module():
    spec = importlib.util.spec_from_file_location("intervals", REPO / "experiments" / "controls" / "intervals.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _summary(root, seed, run, forget_es, leak):
    path = root / f"m{seed}" / "metrics" / "eval" / f"{run}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"forget_es": forget_es, "leak_at_20": leak, "seeds": [0]}))


def test_the_interval_over_model_seeds_by_hand(tmp_path):
    intervals = _module()
    # differences −0.1, −0.2, −0.3: mean −0.2, sd 0.1, half width t(0.975, 2) 4.303 × 0.1 / √3 = 0.2484
    for seed, (base, variant) in enumerate([(0.5, 0.4), (0.6, 0.4), (0.7, 0.4)]):
        _summary(tmp_path, seed, "npo", base, 0.5)
        _summary(tmp_path, seed, "s_npo_random", variant, 0.5 + 0.1 * seed)
    _summary(tmp_path, 3, "npo", 0.9, 0.9)  # model seed 3 lacks the variant: not a pair
    table = intervals.table(tmp_path, [0, 1, 2, 3], [("s_npo_random", "npo")], ["forget ES", "leak@20"])
    row = table.splitlines()[2]
    assert row == "| s_npo_random − npo | -0.200 [-0.448, +0.048] 3/3 | +0.100 [-0.148, +0.348] 0/3 |"
