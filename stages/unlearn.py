"""Stage `unlearn`: one unlearning run (`unlearn.runs.NAME`) from the attribution shards, once per seed of
`unlearn.seeds` (the training seed: data order, RMU's control vector), into OUT/seed{S}/, then OUT/complete.json.

Several processes: `torchrun --nproc_per_node 8 -m stages unlearn t_npo` or `deepspeed --module stages unlearn t_npo`.
"""

import json
import logging
import shutil
from dataclasses import replace
from pathlib import Path

import click

from pipeline.common.atomic import hold_outputs
from pipeline.common.distributed import init_distributed
from pipeline.common.params import section
from pipeline.data.config import DataConfig
from pipeline.evaluation.monitor import monitor_from_params
from pipeline.studies.tune_runs import chosen_lr
from pipeline.training.run_config import run_configs
from pipeline.training.seeds import check_seeds
from pipeline.training.unlearn import run_unlearn_seeds

from .options import NAME, params_options, reference_option, shards_option

log = logging.getLogger(__name__)


@click.command("unlearn")
@click.argument("name", type=NAME)
@params_options
@shards_option
@reference_option
@click.option("--out", type=click.Path(file_okay=False),
              help="Output directory [artifacts/unlearn/NAME]: seed{S}/model/, seed{S}/token_weights.parquet, "
                   "complete.json.")
@click.option("--checkpoints", type=click.Path(file_okay=False),
              help="[artifacts/checkpoints/unlearn-NAME; with --out: OUT.checkpoints]")
@click.option("--plots", type=click.Path(file_okay=False),
              help="Loss curves, seed{S}.csv per seed [artifacts/plots/unlearn/NAME; with --out: OUT.plots].")
@click.option("--seed", "seeds", type=int, multiple=True, help="Only these seeds [unlearn.seeds] (repeatable).")
@click.option("--resume/--no-resume", default=True, show_default=True,
              help="Skip the seeds already finished with these params, and continue a killed seed from its "
                   "checkpoint.")
@click.option("--monitor-plots", type=click.Path(file_okay=False),
              help="Evaluation during training (unlearn.monitor.every > 0), seed{S}.csv per seed "
                   "[artifacts/plots/monitor/NAME; with --out: OUT.monitor].")
@click.option("--lr-from", type=click.Path(dir_okay=False),
              help="Take the learning rate a tuning chose for NAME (its choice.json) instead of the params'.")
@click.option("--local_rank", "--local-rank", type=int, default=None, hidden=True)
def command(name, params: dict, shards, reference, out, checkpoints, plots, seeds, resume, monitor_plots,
            lr_from, local_rank) -> None:
    """Unlearn with run NAME: its method's and weighting's sections over `unlearn.defaults`, its `train:` over
    `unlearn.train`, once per seed (params: unlearn, data; unlearn.monitor and three evaluate keys for the
    evaluation during training)."""
    cfg, train = run_configs(params, name)
    if lr_from:
        train = replace(train, lr=chosen_lr(Path(lr_from), name))
        log.info("unlearn %s: lr %.3g from %s", name, train.lr, lr_from)
    data = DataConfig.from_params(section(params, "data"))
    monitor = monitor_from_params(params)
    # A run with its own --out (a trial off DVC) keeps everything beside it, out of the pipeline's artifacts.
    out_dir = Path(out or f"artifacts/unlearn/{name}")
    ckpt_dir = Path(checkpoints or (f"{out}.checkpoints" if out else f"artifacts/checkpoints/unlearn-{name}"))
    plots_dir = Path(plots or (f"{out}.plots" if out else f"artifacts/plots/unlearn/{name}"))
    monitor_dir = Path(monitor_plots or (f"{out}.monitor" if out else f"artifacts/plots/monitor/{name}")) \
        if monitor else None
    if monitor is None and monitor_plots:  # monitor off: the output a DVC stage declares is there, and empty (it
        shutil.rmtree(monitor_plots, ignore_errors=True)  # persists: an earlier run's curves would stay in it)
        Path(monitor_plots).mkdir(parents=True, exist_ok=True)
    whole_set = not seeds  # every seed of unlearn.seeds: the outputs hold those seeds and no other
    seeds = check_seeds(list(seeds) or section(params, "unlearn.seeds"))
    init_distributed()
    with hold_outputs(out_dir, ckpt_dir):
        summaries = run_unlearn_seeds(name, cfg, train, data, str(section(params, "unlearn.model")), Path(shards),
                                      out_dir, ckpt_dir, plots_dir, seeds,
                                      resume, Path(reference) if reference else None, monitor, monitor_dir,
                                      whole_set=whole_set)
    for seed, summary in zip(seeds, summaries):
        log.debug("unlearn %s seed %d: %s", name, seed, json.dumps(summary))
        if summary.get("skipped"):  # logged as it was skipped
            continue
        final = summary["final"] or {}
        loss = f", final loss {final['loss']:.4f}" if "loss" in final else ""
        log.info("unlearn %s seed %d: %s/%s, %d steps%s; wrote %s", name, seed, summary["method"],
                 summary["weighting"], summary["steps"], loss, out_dir / f"seed{seed}")
