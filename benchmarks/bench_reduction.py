"""`reduction: sample` against `reduction: token` on the embedded world, at the same learning rate.

open-unlearning pools a batch's forget tokens (`token`); TokenUnlearn's default pools each sample first (`sample`,
the paper's Σ ω ℓ / Σ ω per sample). For GA, GradDiff and T-GA [entropy+nocopy+span] (model seed 0 of the seeds
experiment, configs/paper.yaml + configs/seeds.yaml, each run's learning rate as bisected there for `sample`),
this unlearns with each reduction for every unlearning seed, evaluates, and prints forget ES, retain ES and model
utility (mean ± std over the seeds) with the token − sample difference:

    cd experiments   # where the seeds experiment's outputs are (experiments/artifacts/seeds/)
    python ../benchmarks/bench_reduction.py                    # about 15 minutes on 2 cores
    python ../benchmarks/bench_reduction.py --runs ga --seeds 0

It needs the seeds experiment's model seed 0 (`cd experiments && tokenunlearn sweep seeds/dvc.yaml '*@0-ga'` or
`make seeds`). Outputs: --out (artifacts/reduction/), one directory per run and reduction, and table.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
from pathlib import Path

log = logging.getLogger("bench_reduction")

ROOT = Path("artifacts/seeds/m0")  # run in experiments/, where the seeds experiment's outputs and paths are
PARAMS = ["--params", "../configs/paper.yaml", "--overlay", "../configs/seeds.yaml"]
# run -> (its spec, where its `sample` lr was bisected; None: the spec's own lr)
RUNS = {
    "ga": ({"method": "ga", "weighting": "uniform"}, "ga"),
    "graddiff": ({"method": "graddiff", "weighting": "uniform", "train": {"lr": 2.0e-4}}, None),
    "t_ga_ens": ({"method": "ga", "weighting": "hard", "score": "entropy+nocopy+span"}, "t_ga_ens"),
}
METRICS = ("forget_es", "retain_es", "model_utility")


def tuned_lr(run: str) -> float:
    choice = ROOT / "tuning" / run / "choice.json"
    try:
        return json.loads(choice.read_text())["runs"][run]["chosen"]["lr"]
    except (OSError, KeyError, ValueError) as e:
        raise SystemExit(f"{choice}: no bisected lr for {run} ({e}); run the seeds experiment's tune@0-{run} first")


def one(run: str, reduction: str, seeds: list[int], out: Path) -> dict:
    """Unlearn and evaluate RUN with REDUCTION into out/RUN-REDUCTION; its evaluation's metrics."""
    spec, tuned = RUNS[run]
    spec = {**spec, "reduction": reduction}
    if tuned:
        spec["train"] = {"lr": tuned_lr(tuned)}
    name, where = f"{run}_{reduction}", out / f"{run}-{reduction}"
    sets = ["-S", f"unlearn.model={ROOT}/models/target", "-S", f"unlearn.runs.{name}={json.dumps(spec)}",
            "-S", f"unlearn.seeds={json.dumps(seeds)}"]
    metrics = where / "metrics.json"
    if not metrics.is_file():
        subprocess.run(["tokenunlearn", "unlearn", name, *PARAMS, *sets, "--shards", str(ROOT / "attribution"),
                        "--reference", str(ROOT / "reference"), "--out", str(where / "model"),
                        "--plots", str(where / "plots"), "--checkpoints", str(where / "checkpoints")], check=True)
        subprocess.run(["tokenunlearn", "evaluate", name, *PARAMS, *sets, "--model", str(where / "model"),
                        "--out", str(where / "eval"), "--metrics", str(metrics),
                        "--retain-results", str(ROOT / "eval" / "retain")], check=True)
    return json.loads(metrics.read_text())


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--out", type=Path, default=Path("artifacts/reduction"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    rows = ["| run | reduction | " + " | ".join(METRICS) + " |", "|---|---|" + "---|" * len(METRICS)]
    for run in args.runs:
        got = {red: one(run, red, args.seeds, args.out) for red in ("sample", "token")}
        for red, metrics in got.items():
            cells = [f"{metrics[k]:.3f} ± {metrics.get(k + '_std', 0.0):.3f}" for k in METRICS]
            rows.append(f"| {run} | {red} | " + " | ".join(cells) + " |")
        diffs = [f"{got['token'][k] - got['sample'][k]:+.3f}" for k in METRICS]
        rows.append(f"| {run} | token − sample | " + " | ".join(diffs) + " |")
    table = "\n".join(rows)
    (args.out / "table.md").write_text(table + "\n")
    log.info("seeds %s, each run at its sample lr:\n%s", args.seeds, table)
    return 0


if __name__ == "__main__":
    from pipeline.common.cli_errors import run_script  # as the CLI: one line per error, an exit status
    run_script(lambda: main(sys.argv[1:]))
