"""Stage `evaluate`: the TOFU metrics and multiple-choice accuracy of one model, per item and in summary (and
`export-open-unlearning`: an evaluation in open-unlearning's layout)."""

import logging
from pathlib import Path

import click

from pipeline.common.atomic import hold_outputs
from pipeline.evaluation.eval_io import write_strict_json
from pipeline.evaluation.config import eval_config
from pipeline.evaluation.evaluate import evaluate_path, headline_metrics
from pipeline.evaluation.open_unlearning import export_evaluation
from pipeline.evaluation.registry import label

from .options import NAME, params_options

log = logging.getLogger(__name__)

HEADLINE_MUSE = ("verbmem_f", "knowmem_f", "knowmem_r", "privleak")  # a MUSE evaluation's


@click.command("evaluate")
@click.argument("name", type=NAME)
@params_options
@click.option("--model", "model_path", required=True,
              help="A model directory (safetensors) or hub name, or an unlearning run's directory "
                   "(artifacts/unlearn/t_npo: every seed{S}/model in it, once the run is complete).")
@click.option("--out", type=click.Path(file_okay=False), help="Output directory [artifacts/eval/NAME].")
@click.option("--metrics", type=click.Path(dir_okay=False),
              help="Summary JSON [artifacts/metrics/eval/NAME.json; with --out: OUT.json].")
@click.option("--retain-results", type=click.Path(),
              help="The retain model's evaluation, for forget quality: the --out of its evaluation (the same as "
                   "--out when NAME is the retain model), or open-unlearning's TOFU_EVAL.json of it (the file or "
                   "its directory). Left out: no forget quality.")
@click.option("--headline", type=click.Path(dir_okay=False),
              help="Also write the few headline numbers here (the DVC metrics file `dvc metrics show` lists).")
def command(name, params: dict, model_path, out, metrics, retain_results, headline) -> None:
    """Evaluate model NAME (or each seed of run NAME) on the TOFU sets and the multiple-choice sets (params:
    evaluate, data); the output directory also holds open-unlearning's TOFU_EVAL.json and TOFU_SUMMARY.json."""
    cfg = eval_config(params)
    out_dir = Path(out or f"artifacts/eval/{name}")
    metrics_file = Path(metrics or (f"{out}.json" if out else f"artifacts/metrics/eval/{name}.json"))
    with hold_outputs(out_dir):
        summary = evaluate_path(model_path, cfg, out_dir, Path(retain_results) if retain_results else None,
                                metrics_file, name)
        if headline:
            write_strict_json(headline, headline_metrics(summary))
    log.info("evaluate %s: %s; wrote %s", name, _headline(summary), metrics_file)


def _headline(summary: dict) -> str:
    """forget ES, model utility and log10 forget quality, or MUSE's VerbMem, KnowMem and PrivLeak (mean ± std over
    the seeds of a run)."""
    several = len(summary.get("seeds", [])) > 1  # one seed has no spread to show
    parts = [f"{label(key)} {summary[key]:.3f}" + (f" ± {summary[key + '_std']:.3f}" if several else "")
             for key in ("forget_es", "model_utility", "log10_forget_quality", *HEADLINE_MUSE)
             if isinstance(summary.get(key), (int, float))]
    if several:
        parts.append(f"{len(summary['seeds'])} seeds")
    return ", ".join(parts)


@click.command("export-open-unlearning")
@click.argument("eval_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--out", type=click.Path(file_okay=False),
              help="Output directory [EVAL_DIR]; an unlearning run's seeds go to OUT/seed{S}/.")
def export_command(eval_dir, out) -> None:
    """Write the evaluation in EVAL_DIR (the --out of `evaluate`) as open-unlearning's TOFU_EVAL.json and
    TOFU_SUMMARY.json (reads no params: the evaluation's items hold every value)."""
    out_dir = Path(out or eval_dir)
    with hold_outputs(out_dir):
        written = export_evaluation(Path(eval_dir), out_dir)
    log.info("export-open-unlearning: %s", ", ".join(map(str, written)))
