"""Each run's trade-off curve, compared as a curve rather than at one point.

A bisection onto the utility floor (`tokenunlearn tune`, `tune.search: bisect`) leaves its trials in
`m{SEED}/tuning/RUN/choice.json`: points (model utility, forget ES) of the run's trade-off curve on that model
seed, one per learning rate. The reported runs sit at one point of each curve, the chosen rate, which lands
anywhere within the bisection's tolerance above the floor; a variant that forgets less there may still forget more
a little below or above it. So here each curve is read at several utility levels around its model seed's floor
(forget ES interpolated between the two trials around each level), and each token-level variant is set against
its sequence-level method at every level: the mean difference over the model seeds where both curves reach it,
and how many of them have the variant lower (better). A sweep under way has some choice.json files missing: those
curves are left out, and a level a curve does not reach is left empty, never extrapolated.
"""

from __future__ import annotations

import csv
import io
import logging
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.common.atomic import atomic_file
from pipeline.common.errors import DataError
from pipeline.common.plots import pyplot, save_figure
from pipeline.evaluation.eval_io import number, read_json

log = logging.getLogger(__name__)

# Utility levels, as offsets from each model seed's floor. A converged bisection brackets the floor (its kept end
# within tune.bisect.tolerance, 0.005, above it and a trial below), so offset 0 is on every such curve. Its
# bracketing steps double or halve the rate, and a doubling near the floor moves MU by a few hundredths, so the
# trial past the floor usually lies more than 0.01 below it, and the trials before the kept end (when the start rate
# kept the floor by a margin) 0.01 to 0.02 above it. Further out only some curves reach: a two-trial bisection spans
# just its start and one doubling. The table counts the model seeds each cell rests on, so a level that too few
# curves reach shows as such.
LEVELS = (-0.01, 0.0, 0.01, 0.02)


@dataclass
class Curve:
    """One run's bisection on one model seed: its trials in lr order (lr, forget_es and the utility it was held to,
    `utility`: model_utility unless tune.utility chose another), the floor it bisected onto (`utility_min`) and the
    chosen trial (None when the file has none with numbers)."""
    run: str
    model_seed: int
    utility_min: float
    trials: list[dict]
    chosen: dict | None
    past: list[dict] = field(default_factory=list)  # the probes past the crossing (`past_crossing`) and below it
                                                    # (`below_crossing`), where tried
    utility: str = "model_utility"  # the summary key the floor is measured on (the tuning's tune.utility)

    @property
    def front(self) -> dict | None:
        """The run's best point over every trial it has: the lowest forget ES at utility ≥ the floor."""
        return front(self.trials + self.past, self.utility_min, self.utility)

    @property
    def recovers_at(self) -> list[float]:
        return recovers_at(self.trials + self.past, self.utility_min, self.utility)


def _point(trial, where: str, utility: str = "model_utility") -> dict | None:
    """A trial's (lr, forget_es, its `utility`) as floats, or None when it lacks one of them: such a trial is no
    point of the curve (a non-number is an error)."""
    keys = ("lr", "forget_es", utility)
    if not isinstance(trial, dict) or any(trial.get(k) is None for k in keys):
        return None
    return {k: number(trial[k], f"{where}.{k}") for k in keys}


def read_curve(file: Path, name: str, model_seed: int) -> Curve:
    """Run `name`'s curve from a tuning's choice.json (checked: a malformed one is a DataError naming it)."""
    result = read_json(file, "tuning choice")
    entry = (result.get("runs") or {}).get(name)
    if not isinstance(entry, dict) or not isinstance(entry.get("trials"), list):
        raise DataError(f"{file}: not the tuning choice of '{name}' (runs.{name}.trials expected)")
    utility = result.get("utility", "model_utility")  # tunings before tune.utility held model utility
    if not isinstance(utility, str):
        raise DataError(f"{file}: utility: {utility!r} is not a summary key")
    points = [_point(t, f"{file}: runs.{name}.trials[{i}]", utility) for i, t in enumerate(entry["trials"])]
    if None in points:
        log.warning("%s: %d of %d trials lack lr, forget_es or %s: left out of the curve", file,
                    points.count(None), len(points), utility)
    past = []
    for key in ("past_crossing", "below_crossing"):  # a tuning before the probes has none
        probes = entry.get(key) or []
        if not isinstance(probes, list):
            raise DataError(f"{file}: runs.{name}.{key}: {probes!r} is not a list of trials")
        past += [_point(t, f"{file}: runs.{name}.{key}[{i}]", utility) for i, t in enumerate(probes)]
    return Curve(name, model_seed, number(result.get("utility_min"), f"{file}: utility_min"),
                 sorted((p for p in points if p), key=lambda p: p["lr"]),
                 _point(entry.get("chosen"), f"{file}: runs.{name}.chosen", utility),
                 sorted((p for p in past if p), key=lambda p: p["lr"]), utility)


