"""The results table and plots, from the evaluation summaries of the models.

Columns are the paper's Table 1 (retain ES, forget ES, model utility, log10 forget quality) and its Table 2
(multiple-choice accuracies) where evaluated; one row per model, "before unlearning" (the target) and the retain
model first, as mean ± standard deviation over seeds where there are several. A second table sets each token-level
variant against its sequence-level method, and a run weighted by another attribution score than φ against the same
run with φ, and marks the differences larger than the two spreads together.
Plots: forget quality against model utility per method, forget and retain ES per method, and the ablations
(metrics against r, and against 1 − α).
A sweep still under way gets a report of the runs evaluated so far: the others are named, with the command that
makes them; only the target and the retain model (and at least one run) are required.
"""

from __future__ import annotations

import csv
import io
import logging
import math
from dataclasses import dataclass
from pathlib import Path

from pipeline.common.atomic import atomic_file
from pipeline.common.errors import DataError
from pipeline.common.plots import pyplot, save_figure
from pipeline.evaluation.eval_io import number, read_json
from pipeline.evaluation.registry import (FAMILIES, MAIN, ROBUSTNESS, Metric, columns, family_columns, metric,
                                          value_range)
from pipeline.training.methods import METHODS

log = logging.getLogger(__name__)

# The columns (pipeline/evaluation/registry.py): the paper's Table 1, then one per `mc_*` and one per `lmeval_*` key
# found (the families); and whether it is forgotten or only hidden (evaluate.mia, paraphrase, quantize; the relearn
# stages as `relearn_*`), where evaluated.
COLUMNS = columns(MAIN)
ROBUSTNESS_COLUMNS = columns(ROBUSTNESS)
WEIGHTING_PREFIX = {"uniform": "", "hard": "T-", "soft": "S-", "proportional": "P-"}
# The two models every report needs: their label and the DVC stage that evaluates them.
REFERENCE_MODELS = {"target": ("before unlearning", "evaluate_target"), "retain": ("retain model", "evaluate_retain")}


@dataclass
class Row:
    name: str
    label: str          # "before unlearning", "retain model", or the paper's name (T-NPO, S-GA, ...)
    method: str         # the base method, "" for the two reference models
    weighting: str
    summary: dict
    score: str = "phi"  # the attribution variant its token weights come from (uniform runs: none, "phi")


def paper_name(method: str, weighting: str) -> str:
    """The paper's label of a run: its weighting's prefix and the method's name as its authors write it (its record's
    `title`), e.g. T-SimNPO."""
    title = METHODS[method].title if method in METHODS else ""
    return f"{WEIGHTING_PREFIX.get(weighting, weighting + '-')}{title or method.upper()}"


def run_row(name: str, spec: dict, summary: dict) -> Row:
    """A run's row from its flat spec (`unlearn.runs.NAME` over its method, weighting and the defaults)."""
    method, weighting = spec.get("method", "ga"), spec.get("weighting", "uniform")
    score = spec.get("score", "phi") if weighting != "uniform" else "phi"
    label = paper_name(method, weighting) + (f" [{score}]" if score != "phi" else "")
    return Row(name, label, method, weighting, summary, score)


# log10 forget quality where the p-value underflowed to 0: tofu_metrics.MIN_PVALUE's log10 (−323.3); an evaluation
# written before that floor has -Infinity there, read as the floor.
LOG10_FQ_FLOOR = math.log10(math.ulp(0.0))


def _reported(key: str) -> bool:
    """Whether the report reads summary key `key` (a registered metric, a family's: a multiple-choice accuracy, an
    lm-eval metric or its stderr; or their _std)."""
    return metric(key.removesuffix("_std")) is not None


def check_summary(summary: dict, file: Path, prefix: str = "") -> dict:
    """The reported values of an evaluation summary checked (null or a finite number in range; `seeds` a list):
    a wrong type would crash the table, a NaN or an out-of-range value would show as a plausible number."""
    if summary.get("log10_forget_quality") == -math.inf:
        summary["log10_forget_quality"] = LOG10_FQ_FLOOR
    for key, value in summary.items():
        if _reported(key):  # named as in its file, without the prefix read_summary gives it
            number(value, f"{file}: {key.removeprefix(prefix)}", *value_range(key), nullable=True)
    if not isinstance(summary.get("seeds", []), list):
        raise DataError(f"{file}: seeds: {summary['seeds']!r} is not a list of seeds")
    return summary


