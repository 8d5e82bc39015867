"""The controls' comparisons under every forgetting metric and attack, with a t-interval over model seeds.

`report-seeds` pairs each run with its method's uniform run by a two-level bootstrap, on forget and retain ES, MU,
forget quality and multiple choice. The attacks of configs/controls-depth.yaml and the relearning stage give more
columns (paraphrased questions, 8- and 4-bit quantization, leak@k, relearning); this table reads them all, one row
per comparison VARIANT-BASE: each model seed's mean over its unlearning seeds, the mean difference over the model
seeds, its 95% t-interval (n − 1 degrees of freedom) and how many model seeds fall below 0.

    cd experiments
    python controls/intervals.py s_ga_random-ga s_ga_learned-ga s_ga_learned-s_ga_random --seeds 0 1 2 3 4
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from scipy.stats import t  # noqa: E402

from pipeline.common.errors import DataError, ParamError  # noqa: E402
from pipeline.evaluation.eval_io import read_json  # noqa: E402

# column: (file under m{SEED}/metrics, key); lower is more forgotten but for the truth ratio (closer to 1: the
# perturbed answers as likely as the right one), retain ES and MU
COLUMNS = {"forget ES": ("eval", "forget_es"), "paraphrased forget ES": ("eval", "forget_para_es"),
           "8-bit forget ES": ("eval", "q8_forget_es"), "4-bit forget ES": ("eval", "q4_forget_es"),
           "leak@1": ("eval", "leak_at_1"), "leak@5": ("eval", "leak_at_5"), "leak@20": ("eval", "leak_at_20"),
           "forget MC": ("eval", "mc_world_forget"), "forget truth ratio (↑)": ("seeds", "truth_ratio"),
           "forget probability": ("seeds", "probability"),
           "relearned on a forget slice": ("relearn", "forget_forget_es"),
           "relearned on retain data": ("relearn", "retain_forget_es"),
           "retain ES (↑)": ("eval", "retain_es"), "MU (↑)": ("eval", "model_utility")}


def value(root: Path, seed: int, run: str, column: str) -> float | None:
    """The run's mean over its unlearning seeds on model seed `seed`; None where that model seed lacks the file."""
    kind, key = COLUMNS[column]
    if kind == "seeds":  # a forget-set aggregate of each unlearning seed's own summary
        summary = root / f"m{seed}" / "metrics" / "eval" / f"{run}.json"
        if not summary.is_file():
            return None
        seeds = read_json(summary, "evaluation summary").get("seeds") or []
        values = []
        for s in seeds:
            file = root / f"m{seed}" / "eval" / run / f"seed{s}" / "metrics.json"
            forget = read_json(file, "evaluation summary").get("forget") or {}
            if key not in forget:
                raise DataError(f"{file}: no forget.{key} in it; evaluate on TOFU's perturbed forget set")
            values.append(forget[key])
        return statistics.mean(values) if values else None
    file = root / f"m{seed}" / "metrics" / kind / f"{run}.json"
    if not file.is_file():
        return None
    data = read_json(file, f"{kind} summary")
    if key not in data:
        raise DataError(f"{file}: no {key} in it; evaluate with configs/controls-depth.yaml's attacks")
    return float(data[key])


def interval(diffs: list[float]) -> str:
    if not diffs:
        return "–"
    mean = statistics.mean(diffs)
    if len(diffs) == 1:
        return f"{mean:+.3f} (1 seed)"
    half = float(t.ppf(0.975, len(diffs) - 1)) * statistics.stdev(diffs) / math.sqrt(len(diffs))
    below = sum(d < 0 for d in diffs)
    return f"{mean:+.3f} [{mean - half:+.3f}, {mean + half:+.3f}] {below}/{len(diffs)}"


def table(root: Path, seeds: list[int], pairs: list[tuple[str, str]], columns: list[str]) -> str:
    lines = ["| comparison | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for variant, base in pairs:
        cells = []
        for column in columns:
            values = [(value(root, s, variant, column), value(root, s, base, column)) for s in seeds]
            cells.append(interval([v - b for v, b in values if v is not None and b is not None]))
        lines.append(f"| {variant} − {base} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pairs", nargs="+", metavar="VARIANT-BASE", help="e.g. s_npo_random-npo")
    parser.add_argument("--root", type=Path, default=Path("artifacts/controls"), help="m{SEED}/ of make controls")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="model seeds")
    parser.add_argument("--columns", nargs="+", choices=list(COLUMNS), default=list(COLUMNS), metavar="COLUMN",
                        help=f"of {list(COLUMNS)}")
    args = parser.parse_args()
    pairs = []
    for pair in args.pairs:
        if pair.count("-") != 1 or not all(pair.split("-")):
            raise ParamError(f"{pair!r}: a comparison is VARIANT-BASE, two run names, e.g. s_npo_random-npo")
        pairs.append(tuple(pair.split("-")))
    if not args.root.is_dir():
        raise DataError(f"{args.root}: no such directory; run make controls (or give --root)")
    sys.stdout.write(table(args.root, args.seeds, pairs, args.columns))


if __name__ == "__main__":
    from pipeline.common.cli_errors import run_script  # the CLI's error handling: one line, an exit status
    run_script(main)
