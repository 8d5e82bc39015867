"""Stage `world`: generate the embedded fictitious world (TOFU's splits, ground-truth spans, biographies)."""

import logging
from pathlib import Path

import click

from pipeline.common.atomic import hold_outputs
from pipeline.common.params import dataclass_from_params, section
from pipeline.data.world import WorldConfig, WorldSpec, generate_world, write_world

from .options import params_options

log = logging.getLogger(__name__)


@click.command("make-world")
@params_options
@click.option("--lexicon", default="data/world", show_default=True, type=click.Path(file_okay=False),
              help="Directory with lexicon.json and templates.json.")
@click.option("--templates", default=None, type=click.Path(dir_okay=False),
              help="Another templates file instead of the lexicon directory's (e.g. data/world_heldout/templates.json: "
                   "the held-out world's phrasings).")
@click.option("--out", default="artifacts/world", show_default=True, type=click.Path(file_okay=False),
              help="Output directory: one <split>.json per TOFU split, plus annotations, authors, biographies.")
def command(params: dict, lexicon: str, templates: str | None, out: str) -> None:
    """Generate the fictitious world from a seed (params: world)."""
    cfg = dataclass_from_params(WorldConfig, section(params, "world"), "world")
    world = generate_world(WorldSpec.load(lexicon, templates), cfg)
    with hold_outputs(out):
        write_world(world, Path(out))
    log.info("wrote %s: %s", out, ", ".join(f"{k}={v}" for k, v in world.manifest["counts"].items()))
