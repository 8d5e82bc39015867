"""Stage `tokenizer`: train the embedded model's byte-level BPE tokenizer on the world's text."""

import logging

import click

from pipeline.errors import ParamError
from pipeline.modeling import train_tokenizer
from pipeline.params import load_params, section
from pipeline.world import world_texts

from .options import params_option

log = logging.getLogger(__name__)


@click.command("train-tokenizer")
@params_option
@click.option("--world", "world_dir", default="artifacts/world", show_default=True,
              type=click.Path(exists=True, file_okay=False), help="The generated world to train on.")
@click.option("--out", default="artifacts/tokenizer", show_default=True, type=click.Path(file_okay=False))
def command(params_file: str, world_dir: str, out: str) -> None:
    """Train a BPE tokenizer on every text of the world (params: tokenizer)."""
    cfg = section(load_params(params_file), "tokenizer")
    unknown = set(cfg) - {"vocab_size", "min_frequency"}
    if unknown:
        raise ParamError(f"tokenizer: unknown parameter(s) {sorted(unknown)}")
    train_tokenizer(world_texts(world_dir), int(cfg["vocab_size"]), out, int(cfg.get("min_frequency", 2)))
    log.info("wrote %s", out)
