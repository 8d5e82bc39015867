"""Stage `relearn`: the relearning attack on a model, or on each seed of an unlearning run (params: relearn,
evaluate, data): a few finetuning steps on each attack's rows of `relearn.data`, then the probes again."""

import functools
import logging
from pathlib import Path

import click

from pipeline.common.atomic import hold_outputs
from pipeline.common.params import section
from pipeline.data.config import DataConfig
from pipeline.evaluation.attacks.relearning import evaluate_attack
from pipeline.evaluation.config import eval_config
from pipeline.training.relearn import relearn_config, relearning_attack

from .options import NAME, params_options

log = logging.getLogger(__name__)


@click.command("relearn")
@click.argument("name", type=NAME)
@params_options
@click.option("--model", "model_path", required=True,
              help="A model directory, or an unlearning run's directory (each seed{S}/model, once complete).")
@click.option("--out", type=click.Path(file_okay=False),
              help="Output directory [artifacts/relearn/NAME]: seed{S}.json per model, metrics.json.")
@click.option("--metrics", type=click.Path(dir_okay=False),
              help="Summary JSON [artifacts/metrics/relearn/NAME.json; with --out: OUT.json].")
def command(name, params: dict, model_path, out, metrics) -> None:
    """Relearn model NAME for `relearn.train.max_steps` steps on each attack's rows (a slice of the forget set,
    retain data) and probe forget ES, ROUGE and multiple choice on forget rows no attack saw, before and after."""
    cfg = relearn_config(params)
    data = DataConfig.from_params(section(params, "data"))
    attack = functools.partial(relearning_attack, cfg=cfg, data=data)  # (model, probe, n_forget) -> results
    out_dir = Path(out or f"artifacts/relearn/{name}")
    metrics_file = Path(metrics or (f"{out}.json" if out else f"artifacts/metrics/relearn/{name}.json"))
    with hold_outputs(out_dir):
        summary = evaluate_attack(model_path, attack, eval_config(params), out_dir, metrics_file, name)
    # forget ES on the forget rows no attack saw: before, and after relearning on each attack's rows
    after = [k.removesuffix("_forget_es") for k in summary
             if k.endswith("_forget_es") and k != "before_forget_es"]
    log.info("relearn %s: forget ES %.3f before, after relearning on %s; wrote %s", name,
             summary["before_forget_es"], ", ".join(f"{a} {summary[a + '_forget_es']:.3f}" for a in after),
             metrics_file)
    log.debug("relearn %s: %s", name, summary)
