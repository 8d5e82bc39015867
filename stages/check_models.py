"""Stage `check_models`: how many questions each model answers exactly (greedy), per split."""

import logging

import click

from pipeline.common.atomic import hold_outputs, write_json
from pipeline.common.errors import ParamError
from pipeline.common.params import section
from pipeline.data.config import DataConfig
from pipeline.evaluation.exact_match import CheckConfig, exact_match_rates

from .options import params_options

log = logging.getLogger(__name__)


@click.command("check-models")
@params_options
@click.option("--model", "models", multiple=True, required=True, metavar="NAME=DIR",
              help="A model to check, e.g. target=artifacts/models/target (repeatable).")
@click.option("--out", default="artifacts/metrics/models.json", show_default=True, type=click.Path(dir_okay=False))
def command(params: dict, models: tuple[str, ...], out: str) -> None:
    """Exact-match rate of greedy answers per model and split (params: check, data)."""
    cfg = CheckConfig.from_params(section(params, "check"))
    data = DataConfig.from_params(section(params, "data"))
    pairs = [item.partition("=") for item in models]
    bad = [item for item, (_, sep, _) in zip(models, pairs) if not sep]
    if bad:
        raise ParamError(f"--model {bad[0]!r}: expected NAME=DIR")
    with hold_outputs(out):
        results = {}
        for name, _, model_dir in pairs:
            results[name] = exact_match_rates(model_dir, data, cfg)
            log.info("check-models %s: exact match %s", name,
                     ", ".join(f"{split} {rate:.3f}" for split, rate in results[name].items()))
        write_json(out, results)
