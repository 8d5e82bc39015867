"""MUSE's table of the target, the retain model and each run (`report --benchmark muse`, also named `muse-report`)
and stage `muse-series` (MUSE's metrics over sequential requests and forget-set sizes), from MUSE evaluations."""

import logging
from pathlib import Path

import click

from pipeline.common.atomic import hold_outputs
from pipeline.common.params import section
from pipeline.data.muse_requests import load_requests
from pipeline.studies.muse_report import (Entry, read_muse_summary, read_series_spec, series_points,
                                            write_muse_report, write_series_report)
from pipeline.studies.report import paper_name

from .options import params_options

log = logging.getLogger(__name__)


def _label(params: dict, run: str) -> str:
    spec = section(params, f"unlearn.runs.{run}")
    return paper_name(spec["method"], spec["weighting"])


def write_muse_table(params: dict, eval_dir: Path, out: Path) -> None:
    """MUSE's table of the target, the retain model and each run of `report.table`, from their evaluations in
    `eval_dir` (NAME/metrics.json): OUT/results.md, results.csv."""
    entries = [Entry("target", "before unlearning", read_muse_summary(eval_dir / "target")),
               Entry("retain", "retain model", read_muse_summary(eval_dir / "retain"))]
    entries += [Entry(run, _label(params, run), read_muse_summary(eval_dir / run))
                for run in section(params, "report.table")]
    with hold_outputs(out):
        table = write_muse_report(entries, out, "MUSE on the embedded world")
    log.info("report (MUSE): wrote %s\n%s", out, table)


@click.command("muse-report")
@params_options
@click.option("--eval-dir", default="artifacts/muse/eval", show_default=True, type=click.Path(file_okay=False),
              help="The MUSE evaluations: target/, retain/ and one per run of report.table.")
@click.option("--out", default="artifacts/muse/report", show_default=True, type=click.Path(file_okay=False))
def report_command(params: dict, eval_dir, out) -> None:
    """`tokenunlearn report --benchmark muse`: MUSE's table (VerbMem, KnowMem forget and retain, PrivLeak) of the
    target, the retain model and each run of `report.table`: OUT/results.md, results.csv."""
    write_muse_table(params, Path(eval_dir), Path(out))


@click.command("muse-series")
@params_options
@click.option("--spec", default="configs/sequential.yaml", show_default=True, type=click.Path(dir_okay=False),
              help="The series: a YAML file with a `sequential` section (runs, requests, sizes, chain).")
@click.option("--corpora", default="artifacts/sequential/corpora", show_default=True,
              type=click.Path(file_okay=False), help="The muse-corpora --requests output.")
@click.option("--eval-dir", default="artifacts/sequential/eval", show_default=True, type=click.Path(file_okay=False),
              help="The evaluate-muse outputs of the series' runs, one per run name.")
@click.option("--target-eval", default="artifacts/muse/eval/target", show_default=True, type=click.Path())
@click.option("--retain-eval", default="artifacts/muse/eval/retain", show_default=True, type=click.Path())
@click.option("--out", default="artifacts/sequential/report", show_default=True, type=click.Path(file_okay=False))
def series_command(params: dict, spec, corpora, eval_dir, target_eval, retain_eval, out) -> None:
    """MUSE's metrics over sequential requests (`sequential.chain` of --spec) and forget-set sizes
    (`sequential.sizes`), one line per run of `sequential.runs` (labelled as `unlearn.runs` of the params say):
    OUT/results.md, sequential.csv, size.csv and their plots."""
    requests = load_requests(corpora)
    spec = read_series_spec(Path(spec))
    labels = {run: _label(params, run) for run in spec["runs"]}
    sequential, sizes = series_points(spec, labels, requests, Path(eval_dir), Path(target_eval))
    with hold_outputs(out):
        write_series_report(sequential, sizes, requests, Path(retain_eval), Path(out))
    log.info("muse-series: wrote %s", out)


commands = (report_command, series_command)