def load_curves(root: Path, model_seeds: list[int], runs: list[str],
                layout: str = "m{seed}/tuning/{run}/choice.json") -> dict[tuple[str, int], Curve]:
    """Every run's curve on every model seed, (run, model seed) -> Curve, from `root/m{M}/tuning/RUN/choice.json`
    (or `layout`: the demo's is `{run}/choice.json` under its tuning directory, one model);
    a missing file (a sweep under way) is skipped and counted in the log, a malformed one is a DataError."""
    curves, missing = {}, []
    for m in model_seeds:
        for name in runs:
            file = Path(root) / layout.format(seed=m, run=name)
            if not file.is_file():
                missing.append(f"m{m}/{name}")
                continue
            curves[(name, m)] = read_curve(file, name, m)
    if missing:
        log.info("trade-off curves: %d of %d bisections not there yet (%s)", len(missing),
                 len(model_seeds) * len(runs), ", ".join(missing[:10]) + (" …" if len(missing) > 10 else ""))
    return curves


def forget_es_at(trials: list[dict], utility: float, key: str = "model_utility") -> float | None:
    """Forget ES where the curve (trials in lr order) first falls to `utility`, interpolated linearly in utility
    between the two rates around it; None if it never gets there. Tuning reads it at the floor, the report at any
    level: unlike a chosen trial, it does not depend on where the grid's points fall; a model utility that is not
    monotone in the rate is read at its first crossing, as the bisection would find it. `key`: the trials'
    utility (tune.utility)."""
    trials = sorted(trials, key=lambda t: t["lr"])
    for a, b in zip(trials, trials[1:]):
        if a[key] >= utility > b[key]:
            w = (a[key] - utility) / (a[key] - b[key])
            return a["forget_es"] + w * (b["forget_es"] - a["forget_es"])
    return None


def front(trials: list[dict], utility_min: float, key: str = "model_utility") -> dict | None:
    """The run's best point over every trial it has, wherever it lies: the lowest forget ES at model utility ≥
    `utility_min` (ties: the higher utility, then the lower lr); None when no trial keeps the floor. Unlike the
    first crossing, it still finds a trade-off whose utility recovers at higher rates. `key`: the trials' utility."""
    kept = [t for t in trials if not t.get("diverged") and t[key] >= utility_min]
    if not kept:
        return None
    return dict(min(kept, key=lambda t: (t["forget_es"], -t[key], t["lr"])))


def recovers_at(trials: list[dict], utility_min: float, key: str = "model_utility") -> list[float]:
    """The rates above the first one breaking the floor where utility is back at or above it: empty where utility,
    once below the floor, stays below as the rate grows (the bisection's assumption)."""
    ordered = sorted((t for t in trials if not t.get("diverged")), key=lambda t: t["lr"])
    first_break = next((t["lr"] for t in ordered if t[key] < utility_min), None)
    if first_break is None:
        return []
    return [t["lr"] for t in ordered if t["lr"] > first_break and t[key] >= utility_min]


def at_levels(curve: Curve, levels=LEVELS) -> list[float | None]:
    """The curve's forget ES at each level (an offset from its floor)."""
    return [forget_es_at(curve.trials, curve.utility_min + d, curve.utility) for d in levels]


def compare_curves(curves: dict[tuple[str, int], Curve], pairs: list[tuple[str, str]], model_seeds: list[int],
                   levels=LEVELS) -> list[dict]:
    """Per (variant, method) pair and level: variant − method forget ES on each model seed where both curves reach
    the level (`per_model`), their mean (None where none does), their number `n` and how many have the variant
    lower (`lower`: better, forget ES ↓)."""
    read = {key: at_levels(c, levels) for key, c in curves.items()}
    out = []
    for variant, base in pairs:
        for i, d in enumerate(levels):
            diffs = {}
            for m in model_seeds:
                v, b = read.get((variant, m)), read.get((base, m))
                if v is not None and b is not None and v[i] is not None and b[i] is not None:
                    diffs[m] = v[i] - b[i]
            out.append({"variant": variant, "base": base, "offset": d, "n": len(diffs),
                        "mean": sum(diffs.values()) / len(diffs) if diffs else None,
                        "lower": sum(x < 0 for x in diffs.values()), "per_model": diffs})
    return out


