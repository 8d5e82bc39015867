"""Stage `unlearn`: one unlearning run (`unlearn.runs.NAME`) from the attribution shards, once per seed of
`unlearn.seeds` (the training seed: data order, RMU's control vector), into OUT/seed{S}/.

Several processes: `torchrun --nproc_per_node 8 -m stages unlearn t_npo` or `deepspeed --module stages unlearn t_npo`.
"""

import json
import logging
from dataclasses import replace
from pathlib import Path

import click

from pipeline.common.errors import ParamError
from pipeline.data.config import DataConfig
from pipeline.common.params import load_params, section
from pipeline.training.unlearn import run_configs, run_unlearn

from .options import overlay_option, params_option, shards_option

log = logging.getLogger(__name__)


@click.command("unlearn")
@click.argument("name")
@params_option
@overlay_option
@shards_option
@click.option("--out", type=click.Path(file_okay=False),
              help="Output directory [artifacts/unlearn/NAME]: seed{S}/model/ and seed{S}/token_weights.parquet.")
@click.option("--checkpoints", type=click.Path(file_okay=False), help="[artifacts/checkpoints/unlearn-NAME]")
@click.option("--plots", type=click.Path(file_okay=False),
              help="Loss curves, seed{S}.csv per seed [artifacts/plots/unlearn/NAME].")
@click.option("--seed", "seeds", type=int, multiple=True, help="Only these seeds [unlearn.seeds] (repeatable).")
@click.option("--resume/--no-resume", default=True, show_default=True,
              help="Continue from a checkpoint of the same run, if there is one.")
@click.option("--local_rank", "--local-rank", type=int, default=None, hidden=True)
def command(name, params_file, overlay, shards, out, checkpoints, plots, seeds, resume, local_rank) -> None:
    """Unlearn with run NAME: its method and weighting over `unlearn.defaults`, its `train:` over `unlearn.train`,
    once per seed (params: unlearn, data)."""
    params = load_params(params_file, overlay)
    cfg, train = run_configs(params, name)
    out_dir = Path(out or f"artifacts/unlearn/{name}")
    ckpt_dir = Path(checkpoints or f"artifacts/checkpoints/unlearn-{name}")
    plots_dir = Path(plots or f"artifacts/plots/unlearn/{name}")
    for seed in seeds or section(params, "unlearn.seeds"):
        if not isinstance(seed, int):
            raise ParamError(f"unlearn.seeds: {seed!r} is not an integer")
        summary = run_unlearn(name, cfg, replace(train, seed=seed), DataConfig.from_params(section(params, "data")),
                              str(section(params, "unlearn.model")), Path(shards), out_dir / f"seed{seed}",
                              ckpt_dir / f"seed{seed}", plots_dir / f"seed{seed}.csv", resume)
        log.info("unlearn %s seed %d done: %s", name, seed, json.dumps(summary))
