"""The table over model seeds, and whether a variant's difference from its method survives them.

One unlearning result depends on two seeds: the model seed (the base, target and retain models, and so the
attribution and the tuned learning rate) and the unlearning seed (data order, RMU's vector). A spread over
unlearning seeds on one set of models leaves out the larger source, so here every figure is over both: the main
table gives the mean over all (model seed, unlearning seed) cells, the spread between model seeds (of their means)
and within them (the mean of their standard deviations). A variant − method difference is paired on the same
model seed and unlearning seed, and its confidence interval comes from a two-level bootstrap (model seeds drawn
with replacement, then unlearning seeds within each), at a family-wise confidence: each interval at
1 − (1 − confidence) / (number of comparisons), Bonferroni's correction. With few model seeds the bootstrap over
them is coarse (three seeds: ten distinct draws), so a verdict also asks that every model seed agree in sign.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.common.errors import DataError
from pipeline.evaluation.eval_io import read_json
from pipeline.evaluation.registry import SEEDS, columns
from pipeline.studies.report import check_summary

# The columns (pipeline/evaluation/registry.py): the paper's Table 1 and the world's multiple choice, forget and retain
# authors; each compared in its direction (`better`: +1 higher, −1 lower).
COLUMNS = columns(SEEDS)


@dataclass
class Cells:
    """One model's metric values, `values[key]`: an array [model seed, unlearning seed] (NaN where missing)."""
    name: str
    values: dict


def load_cells(root: Path, model_seeds: list[int], runs: list[str], unlearn_seeds: list[int],
               models_root: Path | None = None) -> dict[str, Cells]:
    """Every run's per-seed evaluation, `root/m{M}/eval/RUN/seed{S}/metrics.json`, and the target's and retain
    model's (`models_root/m{M}/eval/{target,retain}/metrics.json`, one value per model seed; `models_root`: `root`
    unless the runs reuse another experiment's models); an error names a missing file."""
    keys = [m.key for m in COLUMNS]
    cells = {}
    for name in ["target", "retain", *runs]:
        per_run = name not in ("target", "retain")
        seeds = unlearn_seeds if per_run else [None]
        values = {k: np.full((len(model_seeds), len(seeds)), np.nan) for k in keys}
        for i, m in enumerate(model_seeds):
            for j, s in enumerate(seeds):
                base = root if per_run else (models_root or root)
                file = base / f"m{m}" / "eval" / name / (f"seed{s}" if per_run else "") / "metrics.json"
                if not file.is_file():
                    raise DataError(f"{file}: no evaluation of '{name}' for model seed {m}"
                                    + (f", unlearning seed {s}" if per_run else "")
                                    + " (run `make seeds`, or `dvc repro seeds/dvc.yaml` in experiments/)")
                summary = check_summary(read_json(file, "evaluation summary"), file)
                for k in keys:
                    if isinstance(summary.get(k), (int, float)):
                        values[k][i, j] = summary[k]
        cells[name] = Cells(name, values)
    return cells


def spread(values: np.ndarray) -> dict:
    """Mean over every cell, the standard deviation between model seeds (of their means) and within them (the mean
    of each model seed's standard deviation over unlearning seeds), and the standard deviation over all cells."""
    if np.isnan(values).all():
        return {}
    per_model = np.nanmean(values, axis=1)
    within = np.nanstd(values, axis=1, ddof=1) if values.shape[1] > 1 else np.zeros(len(values))
    return {"mean": float(np.nanmean(values)),
            "between": float(np.std(per_model, ddof=1)) if len(per_model) > 1 else 0.0,
            "within": float(np.nanmean(within)),
            "all": float(np.nanstd(values, ddof=1)) if values.size > 1 else 0.0,
            "per_model": [float(v) for v in per_model]}


def hierarchical_bootstrap(diffs: np.ndarray, samples: int, rng: np.random.Generator) -> np.ndarray:
    """Bootstrap means of a [model seed, unlearning seed] array: draw model seeds with replacement, then, within
    each drawn model seed, its unlearning seeds with replacement; the mean of the drawn cells, `samples` times."""
    n_models, n_seeds = diffs.shape
    models = rng.integers(0, n_models, size=(samples, n_models))
    seeds = rng.integers(0, n_seeds, size=(samples, n_models, n_seeds))
    drawn = diffs[models[:, :, None], seeds]
    return drawn.reshape(samples, -1).mean(axis=1)