def compare_fronts(curves: dict[tuple[str, int], Curve], pairs: list[tuple[str, str]],
                   model_seeds: list[int]) -> list[dict]:
    """Per (variant, method) pair: variant − method forget ES at their fronts (each run's best point over all its
    trials, past the first crossing included) on each model seed where both have one, as `compare_curves` reads
    the curves at a level."""
    out = []
    for variant, base in pairs:
        diffs = {}
        for m in model_seeds:
            v, b = curves.get((variant, m)), curves.get((base, m))
            if v is not None and b is not None and v.front is not None and b.front is not None:
                diffs[m] = v.front["forget_es"] - b.front["forget_es"]
        out.append({"variant": variant, "base": base, "offset": "front", "n": len(diffs),
                    "mean": sum(diffs.values()) / len(diffs) if diffs else None,
                    "lower": sum(x < 0 for x in diffs.values()), "per_model": diffs})
    return out


def fronts_markdown(curves: dict[tuple[str, int], Curve], results: list[dict]) -> str:
    """The section of results.md beside the curves': the comparison at the fronts, and which curves break the
    bisection's assumption (utility back above the floor past the crossing)."""
    recovering = sorted(f"{name} (m{m})" for (name, m), c in curves.items() if c.recovers_at)
    probed = sum(bool(c.past) for c in curves.values())
    lines = ["### At the front: each run's best point over all its trials", "",
             "The first crossing assumes that utility falls as the rate grows. Each run's front is its lowest forget "
             "ES at utility ≥ its model seed's floor over every trial it has, the probes past the crossing "
             "(tune.bisect.probe_past) and below it (probe_below) included: "
             f"{probed} of {len(curves)} curves have such probes. Utility is back "
             "above the floor past the crossing on "
             + (f"{len(recovering)}: {', '.join(recovering)}." if recovering else "none of them.") + "", "",
             "| variant − method | at the front | per model seed |", "|---|---|---|"]
    for r in results:
        cell = "–" if not r["n"] else f"{r['mean']:+.3f} ({r['lower']}/{r['n']})"
        per = " ".join(f"m{m} {x:+.3f}" for m, x in r["per_model"].items()) or "–"
        lines.append(f"| {r['variant']} − {r['base']} | {cell} | {per} |")
    return "\n".join(lines) + "\n"


def _level(d: float) -> str:
    return "floor" if d == 0 else f"floor {d:+.2f}"


def curves_markdown(curves: dict[tuple[str, int], Curve], results: list[dict], model_seeds: list[int],
                    runs: list[str], levels=LEVELS, plots: list[str] = ()) -> str:
    """The section of results.md: what was read, how many curves reach each level, and the comparison table."""
    reach = [sum(v[i] is not None for v in (at_levels(c, levels) for c in curves.values())) for i in range(len(levels))]
    lines = ["### Trade-off curves: forget ES on each run's curve at equal utility", "",
             f"Each bisection's trials (tuning seed) are points of its run's curve, forget ES against model utility; "
             f"{len(curves)} of {len(runs) * len(model_seeds)} curves (runs × model seeds) are there. Forget ES is "
             "interpolated on each curve where it first falls to each utility level (an offset from that model "
             "seed's floor), never extrapolated. Curves reaching each level: "
             + ", ".join(f"{_level(d)} {r}" for d, r in zip(levels, reach)) + ".", "",
             "Each cell: the mean variant − method difference over the model seeds where both curves reach the level "
             "(k/n: the variant lower, i.e. better, on k of those n model seeds); –: none.", "",
             "| variant − method | " + " | ".join(_level(d) for d in levels) + " |", "|" + "---|" * (len(levels) + 1)]
    by = {(r["variant"], r["base"], r["offset"]): r for r in results}
    for v, b in dict.fromkeys((r["variant"], r["base"]) for r in results):
        cells = ["–" if not r["n"] else f"{r['mean']:+.3f} ({r['lower']}/{r['n']})"
                 for r in (by[(v, b, d)] for d in levels)]
        lines.append(f"| {v} − {b} | " + " | ".join(cells) + " |")
    if plots:
        lines += ["", "Curves per model seed: " + ", ".join(f"`{p}`" for p in plots) + "."]
    return "\n".join(lines) + "\n"


