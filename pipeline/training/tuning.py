"""Learning-rate tuning with an equal budget for every variant of a base method.

Every run of a group (GA, T-GA and S-GA, say) is unlearned and evaluated at each learning rate of the same grid,
with the same epochs and the same tuning seed, which is not one of the seeds the results are reported on. Each run
then gets its own learning rate by one rule, stated before the search: among the learning rates that keep model
utility at least `utility_floor` × the target's, the one with the lowest forget extraction strength (ties: higher
utility); if none keeps it, the one with the highest utility. So the variants are compared at an equal utility
budget, each at its best.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from pipeline.common.atomic import write_json
from pipeline.common.errors import DataError, ParamError
from pipeline.common.params import Rule, between, check_rules, dataclass_from_params
from pipeline.common.plots import pyplot, save_figure

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TuneConfig:
    lrs: list = field(default_factory=lambda: [5e-5, 1e-4, 2e-4, 4e-4, 8e-4])
    seed: int = 100                   # the tuning seed: not one of unlearn.seeds, so no reported run was selected on
    utility_floor: float = 0.95       # keep model utility ≥ utility_floor × the target's
    groups: dict = field(default_factory=dict)  # base method -> the runs tuned with it, e.g. ga: [ga, t_ga, s_ga]

    @classmethod
    def from_params(cls, values: dict, where: str = "tune") -> "TuneConfig":
        cfg = dataclass_from_params(cls, values, where)
        lrs = Rule(lambda v: bool(v) and all(isinstance(x, (int, float)) and x > 0 for x in v),
                   "a non-empty list of positive learning rates")
        check_rules(cfg, {"lrs": lrs, "utility_floor": between(0, 1, lo_open=True)}, where)
        for group, runs in cfg.groups.items():
            if not isinstance(runs, list) or not runs:
                raise ParamError(f"{where}.groups.{group}: a non-empty list of run names")
        return cfg


def choose(trials: list[dict], utility_min: float) -> dict:
    """The rule: among trials with `model_utility` ≥ `utility_min` the lowest `forget_es` (ties: the higher
    utility, then the lower lr); if no trial qualifies, the highest utility. Each trial: lr, forget_es,
    model_utility."""
    if not trials:
        raise ParamError("no trials to choose from")
    kept = [t for t in trials if t["model_utility"] >= utility_min]
    if kept:
        best = min(kept, key=lambda t: (t["forget_es"], -t["model_utility"], t["lr"]))
        return {**best, "meets_floor": True}
    best = max(trials, key=lambda t: (t["model_utility"], -t["lr"]))
    return {**best, "meets_floor": False}


def forget_es_at_utility(trials: list[dict], utility: float) -> float | None:
    """Forget ES where the run's trade-off curve (trials in lr order) first falls to `utility`, interpolated
    linearly in utility between the two learning rates around it; None if it never gets there. Unlike the chosen
    point, this does not depend on where the grid's points happen to fall."""
    trials = sorted(trials, key=lambda t: t["lr"])
    for a, b in zip(trials, trials[1:]):
        if a["model_utility"] >= utility > b["model_utility"]:
            w = (a["model_utility"] - utility) / (a["model_utility"] - b["model_utility"])
            return a["forget_es"] + w * (b["forget_es"] - a["forget_es"])
    return None


def _lr_name(lr: float) -> str:
    return f"lr{lr:.2e}"


