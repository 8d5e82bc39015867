"""Stage `finetune` (and `pretrain`): train a model on question-answer splits with the DeepSpeed engine.

Launch as one process (`tokenunlearn finetune target`) or several:
`torchrun --nproc_per_node 2 -m stages finetune target` or `deepspeed --num_gpus 8 --module stages finetune target`.
"""

import json
import logging
from pathlib import Path

import click

from pipeline.engine import TrainConfig
from pipeline.errors import ParamError
from pipeline.finetune import DataConfig, FinetuneJob, run_finetune
from pipeline.params import load_params, section

from .options import overlay_option, params_option

log = logging.getLogger(__name__)

JOB_KEYS = {"init", "splits", "tokenizer", "train", "trust_remote_code"}


def job_from_params(params: dict, name: str) -> FinetuneJob:
    models = section(params, "finetune.models")
    if name not in models:
        raise ParamError(f"finetune.models: no model named '{name}' (have {sorted(models)})")
    spec = models[name]
    unknown = set(spec) - JOB_KEYS
    if unknown:
        raise ParamError(f"finetune.models.{name}: unknown parameter(s) {sorted(unknown)}")
    if not spec.get("splits"):
        raise ParamError(f"finetune.models.{name}.splits: at least one split is needed")
    train = {**section(params, "finetune.train"), **spec.get("train", {})}
    return FinetuneJob(
        name=name,
        init=str(spec.get("init", "scratch")),
        splits=list(spec["splits"]),
        train=TrainConfig.from_params(train, f"finetune.models.{name}.train"),
        data=DataConfig.from_params(section(params, "data")),
        tokenizer=spec.get("tokenizer"),
        model_config=dict(params.get("model", {}).get("config", {})),
        trust_remote_code=bool(spec.get("trust_remote_code", False)),
    )


@click.command("finetune")
@click.argument("name")
@params_option
@overlay_option
@click.option("--out", type=click.Path(file_okay=False), help="Model directory [artifacts/models/NAME].")
@click.option("--checkpoints", type=click.Path(file_okay=False),
              help="Checkpoint directory [artifacts/checkpoints/NAME].")
@click.option("--plot", type=click.Path(dir_okay=False), help="Loss curve CSV [artifacts/plots/finetune/NAME.csv].")
@click.option("--resume/--no-resume", default=True, show_default=True,
              help="Continue from a checkpoint of the same run, if there is one.")
@click.option("--local_rank", "--local-rank", type=int, default=None, hidden=True)
def command(name, params_file, overlay, out, checkpoints, plot, resume, local_rank) -> None:
    """Finetune model NAME as `finetune.models.NAME` in the params says (init, splits, train overrides)."""
    job = job_from_params(load_params(params_file, overlay), name)
    summary = run_finetune(
        job,
        out_dir=Path(out or f"artifacts/models/{name}"),
        ckpt_dir=Path(checkpoints or f"artifacts/checkpoints/{name}"),
        plot_file=Path(plot or f"artifacts/plots/finetune/{name}.csv"),
        resume=resume,
    )
    log.info("finetune %s done: %s", name, json.dumps(summary))
