"""Stage `attribute`: token attribution written once into Parquet shards (and `download-tagger`).

Several processes: `torchrun --nproc_per_node 4 -m stages attribute` (each takes a disjoint part of the samples).
"""

import json
import logging
from pathlib import Path

import click

from pipeline.attribution.quality import headline_metrics
from pipeline.attribution.run import AttributionConfig, run_attribution
from pipeline.attribution.tagging import trankit_cache_dir
from pipeline.common.atomic import hold_outputs, write_json
from pipeline.common.distributed import init_distributed
from pipeline.common.params import section
from pipeline.data.config import DataConfig

from .options import params_options

log = logging.getLogger(__name__)


@click.command("attribute")
@params_options
@click.option("--out", default="artifacts/attribution", show_default=True, type=click.Path(file_okay=False),
              help="Shard directory (Parquet shards and _manifest.json).")
@click.option("--metrics", default="artifacts/metrics/attribution.json", show_default=True,
              type=click.Path(dir_okay=False), help="Counts and attribution quality, in full.")
@click.option("--headline", type=click.Path(dir_okay=False),
              help="Also write the few headline numbers here (the DVC metrics file `dvc metrics show` lists).")
@click.option("--local_rank", "--local-rank", type=int, default=None, hidden=True)
def command(params: dict, out: str, metrics: str, headline, local_rank) -> None:
    """Tag nouns, run the original and masked passes, write Δ, H and φ per token (params: attribution, data)."""
    cfg = AttributionConfig.from_params(section(params, "attribution"))
    data = DataConfig.from_params(section(params, "data"))
    init_distributed()
    with hold_outputs(out):
        summary = run_attribution(cfg, data, Path(out), Path(metrics))
        if headline:  # from the metrics as written: they hold the quality figures
            write_json(headline, headline_metrics(json.loads(Path(metrics).read_text())))
    log.info("attribute: %d samples, %d scored tokens, %d with no noun (tagger %s); metrics in %s",
             summary["samples"], summary["scored_tokens"], summary["no_noun"], summary["tagger"], metrics)
    log.debug("attribute: %s", json.dumps({k: v for k, v in summary.items() if k != "metadata"}))


@click.command("download-tagger")
@click.option("--cache-dir", type=click.Path(file_okay=False), default=None,
              help="Trankit's cache [~/.cache/tokenunlearn/trankit].")
def download_command(cache_dir) -> None:
    """Fetch Trankit's English model (XLM-R base and english.zip) ahead of time; needs network access."""
    from pipeline.attribution.tagging import TrankitTagger

    cache = trankit_cache_dir(cache_dir)
    TrankitTagger(cache_dir=cache, allow_download=True)
    log.info("Trankit's English model is in %s; `tagger: auto` now uses Trankit", cache)
