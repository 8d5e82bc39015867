"""Stage `world-muse`: the embedded world in MUSE's layout, for `evaluate-muse` on CPU."""

import logging
from pathlib import Path

import click

from pipeline.common.atomic import hold_outputs
from pipeline.data.muse import write_world_as_muse

log = logging.getLogger(__name__)


@click.command("world-muse")
@click.option("--world", "world_dir", default="artifacts/world", show_default=True,
              type=click.Path(exists=True, file_okay=False), help="A world written by `make-world`.")
@click.option("--forget-split", default="forget10", show_default=True,
              help="Whose biographies are the forget corpus (a forget split of the world).")
@click.option("--icl", "n_icl", default=1, show_default=True, type=int,
              help="In-context examples of each knowmem split (MUSE has 10; the embedded model's context is short).")
@click.option("--out", default="artifacts/world_muse", show_default=True, type=click.Path(file_okay=False),
              help="Output directory, in the layout of the hub's muse-bench/MUSE-News.")
def command(world_dir: str, forget_split: str, n_icl: int, out: str) -> None:
    """Write the world's biographies and fact questions as MUSE's raw, knowmem, verbmem and privleak configs."""
    with hold_outputs(out):
        summary = write_world_as_muse(Path(world_dir), Path(out), forget_split, n_icl)
    log.info("wrote %s: %s", out, ", ".join(f"{k}={v}" for k, v in summary["counts"].items()))
