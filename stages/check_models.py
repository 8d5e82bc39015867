"""Stage `check_models`: how many questions each model answers exactly (greedy), per split."""

import logging
from pathlib import Path

import click

from pipeline.atomic import write_json
from pipeline.errors import ParamError
from pipeline.finetune import DataConfig
from pipeline.generation import exact_match, greedy_answers
from pipeline.modeling import load_model, load_tokenizer
from pipeline.params import load_params, section
from pipeline.templates import get_template
from pipeline.tofu import load_split

from .options import params_option

log = logging.getLogger(__name__)


def exact_match_rates(model_dir: str, data: DataConfig, splits: list[str], max_new_tokens: int,
                      batch_size: int) -> dict[str, float]:
    model, tokenizer = load_model(model_dir), load_tokenizer(model_dir)
    template = get_template(data.template)
    rates = {}
    for split in splits:
        rows = load_split(data.source, split)
        answers = greedy_answers(model, tokenizer, template, [r["question"] for r in rows], max_new_tokens,
                                 batch_size)
        rates[split] = round(sum(exact_match(a, r["answer"]) for a, r in zip(answers, rows)) / len(rows), 4)
    return rates


@click.command("check-models")
@params_option
@click.option("--model", "models", multiple=True, required=True, metavar="NAME=DIR",
              help="A model to check, e.g. target=artifacts/models/target (repeatable).")
@click.option("--out", default="artifacts/metrics/models.json", show_default=True, type=click.Path(dir_okay=False))
def command(params_file: str, models: tuple[str, ...], out: str) -> None:
    """Exact-match rate of greedy answers per model and split (params: check, data)."""
    params = load_params(params_file)
    cfg = section(params, "check")
    data = DataConfig.from_params(section(params, "data"))
    results = {}
    for item in models:
        name, sep, model_dir = item.partition("=")
        if not sep:
            raise ParamError(f"--model {item!r}: expected NAME=DIR")
        results[name] = exact_match_rates(model_dir, data, list(cfg["splits"]), int(cfg.get("max_new_tokens", 64)),
                                          int(cfg.get("batch_size", 64)))
        log.info("%s: %s", name, results[name])
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    write_json(out, results)
