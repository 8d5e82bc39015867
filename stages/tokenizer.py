"""Stage `tokenizer`: train the embedded model's byte-level BPE tokenizer on the world's text."""

import logging

import click

from pipeline.common.atomic import hold_outputs
from pipeline.common.modeling import TokenizerConfig, train_tokenizer
from pipeline.common.params import dataclass_from_params, section
from pipeline.data.world import world_texts

from .options import params_options

log = logging.getLogger(__name__)


@click.command("train-tokenizer")
@params_options
@click.option("--world", "world_dir", default="artifacts/world", show_default=True,
              type=click.Path(exists=True, file_okay=False),
              help="The generated world, or any directory of TOFU-format JSON Lines, to train on.")
@click.option("--out", default="artifacts/tokenizer", show_default=True, type=click.Path(file_okay=False))
def command(params: dict, world_dir: str, out: str) -> None:
    """Train a BPE tokenizer on every text of the world (params: tokenizer)."""
    cfg = dataclass_from_params(TokenizerConfig, section(params, "tokenizer"), "tokenizer")
    with hold_outputs(out):
        train_tokenizer(world_texts(world_dir), cfg.vocab_size, out, cfg.min_frequency)
    log.info("wrote %s", out)
