"""Stage `check_models`: how many questions each model answers exactly (greedy), per split."""

import logging

import click

from pipeline.common.atomic import write_json
from pipeline.common.errors import ParamError
from pipeline.common.params import load_params, section
from pipeline.data.config import DataConfig
from pipeline.evaluation.exact_match import CheckConfig, exact_match_rates

from .options import params_option

log = logging.getLogger(__name__)


@click.command("check-models")
@params_option
@click.option("--model", "models", multiple=True, required=True, metavar="NAME=DIR",
              help="A model to check, e.g. target=artifacts/models/target (repeatable).")
@click.option("--out", default="artifacts/metrics/models.json", show_default=True, type=click.Path(dir_okay=False))
def command(params_file: str, models: tuple[str, ...], out: str) -> None:
    """Exact-match rate of greedy answers per model and split (params: check, data)."""
    params = load_params(params_file)
    cfg = CheckConfig.from_params(section(params, "check"))
    data = DataConfig.from_params(section(params, "data"))
    results = {}
    for item in models:
        name, sep, model_dir = item.partition("=")
        if not sep:
            raise ParamError(f"--model {item!r}: expected NAME=DIR")
        results[name] = exact_match_rates(model_dir, data, cfg)
        log.info("%s: %s", name, results[name])
    write_json(out, results)
