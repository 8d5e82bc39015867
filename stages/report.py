"""Stage `report`: the results table (Markdown, CSV) and plots over every evaluated model."""

import logging
from pathlib import Path

import click

from pipeline.common.atomic import hold_outputs
from pipeline.common.errors import ParamError
from pipeline.common.params import check_keys, section
from pipeline.studies.report import load_ablations, load_rows, missing_evaluations, missing_note, write_report
from pipeline.studies.significance import variant_pairs
from pipeline.studies.tradeoff import write_equal_utility
from pipeline.training.unlearn import run_spec

from .muse_report import write_muse_table
from .options import params_options

log = logging.getLogger(__name__)


@click.command("report")
@params_options
@click.option("--benchmark", type=click.Choice(["tofu", "muse"]), default="tofu", show_default=True,
              help="TOFU's table (the summaries in --metrics-dir) or MUSE's (the evaluations in --eval-dir).")
@click.option("--metrics-dir", default="artifacts/metrics/eval", show_default=True, type=click.Path(file_okay=False),
              help="The evaluation summaries, NAME.json for target, retain and each unlearning run.")
@click.option("--eval-dir", default="artifacts/muse/eval", show_default=True, type=click.Path(file_okay=False),
              help="MUSE's: the evaluations (`evaluate-muse`, or `evaluate` with evaluate.muse), NAME/ for target, "
                   "retain and each run.")
@click.option("--out", type=click.Path(file_okay=False),
              help="results.md, results.csv and the PNG plots [artifacts/report; MUSE's: artifacts/muse/report].")
@click.option("--plots", default="artifacts/plots/report", show_default=True, type=click.Path(file_okay=False),
              help="The plots' data as CSV, for `dvc plots show`.")
@click.option("--relearn-dir", type=click.Path(file_okay=False),
              help="The relearning attack's summaries, NAME.json where present [beside --metrics-dir: "
                   "artifacts/metrics/relearn].")
@click.option("--tuning", type=click.Path(exists=True, file_okay=False),
              help="The runs' tunings, RUN/choice.json (stage tune@RUN): adds each run at equal utility, read on its "
                   "trade-off curve, and the curves' plots [none].")
def command(params: dict, benchmark, metrics_dir, eval_dir, out, plots, relearn_dir, tuning) -> None:
    """Results table and plots of the target, the retain model and the runs of report.table that are evaluated
    (the others are named in results.md); the target's and the retain model's evaluations are required. MUSE's
    table (`--benchmark muse`): VerbMem, KnowMem forget and retain, PrivLeak, every run of report.table."""
    if benchmark == "muse":
        write_muse_table(params, Path(eval_dir), Path(out or "artifacts/muse/report"))
        return
    out = out or "artifacts/report"
    check_keys(section(params, "report"), ("table", "ablations"), "report")
    runs, table = section(params, "unlearn.runs"), section(params, "report.table")
    ablations = section(params, "report.ablations") or {}
    unknown = [n for n in table if n not in runs]
    if unknown:
        raise ParamError(f"report.table: {unknown} are not runs of unlearn.runs")
    specs = {name: run_spec(params, name) for name in runs}
    metrics_dir = Path(metrics_dir)
    relearn_dir = Path(relearn_dir) if relearn_dir else metrics_dir.parent / "relearn"
    rows = load_rows(metrics_dir, {n: specs[n] for n in table}, relearn_dir)
    ablation_rows = load_ablations(metrics_dir, ablations, specs)
    missing = missing_evaluations(metrics_dir, [*table, *(n for names in ablations.values() for n in names)])
    if missing:
        log.warning("%s", missing_note(missing))
    with hold_outputs(out, plots):
        equal = write_equal_utility(Path(tuning), table, specs, {r.name: r.label for r in rows},
                                    variant_pairs(specs, table), Path(out), Path(plots)) if tuning else ""
        write_report(rows, Path(out), Path(plots), ablation_rows, missing, equal)
    log.info("report of %d models in %s/results.md", len(rows), out)
