"""Stage `tune`: the learning rate of every run of one group (a base method and its token-level variants), on the
same grid, epochs and tuning seed for each (params: tune, unlearn, evaluate, data)."""

from pathlib import Path

import click

from pipeline.common.atomic import hold_outputs
from pipeline.common.errors import ParamError
from pipeline.common.params import section
from pipeline.studies.tune_runs import run_tuning
from pipeline.studies.tuning import TuneConfig

from .options import NAME, params_options, reference_option, shards_option


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
    out_dir = Path(out or f"artifacts/tuning/{group}")
    with hold_outputs(out_dir):
        run_tuning(params, group, names, shards, reference, target_results, retain_results, out_dir)
