"""Stage `own-data`: the user's own forget and retain files (and a holdout file), validated and written as the splits
the other stages read (params: data.forget, data.retain, data.holdout; the tokenizer of attribution.model)."""

import logging
from pathlib import Path

import click

from pipeline.attribution.config import AttributionConfig
from pipeline.common.atomic import hold_outputs
from pipeline.common.modeling import load_tokenizer
from pipeline.common.params import section
from pipeline.data.config import DataConfig
from pipeline.data.own_data import data_files, write_splits

from .options import params_options

log = logging.getLogger(__name__)


@click.command("own-data")
@params_options
@click.option("--out", default=None, type=click.Path(file_okay=False),
              help="Output directory: forget.json, retain.json, holdout.json (or *_corpus.jsonl for passages) and "
                   "manifest.json [data.source].")
def command(params: dict, out: str | None) -> None:
    """Read your own forget/retain (and holdout) data from data.forget, data.retain, data.holdout (JSON Lines,
    JSON, CSV or Parquet; question/answer pairs or text passages), check every row, its length in tokens of
    attribution.model's tokenizer included, and write them as splits into data.source (params: data,
    attribution.model)."""
    data = DataConfig.from_params(section(params, "data"))
    attribution = AttributionConfig.from_params(section(params, "attribution"))
    data_files(data)  # params first: no tokenizer is loaded for a run that cannot start
    out = out or data.source
    tokenizer = load_tokenizer(attribution.model, attribution.trust_remote_code)
    with hold_outputs(out):
        manifest = write_splits(data, Path(out), tokenizer)
    for name, s in manifest["sets"].items():
        log.info("%s: %d %s row(s) from %s -> %s%s", name, s["rows"], s["kind"], s["path"], Path(out) / s["file"],
                 f" ({s['rows_skipped']} longer than data.max_length skipped)" if s["rows_skipped"] else "")
    log.info("wrote %s (manifest.json); point data.source at it to use the splits", out)