def read_summary(metrics_dir: Path, name: str, relearn_dir: Path | None = None) -> dict:
    """`metrics_dir/NAME.json`, with the relearning attack's summary (`relearn_dir/NAME.json`, where there is one)
    as `relearn_*` keys; each checked (`check_summary`)."""
    file = metrics_dir / f"{name}.json"
    summary = check_summary(read_json(file, "evaluation summary"), file)
    if not any(_reported(k) and v is not None for k, v in summary.items()):
        known = ", ".join([m.key for m in COLUMNS] + [f"{f.prefix}*" for f in FAMILIES])
        raise DataError(f"{file}: none of the report's metrics ({known}): not a summary of `tokenunlearn evaluate`; "
                        f"evaluate '{name}' again")
    relearned = relearn_dir / f"{name}.json" if relearn_dir is not None else None
    if relearned is not None and relearned.is_file():
        summary |= check_summary({f"relearn_{k}": v for k, v in read_json(relearned, "relearning summary").items()
                                  if isinstance(v, (int, float)) and not isinstance(v, bool)}, relearned, "relearn_")
    return summary


def missing_evaluations(metrics_dir: Path, names) -> list[str]:
    """The runs of `names` with no evaluation yet (no `metrics_dir/NAME.json`), in order, each once."""
    return [n for n in dict.fromkeys(names) if not (metrics_dir / f"{n}.json").is_file()]


def missing_note(missing: list[str]) -> str:
    """One line naming the runs not evaluated yet, and the command that makes them."""
    return (f"Not evaluated yet, so not in this report: {', '.join(missing)}; make them with "
            f"`dvc repro {' '.join(f'evaluate@{n}' for n in missing)}`.")


def load_rows(metrics_dir: Path, runs: dict[str, dict], relearn_dir: Path | None = None) -> list[Row]:
    """Target, retain, then each run of `runs` ({name: its flat spec}) that is evaluated, from
    `metrics_dir/NAME.json` (see `read_summary`). The target's and the retain model's evaluations are required,
    and at least one run's (where `runs` names any); runs not evaluated yet are left out (`missing_evaluations`)."""
    rows = []
    for name, (label, stage) in REFERENCE_MODELS.items():
        if not (metrics_dir / f"{name}.json").is_file():
            raise DataError(f"{metrics_dir / f'{name}.json'}: no evaluation of '{name}' (make it with "
                            f"`dvc repro {stage}` or `tokenunlearn evaluate {name}`)")
        rows.append(Row(name, label, "", "", read_summary(metrics_dir, name, relearn_dir)))
    missing = missing_evaluations(metrics_dir, runs)
    evaluated = [n for n in runs if n not in missing]
    if runs and not evaluated:
        first = next(iter(runs))
        raise DataError(f"{metrics_dir / f'{first}.json'}: no evaluation of '{first}' nor of any other run of "
                        f"the report ({len(runs)} runs); make them with `dvc repro` or `tokenunlearn evaluate NAME`")
    return rows + [run_row(n, runs[n], read_summary(metrics_dir, n, relearn_dir)) for n in evaluated]


def _fmt(value, std=None) -> str:
    if value is None:
        return "–"
    if not (isinstance(value, float) and math.isfinite(value)):
        return str(value)
    return f"{value:.3f} ± {std:.3f}" if std else f"{value:.3f}"


def main_columns(rows: list[Row]) -> list[Metric]:
    """The paper's columns, then one per multiple-choice accuracy and one per lm-eval metric some row has."""
    return COLUMNS + family_columns(MAIN, (r.summary for r in rows))


def robustness_keys(rows: list[Row]) -> list[Metric]:
    """The robustness columns some row has; none where no attack ran (plain multiple choice is in the first
    table already)."""
    keys = [m for m in ROBUSTNESS_COLUMNS if any(r.summary.get(m.key) is not None for r in rows)]
    return keys if any(not m.key.startswith("mc_") for m in keys) else []


