"""Options shared by the stage commands."""

import functools
import logging
from pathlib import Path

import click

from pipeline.common.errors import DataError, ParamError
from pipeline.common.names import check_name
from pipeline.common.params import load_params

log = logging.getLogger(__name__)

_PARAMS_OPTIONS = [
    click.option("--params", "params_file", default="params.yaml", show_default=True,
                 type=click.Path(dir_okay=False), help="The params file (DVC's params.yaml)."),
    click.option("--overlay", "overlays", multiple=True, metavar="FILE",
                 help="Merge this file's changes into the params first (e.g. configs/paper.yaml: the paper's sweep); "
                      "repeatable, applied in order; null in it switches a setting off."),
    click.option("-S", "--set", "overrides", multiple=True, metavar="KEY=VALUE",
                 help="Set one param after the overlays, as `dvc exp run -S` does, e.g. -S unlearn.train.lr=1e-4 "
                      "(the value is YAML); repeatable."),
]


def params_options(command):
    """--params, --overlay and -S; the command receives `params`, the file with its overlays and overrides."""

    @functools.wraps(command)
    def wrapper(*args, params_file, overlays, overrides, **kwargs):
        return command(*args, params=load_params(params_file, overlays, overrides), **kwargs)

    for option in reversed(_PARAMS_OPTIONS):
        wrapper = option(wrapper)
    return wrapper


class _Name(click.ParamType):
    """A name that becomes part of a path (a run, a model, a group): refused unless one plain path component."""

    name = "name"

    def convert(self, value, param, ctx):
        try:
            return check_name(value, param.human_readable_name if param else "name")
        except ParamError as e:
            self.fail(str(e), param, ctx)


NAME = _Name()

shards_option = click.option(
    "--shards", default="artifacts/attribution", show_default=True, type=click.Path(file_okay=False),
    help="The attribution shards of the forget set (stage one's output).",
)

reference_option = click.option(
    "--reference", type=click.Path(file_okay=False), default=None,
    help="The reference cache of the retain data (`tokenunlearn reference`), for a retain term that reads θ_o "
         "[none: the run caches θ_o's top-k itself, from the model before its first step].",
)


def chosen_lr(choice_file: Path, run: str) -> float:
    """The learning rate a tuning (`tokenunlearn tune`: its choice.json) chose for `run`, checked as
    `unlearn.train.lr` is: a clear error if the file, the run or the rate is not there or not valid, or if the tuning
    found no rate that keeps the utility floor (a comparison at equal utility would not be one)."""
    from pipeline.common.artifacts import read_json, value_at
    from pipeline.training.engine import TrainConfig

    choice = read_json(choice_file, "tuning choice", "run `tokenunlearn tune` to write it")
    runs = value_at(choice, choice_file, "runs")
    if not isinstance(runs, dict) or run not in runs:
        have = sorted(runs) if isinstance(runs, dict) else []
        raise DataError(f"{choice_file}: no tuning of run '{run}' in it (runs: {have}); tune it with "
                        f"`tokenunlearn tune --run {run}`")
    lr = float(value_at(choice, choice_file, f"runs.{run}.chosen.lr", TrainConfig.RULES["lr"], "unlearn.train.lr"))
    chosen = runs[run]["chosen"]
    if chosen.get("meets_floor") is False:
        raise DataError(f"{choice_file}: run '{run}': no rate the tuning tried keeps the utility floor (its best, lr "
                        f"{lr:.3g}, has model utility {chosen.get('model_utility')}), so it is no equal-utility rate; "
                        f"tune again from a lower rate (unlearn.runs.{run}.train.lr) or with a lower "
                        "tune.utility_floor")
    if runs[run].get("converged") is False:
        log.warning("%s: run '%s': the bisection did not converge (%s): lr %.3g keeps the floor but may lie well "
                    "below it", choice_file, run, runs[run].get("stopped", "its trial budget ran out"), lr)
    return lr
