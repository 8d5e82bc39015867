"""Stage `finetune` (and `pretrain`): train a model on question-answer splits with the DeepSpeed engine.

Launch as one process (`tokenunlearn finetune target`) or several:
`torchrun --nproc_per_node 2 -m stages finetune target` or `deepspeed --num_gpus 8 --module stages finetune target`.
"""

import json
import logging
from pathlib import Path

import click

from pipeline.common.atomic import hold_outputs
from pipeline.common.distributed import init_distributed
from pipeline.training.finetune import job_from_params, run_finetune

from .options import NAME, params_options

log = logging.getLogger(__name__)


@click.command("finetune")
@click.argument("name", type=NAME)
@params_options
@click.option("--out", type=click.Path(file_okay=False), help="Model directory [artifacts/models/NAME].")
@click.option("--checkpoints", type=click.Path(file_okay=False),
              help="Checkpoint directory [artifacts/checkpoints/NAME; with --out: OUT.checkpoints].")
@click.option("--plot", type=click.Path(dir_okay=False),
              help="Loss curve CSV [artifacts/plots/finetune/NAME.csv; with --out: OUT.loss.csv].")
@click.option("--resume/--no-resume", default=True, show_default=True,
              help="Continue from a checkpoint of the same run, if there is one.")
@click.option("--local_rank", "--local-rank", type=int, default=None, hidden=True)
def command(name, params: dict, out, checkpoints, plot, resume, local_rank) -> None:
    """Finetune model NAME as `finetune.models.NAME` in the params says (init, splits, train overrides)."""
    job = job_from_params(params, name)
    out_dir = Path(out or f"artifacts/models/{name}")
    # A model with its own --out (a trial off DVC) keeps everything beside it, out of the pipeline's artifacts.
    ckpt_dir = Path(checkpoints or (f"{out}.checkpoints" if out else f"artifacts/checkpoints/{name}"))
    plot_file = Path(plot or (f"{out}.loss.csv" if out else f"artifacts/plots/finetune/{name}.csv"))
    init_distributed()
    with hold_outputs(out_dir, ckpt_dir):
        summary = run_finetune(job, out_dir, ckpt_dir, plot_file, resume)
    loss = f", final loss {summary['final_loss']:.4f}" if summary["final_loss"] is not None else ""
    log.info("finetune %s: %d steps on %d samples%s; wrote %s", name, summary["steps"], summary["samples"], loss,
             out_dir)
    log.debug("finetune %s: %s", name, json.dumps(summary))
