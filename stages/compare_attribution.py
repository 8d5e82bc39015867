"""Stage `compare-attribution`: choose the attribution variant on one world, report every variant on another."""

import json
import logging
from pathlib import Path

import click

from pipeline.attribution.quality import compare_variants
from pipeline.common.atomic import atomic_file, hold_outputs, write_json
from pipeline.common.errors import DataError

log = logging.getLogger(__name__)


def _quality(path: str) -> dict:
    try:
        quality = json.loads(Path(path).read_text())["quality"]
    except FileNotFoundError:
        raise DataError(f"{path}: file not found (the `attribute` stage's metrics)") from None
    except (json.JSONDecodeError, KeyError):
        raise DataError(f"{path}: not the metrics of an `attribute` stage (no 'quality')") from None
    if quality is None:
        raise DataError(f"{path}: its data has no fact annotations, so no attribution quality to compare")
    return quality


@click.command("compare-attribution")
@click.option("--choose", "choose", multiple=True, required=True, metavar="MODE=METRICS",
              help="The choice world's attribute metrics per mode, e.g. qa=artifacts/metrics/attribution.json.")
@click.option("--report", "report", multiple=True, required=True, metavar="MODE=METRICS",
              help="The held-out world's attribute metrics per mode.")
@click.option("--r", "r", type=click.FloatRange(0, 1, min_open=True), default=0.2, show_default=True,
              help="The top-r fraction the choice is made at.")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="The Markdown table.")
@click.option("--metrics", required=True, type=click.Path(dir_okay=False), help="The choice and its figures (JSON).")
def command(choose, report, r, out, metrics) -> None:
    """Pick a variant per mode on the choice world (highest top-r F1) and report all on the held-out world."""
    def pairs(values, option):
        out = {}
        for v in values:
            mode, sep, path = v.partition("=")
            if not sep or mode not in ("qa", "corpus"):
                raise click.BadParameter(f"{v!r}: expected MODE=METRICS with MODE qa or corpus", param_hint=option)
            out[mode] = _quality(path)
        return out

    chosen, held = pairs(choose, "--choose"), pairs(report, "--report")
    missing = sorted(set(held) - set(chosen))
    if missing:
        raise click.BadParameter(f"no choice world for mode(s) {missing}", param_hint="--choose")
    markdown, figures = compare_variants(chosen, held, r)
    with hold_outputs(out, metrics):
        with atomic_file(out) as f:
            f.write("# Attribution variants: chosen on one world, reported on a held-out world\n\n" + markdown)
        write_json(metrics, figures)
    log.info("wrote %s: %s", out, ", ".join(f"{m}: {v['chosen']}" for m, v in figures.items()))
