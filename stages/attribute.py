"""Stage `attribute`: token attribution written once into Parquet shards (and `download-tagger`).

Several processes: `torchrun --nproc_per_node 4 -m stages attribute` (each takes a disjoint part of the samples).
"""

import json
import logging
from pathlib import Path

import click

from pipeline.attribution.run import AttributionConfig, run_attribution
from pipeline.data.config import DataConfig
from pipeline.common.params import load_params, section
from pipeline.attribution.tagging import trankit_cache_dir

from .options import overlay_option, params_option

log = logging.getLogger(__name__)


@click.command("attribute")
@params_option
@overlay_option
@click.option("--out", default="artifacts/attribution", show_default=True, type=click.Path(file_okay=False),
              help="Shard directory (Parquet shards and manifest.json).")
@click.option("--metrics", default="artifacts/metrics/attribution.json", show_default=True,
              type=click.Path(dir_okay=False), help="Counts and attribution quality (DVC metrics).")
@click.option("--local_rank", "--local-rank", type=int, default=None, hidden=True)
def command(params_file: str, overlay, out: str, metrics: str, local_rank) -> None:
    """Tag nouns, run the original and masked passes, write Δ, H and φ per token (params: attribution, data)."""
    params = load_params(params_file, overlay)
    cfg = AttributionConfig.from_params(section(params, "attribution"))
    data = DataConfig.from_params(section(params, "data"))
    summary = run_attribution(cfg, data, Path(out), Path(metrics))
    log.info("attribute done: %s", json.dumps({k: v for k, v in summary.items() if k != "metadata"}))


@click.command("download-tagger")
@click.option("--cache-dir", type=click.Path(file_okay=False), default=None,
              help="Trankit's cache [~/.cache/tokenunlearn/trankit].")
def download_command(cache_dir) -> None:
    """Fetch Trankit's English model (XLM-R base and english.zip) ahead of time; needs network access."""
    from pipeline.attribution.tagging import TrankitTagger

    cache = trankit_cache_dir(cache_dir)
    TrankitTagger(cache_dir=cache, allow_download=True)
    log.info("Trankit's English model is in %s; `tagger: auto` now uses Trankit", cache)
