"""The table of experiments/lmeval: per model, each set's accuracy by lm-eval and by the project's scorer (mean
± standard deviation over the unlearning seeds), and item by item how far the two disagree (the largest difference
of a choice's log-likelihood, and the items whose predicted choice differs).

    cd experiments && python lmeval/compare.py --evals artifacts/lmeval/m0 --items artifacts/lmeval/items \
        --out artifacts/lmeval/report.md     # as its DVC stage runs it
"""

from __future__ import annotations

import json
import logging
import statistics
from pathlib import Path

import click
import pyarrow.parquet as pq

from pipeline.common.atomic import atomic_file
from pipeline.common.errors import DataError

log = logging.getLogger(__name__)

# (the project's MC set, lm-eval's task, its metric, cloze: the project's log-likelihoods are per character)
SETS = (("forget", "world_forget", "acc", False), ("world_facts", "world_facts", "acc", False),
        ("forget_cloze", "world_forget_cloze", "acc_norm", True))
MODELS = ("target", "retain", "npo", "t_npo_ens", "s_npo_ens", "ga", "t_ga_ens", "s_ga_ens")


def seed_dirs(model_dir: Path) -> list[Path]:
    """A run's evaluation holds seed{S}/ directories; a single model's is itself."""
    seeds = sorted(p for p in model_dir.glob("seed*") if p.is_dir())
    return seeds or [model_dir]


def agreement(eval_dir: Path, mc_set: str, task: str, choices: list[list[str]] | None) -> tuple[float, int, int]:
    """(largest |log-likelihood difference| of any choice, items whose predictions differ, items) on one model;
    `choices` (each item's) for a cloze set, whose log-likelihoods the project keeps per character."""
    ours = pq.read_table(eval_dir / "mc" / f"{mc_set}.parquet").to_pylist()
    path = eval_dir / "lm_eval" / f"samples_{task}.jsonl"
    if not path.exists():
        raise DataError(f"{path}: not found (evaluate with configs/lmeval.yaml's evaluate.lm_eval)")
    theirs = {r["doc_id"]: r for r in map(json.loads, path.open())}
    if len(theirs) != len(ours):
        raise DataError(f"{path}: {len(theirs)} items, the project's {mc_set} set has {len(ours)}")
    worst, differ = 0.0, 0
    for row in ours:
        lls = [ll for ll, _greedy in theirs[row["index"]]["filtered_resps"]]
        if choices is not None:  # the project's are per character (acc_norm's ranking): lm-eval's are summed
            chars = [len(c) for c in choices[row["index"]]]
            ours_ll = [lp * n for lp, n in zip(row["logprobs"], chars)]
            pred = max(range(len(lls)), key=lambda j: lls[j] / chars[j])
        else:
            ours_ll, pred = row["logprobs"], max(range(len(lls)), key=lls.__getitem__)
        worst = max(worst, max(abs(a - b) for a, b in zip(ours_ll, lls)))
        differ += pred != row["predicted"]
    return worst, differ, len(ours)


def mean_sd(values: list[float]) -> str:
    return f"{statistics.mean(values):.3f}" + (f" ± {statistics.stdev(values):.3f}" if len(values) > 1 else "")


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--evals", type=click.Path(exists=True, file_okay=False, path_type=Path), required=True,
              help="The evaluations' directory (one subdirectory per model: artifacts/lmeval/m0).")
@click.option("--items", type=click.Path(exists=True, file_okay=False, path_type=Path), required=True,
              help="The exported items (artifacts/lmeval/items): the cloze choices' lengths.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), required=True, help="The table (Markdown).")
def main(evals: Path, items: Path, out: Path) -> None:
    """Write the table: accuracy by lm-eval and by the project's scorer, and their item-by-item agreement."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    choices = {s: [json.loads(line)["choices"] for line in (items / f"{s}.jsonl").open()] for s, *_, cloze in SETS
               if cloze}
    head = ["model", "seeds", *(f"{s}: lm-eval \\| ours" for s, *_ in SETS), "max \\|Δ log-lik\\|",
            "predictions differ"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for model in MODELS:
        dirs = seed_dirs(evals / model)
        cells, worst, differ, items = [model, str(len(dirs))], 0.0, 0, 0
        summaries = [json.loads((d / "metrics.json").read_text()) for d in dirs]
        for mc_set, task, metric, cloze in SETS:
            theirs = [s[f"lmeval_{task}_{metric}"] for s in summaries]
            ours = [s[f"mc_{mc_set}"] for s in summaries]
            cells.append(f"{mean_sd(theirs)} \\| {mean_sd(ours)}")
            for d in dirs:
                w, n_diff, n = agreement(d, mc_set, task, choices.get(mc_set))
                worst, differ, items = max(worst, w), differ + n_diff, items + n
        lines.append("| " + " | ".join(cells + [f"{worst:.1e}", f"{differ} of {items}"]) + " |")
    with atomic_file(out) as handle:
        handle.write("\n".join(lines) + "\n")
    log.info("wrote %s", out)


if __name__ == "__main__":
    from pipeline.common.cli_errors import run_script  # the CLI's error handling: one line, an exit status, -v for a traceback
    run_script(main)
