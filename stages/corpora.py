"""Stage `muse-corpora`: the world's MUSE corpora as passage files (what finetuning, corpus-mode attribution and the
retain corpus read), and with --requests the forget set in disjoint unlearning requests."""

import logging
from pathlib import Path

import click

from pipeline.common.atomic import hold_outputs
from pipeline.data.muse_requests import write_muse_corpora

log = logging.getLogger(__name__)


@click.command("muse-corpora")
@click.option("--world", "world_dir", default="artifacts/world", show_default=True,
              type=click.Path(exists=True, file_okay=False), help="A world written by `make-world`.")
@click.option("--forget-split", default="forget10", show_default=True,
              help="Whose biographies are MUSE's forget corpus.")
@click.option("--requests", default=0, show_default=True, type=int,
              help="Split the forget authors into this many requests (request{k}.json, first{k}.json); 0: none.")
@click.option("--seed", default=0, show_default=True, type=int, help="The seed of the split into requests.")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Output directory.")
def command(world_dir, forget_split, requests, seed, out) -> None:
    """Write MUSE's corpora of the world (forget, retain1, retain2, holdout) as JSON Lines passage files, as
    `world-muse` partitions them, and with --requests the forget set in disjoint requests."""
    with hold_outputs(out):
        manifest = write_muse_corpora(Path(world_dir), Path(out), forget_split, requests, seed)
    log.info("wrote %s: %s; %d request(s)", out, ", ".join(f"{p} {len(a)}" for p, a in manifest["authors"].items()),
             len(manifest["requests"]))