def results_table(rows: list[Row], keys: list[Metric] | None = None) -> tuple[str, str]:
    """(Markdown, CSV) of the results (`keys`: the paper's columns and the multiple-choice ones); the CSV has each
    column's standard deviation beside it."""
    keys = keys or main_columns(rows)
    header = ["model", "run"] + [m.title for m in keys]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["model", "run", "method", "weighting", "seeds"]
                    + [c for m in keys for c in (m.key, f"{m.key}_std")])
    for r in rows:
        values = [(r.summary.get(m.key), r.summary.get(f"{m.key}_std")) for m in keys]
        lines.append("| " + " | ".join([r.label, r.name] + [_fmt(v, sd) for v, sd in values]) + " |")
        writer.writerow([r.label, r.name, r.method, r.weighting, len(r.summary.get("seeds", [0]))]
                        + ["" if v is None else v for pair in values for v in pair])
    return "\n".join(lines) + "\n", buffer.getvalue()


def comparison_table(rows: list[Row], keys: list[Metric] | None = None) -> str:
    """Token-level minus sequence-level per method and column, and another attribution score minus φ for the
    same method and weighting (Markdown); `*` marks a difference larger than the two standard deviations added,
    the spread over seeds. With one seed there is no spread to compare with, so nothing is marked. A variant
    whose baseline is not among the rows is named in a sentence after the table (instead of the table, where no
    variant has its baseline)."""
    keys = keys or main_columns(rows)
    by_run = {(r.method, r.weighting, r.score): r for r in rows if r.method}
    lines = ["| variant − baseline | " + " | ".join(c.title for c in keys) + " |", "|" + "---|" * (len(keys) + 1)]
    pairs = [(row, (m, "uniform", "phi")) for (m, w, _), row in by_run.items() if w != "uniform"]
    pairs += [(row, (m, w, "phi")) for (m, w, score), row in by_run.items() if score != "phi"]
    unmatched = []
    for row, (m, w, _) in pairs:
        base = by_run.get((m, w, "phi"))
        if base is None:
            unmatched.append(f"{row.label} (against {paper_name(m, w)})")
            continue
        cells = []
        has_spread = min(len(row.summary.get("seeds", ())), len(base.summary.get("seeds", ()))) >= 2
        for column in keys:
            a, b = row.summary.get(column.key), base.summary.get(column.key)
            if a is None or b is None:
                cells.append("–")
                continue
            spread = (row.summary.get(f"{column.key}_std") or 0) + (base.summary.get(f"{column.key}_std") or 0)
            cells.append(f"{a - b:+.3f}{' *' if has_spread and abs(a - b) > spread else ''}")
        lines.append(f"| {row.label} − {base.label} | " + " | ".join(cells) + " |")
    if not pairs:
        return "No token-level run or other attribution score among the evaluated runs: nothing to compare.\n"
    table = "\n".join(lines) + "\n" if len(lines) > 2 else ""
    if not unmatched:
        return table
    note = f"No comparison for {', '.join(unmatched)}: the baseline is not among the evaluated runs.\n"
    return f"{table}\n{note}" if table else note


@dataclass
class Ablation:
    name: str            # r or alpha
    axis: str            # the plotted x: r, or 1 − α
    points: list         # [(x, Row)], sorted by x


ABLATION_AXES = {"r": ("r", lambda spec: spec["r"]), "alpha": ("1 − α", lambda spec: round(1 - spec["alpha"], 6))}


def load_ablations(metrics_dir: Path, ablations: dict[str, list[str]], runs: dict[str, dict]) -> list[Ablation]:
    """Each ablation of `report.ablations` over its evaluated runs (`runs`: every run's flat spec); one with fewer
    than 2 evaluated runs is left out, with a log line."""
    out = []
    for name, names in ablations.items():
        if name not in ABLATION_AXES:
            raise DataError(f"report.ablations.{name}: unknown (choose from {sorted(ABLATION_AXES)})")
        unknown = [n for n in names if n not in runs]
        if unknown:
            raise DataError(f"report.ablations.{name}: {unknown} are not runs of unlearn.runs")
        axis, value = ABLATION_AXES[name]
        missing = missing_evaluations(metrics_dir, names)
        evaluated = [n for n in names if n not in missing]
        if len(evaluated) < 2:
            log.warning("ablation of %s skipped: %d of its %d runs evaluated (not yet: %s)", axis, len(evaluated),
                        len(names), ", ".join(missing))
            continue
        rows = [run_row(n, runs[n], read_summary(metrics_dir, n)) for n in evaluated]
        points = sorted(((value(runs[r.name]), r) for r in rows), key=lambda p: p[0])
        out.append(Ablation(name, axis, points))
    return out