def compare(variant: np.ndarray, base: np.ndarray, better: int, level: float, samples: int,
            rng: np.random.Generator) -> dict:
    """Variant − base, paired cell by cell: the mean, the `level` bootstrap interval, each model seed's mean
    difference, and a verdict: `better` or `worse` (in the column's direction) when the interval excludes zero and
    every model seed's difference has its sign, else `undecided`."""
    diffs = variant - base
    if np.isnan(diffs).any():
        return {}
    boot = hierarchical_bootstrap(diffs, samples, rng)
    tail = (1 - level) / 2
    lo, hi = (float(v) for v in np.quantile(boot, [tail, 1 - tail]))
    per_model = diffs.mean(axis=1)
    mean = float(diffs.mean())
    verdict = "undecided"
    if (lo > 0 or hi < 0) and (np.all(per_model > 0) or np.all(per_model < 0)):
        verdict = "better" if mean * better > 0 else "worse"
    return {"mean": mean, "lo": lo, "hi": hi, "per_model": [float(v) for v in per_model], "verdict": verdict}


def variant_pairs(runs: dict[str, dict], names: list[str]) -> list[tuple[str, str]]:
    """(variant, its method's sequence-level run) for each token-level run of `names` (`runs`: resolved specs
    with method and weighting) whose uniform run is also in `names`; then (variant, its random control) for each
    token-level run whose same run but for `score: random` (the same token budget, blind tokens) is in `names`:
    whether the attribution, not only the concentration of the push, makes the difference."""
    uniform = {runs[n]["method"]: n for n in names if runs[n]["weighting"] == "uniform"}
    to_method = [(n, uniform[runs[n]["method"]]) for n in names
                 if runs[n]["weighting"] != "uniform" and runs[n]["method"] in uniform]

    def budget(n):  # what a run is but for its score and its rate (each run's rate is its own bisection's)
        return tuple(sorted((k, repr(v)) for k, v in runs[n].items() if k not in ("score", "train")))
    token_level = [n for n in names if runs[n]["weighting"] != "uniform"]
    controls = {budget(n): n for n in token_level if runs[n].get("score") == "random"}
    to_random = [(n, controls[budget(n)]) for n in token_level
                 if runs[n].get("score") != "random" and budget(n) in controls]
    return to_method + to_random


def comparisons_heading(runs: dict[str, dict], pairs: list[tuple[str, str]]) -> str:
    """The comparisons' section title: it names the random controls where `pairs` has them."""
    against_random = any(runs[b].get("score") == "random" for _, b in pairs)
    return "Token level against sequence level" + (
        ", and each attribution against random tokens at its budget" if against_random else "")


def comparisons(cells: dict[str, Cells], pairs: list[tuple[str, str]], confidence: float, samples: int,
                seed: int) -> tuple[list[dict], float]:
    """Every pair × column with values: the comparisons and the per-interval level (Bonferroni over them)."""
    todo = [(v, b, m.key, m.better) for v, b in pairs for m in COLUMNS
            if not np.isnan(cells[v].values[m.key]).all() and not np.isnan(cells[b].values[m.key]).all()]
    level = 1 - (1 - confidence) / max(len(todo), 1)
    rng = np.random.default_rng(seed)
    out = []
    for v, b, key, better in todo:
        result = compare(cells[v].values[key], cells[b].values[key], better, level, samples, rng)
        if result:
            out.append({"variant": v, "base": b, "key": key, **result})
    return out, level


def _cell(s: dict) -> str:
    if not s:
        return "–"
    return f"{s['mean']:.3f} ± {s['between']:.3f} / {s['within']:.3f}"


def main_table(cells: dict[str, Cells], labels: dict[str, str]) -> tuple[str, str]:
    """(Markdown, CSV): per model the mean over every (model seed, unlearning seed) cell ± the spread between
    model seeds / within them."""
    keys = [(m.key, m.title) for m in COLUMNS if any(not np.isnan(c.values[m.key]).all() for c in cells.values())]
    lines = ["| model | run | " + " | ".join(t for _, t in keys) + " |", "|" + "---|" * (len(keys) + 2)]
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["run", "label"] + [f"{k}_{part}" for k, _ in keys for part in ("mean", "between", "within")])
    for name, c in cells.items():
        stats = [spread(c.values[k]) for k, _ in keys]
        lines.append(f"| {labels.get(name, name)} | {name} | " + " | ".join(_cell(s) for s in stats) + " |")
        writer.writerow([name, labels.get(name, name)]
                        + [("" if not s else round(s[part], 6)) for s in stats for part in ("mean", "between", "within")])
    return "\n".join(lines) + "\n", buffer.getvalue()


