"""`tokenunlearn inspect`: look at the token scores of an attribution directory, weighted as stage two weights them."""

import itertools
import logging
import sys

import click

from pipeline.attribution.inspect import (find_sample, iter_samples, render_html, render_terminal, token_table,
                                          weight_settings)
from pipeline.attribution.variants import parse_score
from pipeline.common.atomic import atomic_file
from pipeline.training.unlearn import run_spec

from .options import NAME, params_options

log = logging.getLogger(__name__)


@click.command("inspect")
@params_options
@click.argument("shard_dir", default="artifacts/attribution", type=click.Path(exists=True, file_okay=False))
@click.option("--sample", "sample_id", type=int, default=0, show_default=True, help="The sample id to print.")
@click.option("--run", "run_name", metavar="NAME", default=None, type=NAME,
              help="Show the weights run NAME of unlearn.runs trains with: its weighting, r, τ, α and score.")
@click.option("--r", "r", type=click.FloatRange(0, 1, min_open=True), default=None,
              help="Hard weighting: the top-r fraction of the score [unlearn.weightings.hard.r, or the run's].")
@click.option("--tau", type=click.FloatRange(0, min_open=True), default=None,
              help="Soft weighting: softmax(score / τ) [unlearn.weightings.soft.tau, or the run's].")
@click.option("--alpha", type=click.FloatRange(0, 1), default=None,
              help="φ = α·minmax(Δ) + (1−α)·minmax(H) [unlearn.weightings.hard.alpha, or the run's].")
@click.option("--variant", "variants", multiple=True, metavar="SCORE",
              help="An attribution variant shown beside φ (e.g. learned+span, phi+nocopy+span); repeatable.")
@click.option("--html", "html_file", type=click.Path(dir_okay=False), default=None,
              help="Write a heatmap page of many samples to this file instead.")
@click.option("--limit", type=int, default=100, show_default=True, help="Samples in the heatmap page.")
@click.option("--color/--no-color", default=None, help="Colour the terminal table [when stdout is a terminal].")
def command(params: dict, shard_dir, sample_id, run_name, r, tau, alpha, variants, html_file, limit, color) -> None:
    """Print a sample's tokens with Δ, H, φ and the hard and soft weights they give (and any variant beside).

    r, τ and α come from the params, as stage two reads them: unlearn.weightings.hard (r, α and the score
    weighted) and unlearn.weightings.soft (τ); with --run NAME, run NAME's own (`unlearn.runs.NAME` over its
    method, weighting and the defaults); --r, --tau and --alpha override either."""
    for name in variants:
        parse_score(name, "--variant")
    spec = run_spec(params, run_name) if run_name else None
    shown = weight_settings(params, run_name, spec, r=r, tau=tau, alpha=alpha)
    if html_file:
        rows = sorted(itertools.islice(iter_samples(shard_dir), limit), key=lambda row: row["sample_id"])
        with atomic_file(html_file) as f:
            f.write(render_html(rows, shown.alpha, shown.r, shown.tau, list(variants), shown.score, shown.title))
        log.info("wrote %s (%d samples; %s)", html_file, len(rows), shown.title)
        return
    row = find_sample(shard_dir, sample_id)
    table = token_table(row, shown.alpha, shown.r, shown.tau, list(variants), shown.score)
    use_color = sys.stdout.isatty() if color is None else color
    click.echo(render_terminal(row, table, use_color, list(variants), shown.score, shown.title))
