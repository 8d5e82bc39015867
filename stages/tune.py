"""Stage `tune`: the learning rate of every run of one group (a base method and its token-level variants), on the
same grid, epochs and tuning seed for each (params: tune, unlearn, evaluate, data)."""

import logging
from dataclasses import replace
from pathlib import Path

import click

from pipeline.common.artifacts import read_json, value_at
from pipeline.common.atomic import atomic_file, hold_outputs
from pipeline.common.errors import DataError, ParamError
from pipeline.common.params import LEARNING_RATE, between, section
from pipeline.data.config import DataConfig
from pipeline.evaluation.config import eval_config
from pipeline.evaluation.evaluate import evaluate_model
from pipeline.evaluation.inputs import load_inputs
from pipeline.training.engine import TrainingDiverged
from pipeline.studies.tuning import TuneConfig, choice_table, plot_tradeoff, tune_group
from pipeline.training.run_config import run_configs
from pipeline.training.unlearn import run_unlearn

from .options import NAME, params_options, reference_option, shards_option

log = logging.getLogger(__name__)


@click.command("tune")
@click.argument("group", required=False, type=NAME)
@click.option("--run", "run_name", metavar="RUN", type=NAME,
              help="Tune this run of unlearn.runs alone (a group of its own), instead of GROUP.")
@params_options
@shards_option
@reference_option
@click.option("--out", type=click.Path(file_okay=False),
              help="Output directory [artifacts/tuning/GROUP, or RUN]: choice.json, choice.md, tradeoff.png, "
                   "trials/RUN/lr*.json.")
@click.option("--target-results", default="artifacts/metrics/eval/target.json", show_default=True,
              type=click.Path(dir_okay=False), help="The target model's evaluation summary (its model utility).")
@click.option("--retain-results", default="artifacts/eval/retain", show_default=True,
              type=click.Path(file_okay=False), help="The retain model's evaluation, for forget quality.")
def command(group, run_name, params: dict, shards, reference, out, target_results, retain_results) -> None:
    """Tune the learning rate of each run of tune.groups.GROUP (or of --run RUN alone) by tune.search (grid or
    bisect); write the choice (copy it into unlearn.runs.RUN.train.lr, or give it to `unlearn --lr-from`)."""
    cfg = TuneConfig.from_params(section(params, "tune"))
    if (group is None) == (run_name is None):
        raise click.UsageError("give a GROUP of tune.groups or --run RUN, one of them")
    if run_name is not None:
        group, names = run_name, [run_name]
    elif group not in cfg.groups:
        raise ParamError(f"tune.groups: no group named '{group}' (have {sorted(cfg.groups)})")
    else:
        names = cfg.groups[group]
    runs = {name: run_configs(params, name) for name in names}
    data = DataConfig.from_params(section(params, "data"))
    model_path = str(section(params, "unlearn.model"))
    # the floor is a share of the target's utility: a missing, negative or non-finite one would move it silently
    target_summary = read_json(target_results, "evaluation summary of the target",
                               "evaluate the target first (DVC stage evaluate_target)")
    if isinstance(target_summary, dict) and cfg.utility not in target_summary:
        raise DataError(f"{target_results}: no {cfg.utility} in it, the utility the floor is measured on "
                        "(tune.utility): evaluate the target with params that produce it, or choose another utility")
    target_utility = value_at(target_summary, target_results, cfg.utility, between(0, 1))
    # the choice needs forget ES and the utility only: the attacks (membership inference, paraphrases,
    # quantization) are left to the reported runs' evaluations, where they cost once per run, not once per trial
    eval_cfg = replace(eval_config(params), mia={}, paraphrase=False, quantize={})
    inputs = load_inputs(eval_cfg, Path(retain_results))  # every evaluation input, checked before the first trial

    def unlearn_one(name, ucfg, train, work: Path) -> None:
        run_unlearn(name, ucfg, train, data, model_path, Path(shards), work, work / "checkpoints",
                    work / "losses.csv", resume=False, reference_dir=Path(reference) if reference else None)

    def evaluate_one(model_dir: Path, eval_dir: Path) -> dict:
        return evaluate_model(str(model_dir), eval_cfg, eval_dir, Path(retain_results), inputs)

    out_dir = Path(out or f"artifacts/tuning/{group}")
    with hold_outputs(out_dir):
        result = tune_group(group, runs, cfg, unlearn_one, evaluate_one, target_utility, out_dir,
                            diverges=(TrainingDiverged,), lr_rule=LEARNING_RATE)
        table = choice_table(result)
        with atomic_file(out_dir / "choice.md") as f:
            f.write(table)
        plot_tradeoff(result, out_dir / "tradeoff.png")
    log.info("tune %s:\n%s", group, table)