def comparison_table(results: list[dict], labels: dict[str, str], level: float) -> tuple[str, str]:
    """(Markdown, CSV) of the comparisons: per pair a row, per column the mean difference, its interval and a
    mark (▲ better, ▼ worse, none: undecided)."""
    keys = [(m.key, m.title) for m in COLUMNS if any(r["key"] == m.key for r in results)]
    pairs = list(dict.fromkeys((r["variant"], r["base"]) for r in results))
    by = {(r["variant"], r["base"], r["key"]): r for r in results}
    mark = {"better": " ▲", "worse": " ▼", "undecided": ""}
    lines = [f"Each cell: mean difference [{level:.4%} bootstrap interval]; ▲ better, ▼ worse in every model seed and "
             "beyond the interval; no mark: undecided.", "",
             "| variant − method | " + " | ".join(t for _, t in keys) + " |", "|" + "---|" * (len(keys) + 1)]
    for v, b in pairs:
        cells = []
        for k, _ in keys:
            r = by.get((v, b, k))
            cells.append("–" if r is None else f"{r['mean']:+.3f} [{r['lo']:+.3f}, {r['hi']:+.3f}]{mark[r['verdict']]}")
        lines.append(f"| {labels.get(v, v)} − {labels.get(b, b)} | " + " | ".join(cells) + " |")
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["variant", "base", "key", "mean", "lo", "hi", "verdict", "per_model"])
    for r in results:
        writer.writerow([r["variant"], r["base"], r["key"], round(r["mean"], 6), round(r["lo"], 6), round(r["hi"], 6),
                         r["verdict"], " ".join(f"{v:.6f}" for v in r["per_model"])])
    return "\n".join(lines) + "\n", buffer.getvalue()


def lr_table(root: Path, model_seeds: list[int], runs: list[str], labels: dict[str, str]) -> str:
    """Markdown: each run's bisected lr and the utility it reached, per model seed (tuning/RUN/choice.json)."""
    lines = ["| run | " + " | ".join(f"model seed {m}: lr (MU / floor, trials)" for m in model_seeds) + " |",
             "|" + "---|" * (len(model_seeds) + 1)]
    for name in runs:
        cells = []
        for m in model_seeds:
            file = root / f"m{m}" / "tuning" / name / "choice.json"
            if not file.is_file():
                cells.append("–")
                continue
            result = read_json(file, "tuning choice")
            try:
                entry = result["runs"][name]
                c = entry["chosen"]
                flag = "" if c.get("meets_floor", True) else ", below the floor"
                flag += "" if entry.get("converged", True) else ", not within tolerance"
                utility = c[result.get("utility", "model_utility")]  # tune.utility's key
                cells.append(f"{c['lr']:.2e} ({utility:.3f} / {result['utility_min']:.3f}, "
                             f"{len(entry['trials'])}{flag})")
            except (KeyError, TypeError, ValueError, AttributeError) as e:  # a key missing or of another type
                raise DataError(f"{file}: not the tuning choice of '{name}' (runs.{name}.chosen.lr, its utility, "
                                f"trials and utility_min expected; {type(e).__name__}: {e})") from None
        lines.append(f"| {labels.get(name, name)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"



MEMORISED_ES = 0.95  # a target "memorised" its forget set when its forget extraction strength reaches this


def models_table(root: Path, model_seeds: list[int]) -> str:
    """Markdown: each model seed's target and retain model before unlearning: where finetuning stopped and why
    (models/NAME/finetune.json), the target's loss, forget ES and MU, and whether it memorised (forget ES ≥
    MEMORISED_ES); '–' for what a partial sweep has not made yet."""
    def record(m: int, name: str) -> tuple[dict, dict]:
        files = (root / f"m{m}" / "models" / name / "finetune.json", root / f"m{m}" / "eval" / name / "metrics.json")
        return tuple(read_json(f, what) if f.is_file() else {}
                     for f, what in zip(files, ("finetune record", "evaluation summary")))

    def num(d: dict, key: str, fmt: str) -> str:
        return format(d[key], fmt) if isinstance(d.get(key), (int, float)) else "–"

    lines = [f"| model seed | target: stopped by (epochs) | last epoch loss | forget ES | MU | memorised (forget ES ≥ "
             f"{MEMORISED_ES}) | retain model: stopped by (epochs) | last epoch loss | MU |", "|---" * 9 + "|"]
    for m in model_seeds:
        (t_run, t_eval), (r_run, r_eval) = record(m, "target"), record(m, "retain")
        es = t_eval.get("forget_es")
        memorised = "–" if not isinstance(es, (int, float)) else ("yes" if es >= MEMORISED_ES else "**no**")
        lines.append(f"| {m} | {t_run.get('stopped_by', '–')} ({num(t_run, 'epochs', 'g')}) | "
                     f"{num(t_run, 'last_epoch_loss', '.4f')} | {num(t_eval, 'forget_es', '.3f')} | "
                     f"{num(t_eval, 'model_utility', '.3f')} | {memorised} | {r_run.get('stopped_by', '–')} "
                     f"({num(r_run, 'epochs', 'g')}) | {num(r_run, 'last_epoch_loss', '.4f')} | "
                     f"{num(r_eval, 'model_utility', '.3f')} |")
    return "\n".join(lines) + "\n"