def ablation_csv(ablation: Ablation) -> str:
    buffer = io.StringIO()
    w = csv.writer(buffer, lineterminator="\n")
    w.writerow([ablation.name, "run"] + [c for m in COLUMNS for c in (m.key, f"{m.key}_std")])
    for x, r in ablation.points:
        w.writerow([x, r.name] + [r.summary.get(c) for m in COLUMNS for c in (m.key, f"{m.key}_std")])
    return buffer.getvalue()


def plot_ablation(ablation: Ablation, path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(COLUMNS), figsize=(4 * len(COLUMNS), 3.4))
    xs = [x for x, _ in ablation.points]
    for ax, m in zip(axes, COLUMNS):
        ys = [r.summary.get(m.key) for _, r in ablation.points]
        errs = [r.summary.get(f"{m.key}_std") or 0 for _, r in ablation.points]
        ax.errorbar(xs, ys, yerr=errs, marker="o", capsize=3)
        ax.set_xlabel(ablation.axis)
        ax.set_title(m.title)
    fig.suptitle(f"{ablation.points[0][1].label}: ablation of {ablation.axis} (mean ± std over seeds)")
    save_figure(fig, path)


def plot_tables(rows: list[Row]) -> dict[str, str]:
    """CSV data of the plots (DVC plots read them): FQ against MU, and ES per model."""
    tradeoff = io.StringIO()
    w = csv.writer(tradeoff, lineterminator="\n")
    w.writerow(["model", "method", "weighting", "model_utility", "log10_forget_quality"])
    es = io.StringIO()
    e = csv.writer(es, lineterminator="\n")
    e.writerow(["model", "forget_es", "retain_es"])
    for r in rows:
        w.writerow([r.label, r.method or r.name, r.weighting or "reference", r.summary.get("model_utility"),
                    r.summary.get("log10_forget_quality")])
        e.writerow([r.label, r.summary.get("forget_es"), r.summary.get("retain_es")])
    return {"tradeoff.csv": tradeoff.getvalue(), "extraction_strength.csv": es.getvalue()}


