"""The cached KL retain term against the exact one, run by run: retain ES, forget ES and model utility (mean ± sample
std over the unlearning seeds) of the paper's sweep (the reference cache's top-k) and of experiments/exact_kl
(θ_o held beside the trained model), their difference, and `*` where it exceeds the two standard deviations added.

    python experiments/exact_kl/compare.py --params configs/paper.yaml --overlay configs/exact-kl.yaml \
        --cached artifacts/paper/metrics/eval --exact artifacts/exact_kl/metrics/eval \
        --out artifacts/exact_kl/comparison.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from pipeline.common.atomic import atomic_file  # noqa: E402
from pipeline.common.params import load_params, section  # noqa: E402

METRICS = {"retain_es": "retain ES", "forget_es": "forget ES", "model_utility": "MU"}


def cell(summary: dict, key: str) -> tuple[float, float]:
    return summary[key], summary.get(f"{key}_std", 0.0)


def table(cached_dir: Path, exact_dir: Path, runs: list[str]) -> str:
    head = "| run | " + " | ".join(f"{m}: cached | exact | Δ" for m in METRICS.values()) + " |"
    lines = [head, "|---|" + "---|---|---|" * len(METRICS)]
    for run in runs:
        cached = json.loads((cached_dir / f"{run}.json").read_text())
        exact = json.loads((exact_dir / f"{run}.json").read_text())
        cells = []
        for key in METRICS:
            (c, cs), (e, es) = cell(cached, key), cell(exact, key)
            mark = " *" if abs(c - e) > cs + es else ""
            cells.append(f"{c:.3f} ± {cs:.3f} | {e:.3f} ± {es:.3f} | {c - e:+.3f}{mark}")
        lines.append(f"| {run} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cached", type=Path, required=True, help="the paper's sweep's evaluation summaries")
    p.add_argument("--exact", type=Path, required=True, help="experiments/exact_kl's evaluation summaries")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--params", default="configs/paper.yaml")
    p.add_argument("--overlay", action="append", default=[], metavar="FILE",
                   help="an overlay file naming the runs compared (report.table), e.g. configs/exact-kl.yaml")
    args = p.parse_args()
    runs = section(load_params(args.params, args.overlay), "report.table")
    text = table(args.cached, args.exact, runs)
    with atomic_file(args.out) as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    from pipeline.common.cli_errors import run_script  # the CLI's error handling: one line, an exit status, -v for a traceback
    run_script(main)
