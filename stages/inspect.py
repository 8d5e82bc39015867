"""`tokenunlearn inspect`: look at the token scores of an attribution directory."""

import itertools
import logging
import sys

import click

from pipeline.attribution.inspect import find_sample, render_html, render_terminal, token_table
from pipeline.attribution.shards import iter_rows
from pipeline.attribution.variants import parse_score
from pipeline.common.atomic import atomic_file

log = logging.getLogger(__name__)


@click.command("inspect")
@click.argument("shard_dir", default="artifacts/attribution", type=click.Path(exists=True, file_okay=False))
@click.option("--sample", "sample_id", type=int, default=0, show_default=True, help="The sample id to print.")
@click.option("--r", "r", type=click.FloatRange(0, 1, min_open=True), default=0.2, show_default=True,
              help="Hard weighting: the top-r fraction of φ.")
@click.option("--tau", type=click.FloatRange(0, min_open=True), default=0.5, show_default=True,
              help="Soft weighting: softmax(φ / τ).")
@click.option("--alpha", type=click.FloatRange(0, 1), default=0.7, show_default=True,
              help="φ = α·minmax(Δ) + (1−α)·minmax(H).")
@click.option("--variant", "variants", multiple=True, metavar="SCORE",
              help="An attribution variant shown beside φ (e.g. learned+span, phi+nocopy+span); repeatable.")
@click.option("--html", "html_file", type=click.Path(dir_okay=False), default=None,
              help="Write a heatmap page of many samples to this file instead.")
@click.option("--limit", type=int, default=100, show_default=True, help="Samples in the heatmap page.")
@click.option("--color/--no-color", default=None, help="Colour the terminal table [when stdout is a terminal].")
def command(shard_dir, sample_id, r, tau, alpha, variants, html_file, limit, color) -> None:
    """Print a sample's tokens with Δ, H, φ and the hard and soft weights they give (and any variant beside)."""
    for name in variants:
        parse_score(name, "--variant")
    if html_file:
        rows = sorted(itertools.islice(iter_rows(shard_dir), limit), key=lambda row: row["sample_id"])
        with atomic_file(html_file) as f:
            f.write(render_html(rows, alpha, r, tau, list(variants)))
        log.info("wrote %s (%d samples)", html_file, len(rows))
        return
    row = find_sample(shard_dir, sample_id)
    use_color = sys.stdout.isatty() if color is None else color
    click.echo(render_terminal(row, token_table(row, alpha, r, tau, list(variants)), use_color, list(variants)))