def plot_png(rows: list[Row], out_dir: Path) -> None:
    """forget_quality_vs_utility.png and extraction_strength.png."""
    plt = pyplot()
    markers = {"uniform": "o", "hard": "^", "soft": "s", "proportional": "D", "": "*"}
    fig, ax = plt.subplots(figsize=(7, 5))
    for r in rows:
        mu, fq = r.summary.get("model_utility"), r.summary.get("log10_forget_quality")
        if mu is None or fq is None:
            continue
        ax.scatter(mu, fq, marker=markers.get(r.weighting, "o"), s=60)
        ax.annotate(r.label, (mu, fq), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("model utility")
    ax.set_ylabel("log10 forget quality")
    ax.set_title("Forget quality against model utility (o sequence, ^ hard, s soft)")
    save_figure(fig, out_dir / "forget_quality_vs_utility.png")

    fig, ax = plt.subplots(figsize=(max(7, 0.45 * len(rows)), 4.5))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r.summary.get("forget_es") or 0 for r in rows], width=0.4, label="forget ES")
    ax.bar([i + 0.2 for i in x], [r.summary.get("retain_es") or 0 for r in rows], width=0.4, label="retain ES")
    ax.set_xticks(list(x), [r.label for r in rows], rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("extraction strength")
    ax.legend()
    save_figure(fig, out_dir / "extraction_strength.png")


def relearning_csv(rows: list[Row]) -> str:
    """Forget ES on the rows no attack saw, before and after each relearning attack: the plot's data."""
    buffer = io.StringIO()
    w = csv.writer(buffer, lineterminator="\n")
    w.writerow(["model", "run", "before", "relearned_on_forget", "relearned_on_retain"])
    for r in rows:
        values = [r.summary.get(f"relearn_{k}_forget_es") for k in ("before", "forget", "retain")]
        if values[0] is not None:
            w.writerow([r.label, r.name] + values)
    return buffer.getvalue()


def plot_relearning(rows: list[Row], path: Path) -> None:
    """relearning.png: per model, forget ES before and after relearning (mean ± std over seeds)."""
    rows = [r for r in rows if r.summary.get("relearn_before_forget_es") is not None]
    if not rows:
        return
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(7, 0.5 * len(rows)), 4.5))
    bars = [("before", "before"), ("forget", "relearned on a forget slice"), ("retain", "relearned on retain data")]
    for j, (key, label) in enumerate(bars):
        ys = [r.summary.get(f"relearn_{key}_forget_es") or 0 for r in rows]
        errs = [r.summary.get(f"relearn_{key}_forget_es_std") or 0 for r in rows]
        ax.bar([i + (j - 1) * 0.27 for i in range(len(rows))], ys, width=0.27, yerr=errs, capsize=2, label=label)
    ax.set_xticks(list(range(len(rows))), [r.label for r in rows], rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("forget ES on rows no attack saw")
    ax.set_title("Relearning attack: forget extraction strength before and after")
    ax.legend(fontsize=8)
    save_figure(fig, path)


def write_report(rows: list[Row], out_dir: Path, plots_dir: Path, ablations: list[Ablation] = (),
                 missing: list[str] = (), equal_utility: str = "") -> None:
    """results.md (its first line naming the `missing` runs, where some are not evaluated yet; `equal_utility`,
    the runs at equal utility, after the table), results.csv and the plots of the rows and ablations; every output
    directory is made, whatever the rows."""
    out_dir.mkdir(parents=True, exist_ok=True)
    plots_dir.mkdir(parents=True, exist_ok=True)
    markdown, table_csv = results_table(rows)
    robust = robustness_keys(rows)
    with atomic_file(out_dir / "results.md") as f:
        if missing:
            f.write(f"{missing_note(missing)}\n\n")
        f.write(markdown)
        if equal_utility:
            f.write(f"\n{equal_utility}")
        f.write("\nToken level against sequence level (`*`: larger than the two standard deviations added; "
                "never with one seed):\n\n")
        f.write(comparison_table(rows))
        if robust:
            f.write("\nIs it forgotten or only hidden (privleak against the retain model; forget ES on TOFU's "
                    "paraphrased questions, after rounding the weights to 8 and 4 bits, and, on the forget rows no "
                    "attack trained on, before and after a few relearning steps; forget-author multiple choice in "
                    "both scorings, after 4-bit rounding and after relearning on the forget slice):\n\n")
            f.write(results_table(rows, robust)[0])
            f.write("\nThe same, token level against sequence level:\n\n")
            f.write(comparison_table(rows, robust))
        for ablation in ablations:
            table, _ = results_table([Row(r.name, f"{r.label}, {ablation.axis} = {x}", r.method, r.weighting,
                                          r.summary) for x, r in ablation.points])
            f.write(f"\nAblation of {ablation.axis}:\n\n{table}")
    with atomic_file(out_dir / "results.csv") as f:
        f.write(table_csv)
    if robust:
        with atomic_file(out_dir / "robustness.csv") as f:
            f.write(results_table(rows, robust)[1])
        with atomic_file(plots_dir / "relearning.csv") as f:
            f.write(relearning_csv(rows))
        plot_relearning(rows, out_dir / "relearning.png")
    for name, text in plot_tables(rows).items():
        with atomic_file(plots_dir / name) as f:
            f.write(text)
    for ablation in ablations:
        with atomic_file(plots_dir / f"ablation_{ablation.name}.csv") as f:
            f.write(ablation_csv(ablation))
        plot_ablation(ablation, out_dir / f"ablation_{ablation.name}.png")
    plot_png(rows, out_dir)