def tune_group(group: str, runs: dict, cfg: TuneConfig, unlearn_one: Callable, evaluate_one: Callable,
               target_utility: float, out_dir: Path) -> dict:
    """Tune every run of `group`. `runs`: name -> (UnlearnConfig, TrainConfig). `unlearn_one(name, ucfg, train,
    work_dir)` unlearns into `work_dir/model`; `evaluate_one(model_dir, eval_dir)` evaluates it and returns its
    summary (forget_es and model_utility at least), so this module needs neither the trainer nor the evaluation.
    A trial's evaluation is kept in `out_dir/trials/NAME/LR.json` and found there on a rerun, so a killed tuning
    resumes where it stopped; models are deleted once evaluated. Writes `out_dir/choice.json` and returns it."""
    utility_min = cfg.utility_floor * target_utility
    trial_root = out_dir / "trials"
    result: dict = {"group": group, "lrs": cfg.lrs, "seed": cfg.seed, "utility_floor": cfg.utility_floor,
                    "target_model_utility": target_utility, "utility_min": round(utility_min, 6), "runs": {}}
    for name, (ucfg, train) in runs.items():
        trials = []
        for lr in cfg.lrs:
            file = trial_root / name / f"{_lr_name(lr)}.json"
            if file.is_file():
                trials.append(json.loads(file.read_text()))
                continue
            work = out_dir / "work" / name / _lr_name(lr)
            shutil.rmtree(work, ignore_errors=True)
            unlearn_one(name, ucfg, replace(train, lr=float(lr), seed=cfg.seed), work)
            summary = evaluate_one(work / "model", work / "eval")
            missing = [k for k in ("forget_es", "model_utility") if k not in summary]
            if missing:
                raise DataError(f"tuning needs {missing} from the evaluation: evaluate.tofu_sets must hold forget, "
                                "retain, real_authors and world_facts")
            trial = {"lr": float(lr), **{k: summary[k] for k in
                                         ("forget_es", "retain_es", "model_utility", "log10_forget_quality")
                                         if k in summary}}
            write_json(file, trial)
            shutil.rmtree(work)
            trials.append(trial)
            log.info("tune %s lr %.2e: %s", name, lr, trial)
        chosen = choose(trials, utility_min)
        at_floor = forget_es_at_utility(trials, utility_min)
        result["runs"][name] = {"chosen": chosen, "trials": trials,
                                "forget_es_at_floor": None if at_floor is None else round(at_floor, 6)}
        log.info("tune %s: lr %.2e (forget ES %.3f, MU %.3f%s)", name, chosen["lr"], chosen["forget_es"],
                 chosen["model_utility"], "" if chosen["meets_floor"] else ", below the utility floor")
    write_json(out_dir / "choice.json", result)
    shutil.rmtree(out_dir / "work", ignore_errors=True)
    return result


def plot_tradeoff(result: dict, path: Path) -> None:
    """Forget ES against model utility at every lr, one line per run, the utility floor dashed: the variants'
    trade-off curves, which the chosen points sample."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for name, entry in result["runs"].items():
        trials = sorted(entry["trials"], key=lambda t: t["lr"])
        line, = ax.plot([t["model_utility"] for t in trials], [t["forget_es"] for t in trials], marker="o",
                        label=name)
        chosen = entry["chosen"]
        ax.plot([chosen["model_utility"]], [chosen["forget_es"]], marker="*", markersize=14, color=line.get_color())
    ax.axvline(result["utility_min"], linestyle="--", color="grey", label="utility floor")
    ax.set_xlabel("model utility ↑")
    ax.set_ylabel("forget extraction strength ↓")
    ax.set_title(f"{result['group']}: one point per lr (star: chosen), seed {result['seed']}")
    ax.legend()
    save_figure(fig, path)


def choice_table(result: dict) -> str:
    """Markdown: forget ES / MU of every run at every lr, the chosen one in bold."""
    lrs = result["lrs"]
    lines = [f"Group {result['group']}: utility floor {result['utility_floor']} × target MU "
             f"{result['target_model_utility']:.3f} = {result['utility_min']:.3f}; cells: forget ES / MU",
             "", "| run | " + " | ".join(f"lr {lr:.1e}" for lr in lrs) + " | chosen | forget ES at the floor |",
             "|---|" + "---|" * (len(lrs) + 2)]
    for name, entry in result["runs"].items():
        by_lr = {t["lr"]: t for t in entry["trials"]}
        cells = []
        for lr in lrs:
            t = by_lr[float(lr)]
            cell = f"{t['forget_es']:.3f} / {t['model_utility']:.3f}"
            cells.append(f"**{cell}**" if t["lr"] == entry["chosen"]["lr"] else cell)
        chosen = entry["chosen"]
        note = "" if chosen["meets_floor"] else " (below floor)"
        at_floor = entry.get("forget_es_at_floor")
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {chosen['lr']:.1e}{note} | "
                     + ("–" if at_floor is None else f"{at_floor:.3f}") + " |")
    return "\n".join(lines) + "\n"
