"""Options shared by the stage commands."""

import functools

import click

from pipeline.common.errors import ParamError
from pipeline.common.names import check_name
from pipeline.common.params import load_params

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
