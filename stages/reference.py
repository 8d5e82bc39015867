"""Stage `reference`: stage one's sibling over the retain data. θ_o's top-k next-token log-probabilities (and its
activations at `reference.layers`) at every retain answer position, cached once, so that unlearning never holds a
reference model.

Several processes: `torchrun --nproc_per_node 4 -m stages reference` (each takes a disjoint part of the samples).
"""

import json
import logging
from pathlib import Path

import click

from pipeline.attribution.reference import ReferenceConfig, run_reference
from pipeline.common.atomic import hold_outputs
from pipeline.common.distributed import init_distributed
from pipeline.common.params import section
from pipeline.data.config import DataConfig

from .options import params_options

log = logging.getLogger(__name__)


@click.command("reference")
@params_options
@click.option("--out", default="artifacts/reference", show_default=True, type=click.Path(file_okay=False),
              help="Cache directory (Parquet shards and _manifest.json).")
@click.option("--metrics", default="artifacts/metrics/reference.json", show_default=True,
              type=click.Path(dir_okay=False), help="Counts (DVC metrics).")
@click.option("--local_rank", "--local-rank", type=int, default=None, hidden=True)
def command(params: dict, out: str, metrics: str, local_rank) -> None:
    """Cache θ_o's top-k next-token log-probabilities (and activations) on the retain data, for the retain term
    (params: reference, data)."""
    cfg = ReferenceConfig.from_params(section(params, "reference"))
    data = DataConfig.from_params(section(params, "data"))
    init_distributed()
    with hold_outputs(out):
        summary = run_reference(cfg, data, Path(out), Path(metrics))
    log.info("reference: %d samples, %d answer positions, top %d log-probabilities; wrote %s", summary["samples"],
             summary["positions"], summary["top_k"], out)
    log.debug("reference: %s", json.dumps({k: v for k, v in summary.items() if k != "metadata"}))
