"""Every TOFU metric of a target and a retain model under open-unlearning's definitions (TokenUnlearn's default)
and under TokenUnlearn's own options, side by side:

    python -m pipeline.studies.compare_definitions --target artifacts/models/target \\
        --retain artifacts/models/retain [--params params.yaml] [--overlay FILE] [-S es_definition=strict] [--out DIR]

Each model is evaluated once per column with the params' `evaluate` section (no multiple choice): the first column
with es_definition: open-unlearning and loss_dtype: float32, the second with the -S changes (default
es_definition=strict; add -S loss_dtype=model for the model's dtype, which differs from float32 on a GPU only). The
retain model is its own reference for forget quality in each column. The numbers are the unrounded `agg_value`s of
each evaluation's TOFU_EVAL.json (open-unlearning's names), and retain ES and EM from the retain set's items.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import tempfile
from pathlib import Path

import click
import pyarrow.parquet as pq

from pipeline.common.errors import TokenUnlearnError
from pipeline.common.params import apply_override, load_params
from pipeline.evaluation.config import EvalConfig, eval_config
from pipeline.evaluation.evaluate import evaluate_model
from pipeline.evaluation.open_unlearning import EVAL_FILE
from pipeline.evaluation.tofu_sets import set_aggregates

log = logging.getLogger(__name__)

OPEN_UNLEARNING = ("es_definition=open-unlearning", "loss_dtype=float32")


def column_config(params: dict, changes: tuple[str, ...]) -> EvalConfig:
    """The params' evaluation settings with `changes` (KEY=VALUE of the evaluate section), without multiple choice."""
    for change in changes:
        params = apply_override(params, f"evaluate.{change}")
    return dataclasses.replace(eval_config(params), multiple_choice={})


def metric_values(eval_dir: Path) -> dict[str, float | None]:
    """One evaluation's TOFU metrics: TOFU_EVAL.json's agg_values, log10 forget quality, and retain ES and EM."""
    logs = json.loads((eval_dir / EVAL_FILE).read_text())
    values = {name: entry["agg_value"] for name, entry in logs.items()}
    fq = values.get("forget_quality")
    values["log10_forget_quality"] = None if fq is None else (math.log10(fq) if fq > 0 else -math.inf)
    if (eval_dir / "items" / "retain.parquet").is_file():
        retain = set_aggregates(pq.read_table(eval_dir / "items" / "retain.parquet").to_pylist(), "retain")
        values["retain_extraction_strength"] = retain["extraction_strength"]
        values["retain_exact_memorization"] = retain["exact_memorization"]
    return values


def evaluate_column(target: str, retain: str, cfg: EvalConfig, out: Path) -> dict[str, dict]:
    """{model: metric values} for the retain model (its own reference) and the target, evaluated into `out`."""
    evaluate_model(retain, cfg, out / "retain", out / "retain")
    evaluate_model(target, cfg, out / "target", out / "retain")
    return {model: metric_values(out / model) for model in ("target", "retain")}


def comparison_table(columns: dict[str, dict[str, dict]]) -> str:
    """A markdown table: one row per (metric, model), one column per definition set, and their difference."""
    (first, a), (second, b) = columns.items()
    lines = [f"| metric | model | {first} | {second} | difference |", "| --- | --- | ---: | ---: | ---: |"]
    show = lambda v: "–" if v is None else f"{v:.10g}"
    for model in ("target", "retain"):
        for metric in sorted(set(a[model]) | set(b[model])):
            x, y = a[model].get(metric), b[model].get(metric)
            diff = y - x if x is not None and y is not None and math.isfinite(x) and math.isfinite(y) else None
            lines.append(f"| {metric} | {model} | {show(x)} | {show(y)} | {show(diff)} |")
    return "\n".join(lines) + "\n"


@click.command()
@click.option("--target", required=True, type=click.Path(exists=True), help="The target model's directory.")
@click.option("--retain", required=True, type=click.Path(exists=True), help="The retain model's directory.")
@click.option("--params", "params_file", default="params.yaml", show_default=True, type=click.Path(dir_okay=False))
@click.option("--overlay", "overlays", multiple=True, metavar="FILE", help="Overlay files, in order.")
@click.option("-S", "--set", "changes", multiple=True, metavar="KEY=VALUE", default=("es_definition=strict",),
              show_default=True, help="The second column's change to the evaluate section; repeatable.")
@click.option("--out", type=click.Path(file_okay=False), help="Keep the evaluations here [a temporary directory].")
def main(target, retain, params_file, overlays, changes, out) -> None:
    """Print every TOFU metric under open-unlearning's definitions and under the -S changes, side by side."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        params = load_params(params_file, overlays)
        configs = {"open-unlearning": column_config(params, OPEN_UNLEARNING),
                   " ".join(changes): column_config(params, OPEN_UNLEARNING + tuple(changes))}
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(out or tmp)
            columns = {name: evaluate_column(target, retain, cfg, root / f"column{i}")
                       for i, (name, cfg) in enumerate(configs.items())}
    except TokenUnlearnError as e:  # one line, as the tokenunlearn commands report a user's error
        raise click.ClickException(str(e)) from None
    settings = {k: getattr(next(iter(configs.values())), k) for k in ("max_new_tokens", "batch_size", "template")}
    click.echo(f"TOFU metrics of {target} and {retain} ({settings}):\n")
    click.echo(comparison_table(columns))


if __name__ == "__main__":
    main()