def curves_csv(curves: dict[tuple[str, int], Curve], levels=LEVELS) -> str:
    """CSV: every curve's forget ES at every level (empty where it does not reach it)."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["run", "model_seed", "utility_min", "offset", "utility", "forget_es", "trials"])
    for (name, m), c in curves.items():
        for d, es in zip(levels, at_levels(c, levels)):
            writer.writerow([name, m, c.utility_min, d, round(c.utility_min + d, 6),
                             "" if es is None else round(es, 6), len(c.trials)])
    return buffer.getvalue()


def comparisons_csv(results: list[dict]) -> str:
    """CSV of compare_curves: one row per pair and level, each model seed's difference as `seed:diff`."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["variant", "base", "offset", "mean", "n", "lower", "per_model"])
    for r in results:
        writer.writerow([r["variant"], r["base"], r["offset"], "" if r["mean"] is None else round(r["mean"], 6),
                         r["n"], r["lower"], " ".join(f"{m}:{x:.6f}" for m, x in r["per_model"].items())])
    return buffer.getvalue()


def plot_method(curves: dict[tuple[str, int], Curve], method: str, runs: list[str], model_seeds: list[int],
                path: Path) -> None:
    """One method's runs (`runs`: the sequence-level one and its variants), a panel per model seed: each run's
    trials in lr order (one colour per run in every panel), its chosen point starred, the floor dashed."""
    plt = pyplot()
    cols = min(len(model_seeds), 3)
    rows = -(-len(model_seeds) // cols)
    fig, grid = plt.subplots(rows, cols, figsize=(4.2 * cols + 1.8, 3.6 * rows + 0.4), squeeze=False)
    axes = list(grid.flat)
    for ax in axes[len(model_seeds):]:
        ax.set_visible(False)
    colours = plt.get_cmap("tab10")
    keys = {c.utility for c in curves.values()}
    label = "model utility" if keys <= {"model_utility"} else " / ".join(sorted(keys)).replace("_", " ")
    for ax, m in zip(axes, model_seeds):
        floor = None
        for k, name in enumerate(runs):
            c = curves.get((name, m))
            if c is None:
                continue
            floor = c.utility_min
            colour = colours(k % 10)
            ax.plot([t[c.utility] for t in c.trials], [t["forget_es"] for t in c.trials], marker="o",
                    markersize=4, color=colour, label=name)
            if c.chosen is not None:
                ax.plot([c.chosen[c.utility]], [c.chosen["forget_es"]], marker="*", markersize=13,
                        color=colour, linestyle="none")
        if floor is None:
            ax.text(0.5, 0.5, "no bisection yet", ha="center", va="center", transform=ax.transAxes)
        else:
            ax.axvline(floor, linestyle="--", color="grey", label="utility floor")
        ax.set_title(f"model seed {m}")
        ax.set_xlabel(f"{label} ↑")
        ax.set_ylabel("forget extraction strength ↓")
    handles = {}  # one legend for the figure, beside the first row: every run of any panel once
    for ax in axes:
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    axes[cols - 1].legend(handles.values(), handles.keys(), loc="center left", bbox_to_anchor=(1.02, 0.5),
                          fontsize="small")
    fig.suptitle(f"{method}: one point per lr of the bisection (star: chosen)")
    save_figure(fig, path)


def plot_methods(curves: dict[tuple[str, int], Curve], specs: dict[str, dict], runs: list[str],
                 model_seeds: list[int], out_dir: Path) -> list[str]:
    """`tradeoff_{method}.png` in `out_dir` for each method (runs grouped by their spec's `method`) with at least
    one curve; returns the file names written."""
    written = []
    for method in dict.fromkeys(specs[n]["method"] for n in runs):
        group = [n for n in runs if specs[n]["method"] == method]
        if not any((n, m) in curves for n in group for m in model_seeds):
            continue
        name = f"tradeoff_{method}.png"
        plot_method(curves, method, group, model_seeds, Path(out_dir) / name)
        written.append(name)
    return written


def write_curves(root: Path, model_seeds: list[int], runs: list[str], specs: dict[str, dict],
                 pairs: list[tuple[str, str]], out_dir: Path, levels=LEVELS) -> str:
    """The whole of it for report-seeds: read the curves, write curves.csv, curve_comparisons.csv and the plots
    into `out_dir`; returns the results.md section."""
    curves = load_curves(Path(root), model_seeds, runs)
    results = compare_curves(curves, pairs, model_seeds, levels)
    fronts = compare_fronts(curves, pairs, model_seeds)
    plots = plot_methods(curves, specs, runs, model_seeds, Path(out_dir))
    with atomic_file(Path(out_dir) / "curves.csv") as f:
        f.write(curves_csv(curves, levels))
    with atomic_file(Path(out_dir) / "curve_comparisons.csv") as f:
        f.write(comparisons_csv(results + fronts))
    return curves_markdown(curves, results, model_seeds, runs, levels, plots) + "\n" + fronts_markdown(curves, fronts)


def equal_utility_markdown(curves: dict[tuple[str, int], Curve], runs: list[str], labels: dict[str, str],
                           pairs: list[tuple[str, str]], plots: list[str] = ()) -> str:
    """One model's runs at equal utility (the demo's report): each run's forget ES where its curve falls to the
    floor, its difference from its method's sequence-level run, and which run forgets the most there."""
    floors = {round(c.utility_min, 3) for c in curves.values()}
    floor = f"model utility {floors.pop():.3f}" if len(floors) == 1 else "each run's model utility floor"
    lines = ["### At equal utility", "",
             f"Each run's learning rate was bisected onto the utility floor ({floor}, tune.utility_floor × the "
             "target's), and its forget ES read there. Lower forgets more.", "",
             "| run | bisected lr | trials | forget ES at the floor | against its method's sequence-level run | "
             "front: forget ES (lr) |", "|---|---|---|---|---|---|"]
    base_of = dict(pairs)
    at_floor = {n: forget_es_at(c.trials, c.utility_min, c.utility) for (n, _), c in curves.items()}
    for name in runs:
        curve = curves.get((name, 0))
        if curve is None:
            lines.append(f"| {labels.get(name, name)} | – | – | – (not tuned) | | |")
            continue
        es, base = at_floor[name], base_of.get(name)
        versus = ""
        if base in at_floor and at_floor[base] is not None and es is not None:
            d = es - at_floor[base]
            word = "more" if d < 0 else "less" if d > 0 else "as much"
            versus = f"{d:+.3f}: forgets {word} than {labels.get(base, base)}"
        lr = f"{curve.chosen['lr']:.2e}" if curve.chosen else "–"
        best = curve.front
        best = "–" if best is None else f"{best['forget_es']:.3f} ({best['lr']:.2e}" + (
            ", past the crossing)" if curve.recovers_at and best["lr"] in curve.recovers_at else ")")
        lines.append(f"| {labels.get(name, name)} | {lr} | {len(curve.trials)} | "
                     + ("– (its curve does not reach the floor)" if es is None else f"{es:.3f}")
                     + f" | {versus} | {best} |")
    reached = {n: v for n, v in at_floor.items() if v is not None}
    if reached:
        best = min(reached, key=reached.get)
        line = f"At the same utility, {labels.get(best, best)} forgets the most (forget ES {reached[best]:.3f}"
        base = base_of.get(best)
        line += f"; {labels.get(base, base)} {reached[base]:.3f})." if base in reached else ")."
        lines += ["", line]
    lines += ["", "How: each run's trials (stage tune@RUN, on the tuning seed) are points of its trade-off curve, "
              "forget ES against model utility; forget ES is interpolated where the curve falls to the floor, between "
              "the two trials around it. The front is the run's lowest forget ES at utility ≥ the floor over all its "
              "trials, the probes past the crossing included (where utility recovers there, the first crossing is not "
              "the run's best point). One model and one seed: an illustration; RESULTS.md has the comparison over "
              "model seeds." + (" The curves: " + ", ".join(f"`{p}`" for p in plots) + "." if plots else "")]
    return "\n".join(lines) + "\n"


def write_equal_utility(tuning_dir: Path, runs: list[str], specs: dict[str, dict], labels: dict[str, str],
                        pairs: list[tuple[str, str]], out_dir: Path, plots_dir: Path) -> str:
    """The demo's runs at equal utility from its tunings (`tuning_dir/RUN/choice.json`): curves.csv into
    `plots_dir`, tradeoff_{method}.png into `out_dir`; returns the results.md section."""
    curves = load_curves(Path(tuning_dir), [0], runs, layout="{run}/choice.json")
    plots = plot_methods(curves, specs, runs, [0], Path(out_dir))
    with atomic_file(Path(plots_dir) / "curves.csv") as f:
        f.write(curves_csv(curves, LEVELS))
    return equal_utility_markdown(curves, runs, labels, pairs, plots)
