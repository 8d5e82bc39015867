"""`tokenunlearn diagnose`: where unlearning moved probability mass on the forget answers, per token class, for
uniform and token-weighted runs side by side (pipeline/studies/mass_shift.py)."""

import logging
from pathlib import Path

import click
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from pipeline.common.atomic import atomic_dir, hold_outputs
from pipeline.common.modeling import load_model
from pipeline.common.names import NAME as NAME_PATTERN, NAME_RULE
from pipeline.evaluation.eval_io import write_strict_json
from pipeline.studies.mass_shift import (answer_logp, check_target, load_forget_samples, load_run_weights,
                                            run_seeds, summarize, summary_markdown, token_records)

from .options import shards_option

log = logging.getLogger(__name__)


def parse_runs(values: tuple[str, ...]) -> dict[str, Path]:
    runs = {}
    for value in values:
        name, sep, directory = value.partition("=")
        if not sep or not name or not directory or name in runs:
            raise click.BadParameter(f"{value!r}: expected NAME=DIR, each NAME once", param_hint="--run")
        if not NAME_PATTERN.fullmatch(name):
            raise click.BadParameter(f"{value!r}: NAME must be {NAME_RULE}", param_hint="--run")
        runs[name] = Path(directory)
    return runs


@click.command("diagnose")
@click.option("--target", required=True, type=click.Path(exists=True, file_okay=False),
              help="The model before unlearning (the one `attribute` scored), e.g. artifacts/models/target.")
@shards_option
@click.option("--run", "runs", multiple=True, required=True, metavar="NAME=DIR",
              help="An unlearn output (seed*/model, seed*/token_weights.parquet; every seed is used), e.g. "
                   "npo=artifacts/unlearn/npo; repeatable.")
@click.option("--out", default="artifacts/diagnose", show_default=True, type=click.Path(file_okay=False),
              help="tokens.parquet (a record per forget answer token, run and seed), summary.json, summary.md.")
@click.option("--batch-size", type=click.IntRange(1), default=8, show_default=True, help="Samples per forward pass.")
def command(target, shards, runs, out, batch_size) -> None:
    """Compare each run's log p of the forget answers with the target's, token by token: mean Δlogp on fact and
    other tokens, on the tokens the run selected (ω) and the rest (the spill), each group's share of the drop,
    and how often the target's greedy token stops being first."""
    runs = parse_runs(runs)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    samples = load_forget_samples(shards)
    model = load_model(target)
    check_target(model, target, shards)
    target_view = answer_logp(model.to(device), samples, batch_size)
    del model
    records, summaries = [], {}
    for name, run_dir in runs.items():
        run_records, weightings = [], set()
        for seed, seed_dir in run_seeds(run_dir):
            weighting, weights = load_run_weights(seed_dir / "token_weights.parquet", samples)
            weightings.add(weighting)
            view = answer_logp(load_model(seed_dir / "model").to(device), samples, batch_size)
            for sample, before, after in zip(samples, target_view, view):
                run_records += [{"run": name, "seed": seed, **r}
                                for r in token_records(sample, weighting, weights[sample.sample_id], before, after)]
            log.info("diagnose %s seed %d (%s): %d tokens", name, seed, weighting, len(run_records))
        if len(weightings) > 1:
            raise click.UsageError(f"{run_dir}: its seeds were trained with different weightings {sorted(weightings)}")
        summaries[name] = {"weighting": weightings.pop(), "seeds": sorted({r["seed"] for r in run_records}),
                           **summarize(run_records)}
        records += run_records
    out_dir = Path(out)
    with hold_outputs(out_dir), atomic_dir(out_dir) as tmp:
        pq.write_table(pa.Table.from_pylist(records), tmp / "tokens.parquet", compression="zstd")
        write_strict_json(tmp / "summary.json", summaries)
        (tmp / "summary.md").write_text(summary_markdown(summaries), encoding="utf-8")
    log.info("diagnose: %d token records of %d runs in %s (summary.md)", len(records), len(runs), out_dir)
