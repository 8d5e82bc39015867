"""Learning-rate tuning with an equal budget for every variant of a base method.

Every run of a group (GA, T-GA and S-GA, say) is unlearned and evaluated at each learning rate of the same grid,
with the same epochs and the same tuning seed, which is not one of the seeds the results are reported on. Each run
then gets its own learning rate by one rule, stated before the search: among the learning rates that keep model
utility at least `utility_floor` × the target's, the one with the lowest forget extraction strength (ties: higher
utility); if none keeps it, the one with the highest utility. So the variants are compared at an equal utility
budget, each at its best.

A grid's chosen points land anywhere between the floor and the next rate, so two variants compared at them may
differ in utility by more than their difference in forgetting. `search: bisect` instead finds, for each run, the
learning rate where model utility falls to the floor: from the run's own rate it steps by `factor` until the
floor is crossed, then narrows the bracket by false position in log lr, until utility is within `tolerance` of the
floor or `max_trials` trials are spent; the same budget for every run.

A trial whose training diverges (a non-finite loss) counts as breaking the floor: the search goes on below it, and
the run's choice.json lists its rate under `diverged`. Only a run whose every trial diverges is an error.

The bisection assumes that utility falls as the rate grows, and a run's utility need not: it can fall below the floor
and come back above it at higher rates, where forgetting is deeper still. So after the bisection the tuner tries
the crossing's rate × each of `probe_past` (2 and 4), beyond `max_trials`, and records them (`past_crossing`), the
rates where utility is back above the floor (`recovers_at`), the span of rates tried (`lr_span`) and the run's front:
the lowest forget ES at utility ≥ the floor over every trial (`front`); `probe_below` (none by default) adds trials
below the chosen rate where none lies that low (`below_crossing`): a span of max(probe_past) / min(probe_below) at
least. The first crossing stays the chosen rate.

"Utility" is TOFU's model utility unless `utility` names another key of the evaluation's summary: what the user
needs kept (retain ES or ROUGE-L on their own retain data, an lm-eval task's accuracy). The target's value of that
key sets the floor, and every trial records it under its own name.
"""

from __future__ import annotations

import json
import logging
import math
import re
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from pipeline.common.atomic import write_json
from pipeline.common.errors import DataError, ParamError
from pipeline.common.params import LEARNING_RATE, Rule, between, check_rules, dataclass_from_params
from pipeline.studies.tradeoff import forget_es_at, front, recovers_at

log = logging.getLogger(__name__)


# What the utility floor may be measured on: keys of the evaluation's summary that are higher-is-better shares.
UTILITY_KEYS = ("model_utility", "retain_es", "retain_rouge")
UTILITY_LMEVAL = re.compile(r"lmeval_\w+_acc(_norm)?")


@dataclass(frozen=True)
class TuneConfig:
    lrs: list = field(default_factory=lambda: [5e-5, 1e-4, 2e-4, 4e-4, 8e-4])
    seed: int = 100                   # the tuning seed: not one of unlearn.seeds, so no reported run was selected on
    utility_floor: float = 0.95       # keep model utility ≥ utility_floor × the target's
    groups: dict = field(default_factory=dict)  # base method -> the runs tuned with it, e.g. ga: [ga, t_ga, s_ga]
    search: str = "grid"              # grid: every lr of `lrs` | bisect: the lr at the utility floor
    bisect: dict = field(default_factory=dict)  # BisectConfig's keys
    utility: str = "model_utility"    # the summary key the floor is measured on (UTILITY_KEYS, or lmeval_...)

    @classmethod
    def from_params(cls, values: dict, where: str = "tune") -> "TuneConfig":
        cfg = dataclass_from_params(cls, values, where)
        lrs = Rule(lambda v: bool(v) and all(isinstance(x, (int, float)) and LEARNING_RATE.ok(x) for x in v),
                   f"a non-empty list of learning rates, each {LEARNING_RATE.expect} (as unlearn.train.lr)")
        check_rules(cfg, {"lrs": lrs, "utility_floor": between(0, 1, lo_open=True)}, where)
        for group, runs in cfg.groups.items():
            if not isinstance(runs, list) or not runs:
                raise ParamError(f"{where}.groups.{group}: a non-empty list of run names")
        if cfg.search not in ("grid", "bisect"):
            raise ParamError(f"{where}.search: grid or bisect, not {cfg.search!r}")
        BisectConfig.from_params(cfg.bisect or {}, f"{where}.bisect")
        if not isinstance(cfg.utility, str) or not (cfg.utility in UTILITY_KEYS or UTILITY_LMEVAL.fullmatch(cfg.utility)):
            raise ParamError(f"{where}.utility: {cfg.utility!r} is not a utility: one of {', '.join(UTILITY_KEYS)}, or "
                             "an lm-eval task's accuracy as the evaluation writes it (lmeval_<task>_acc, say)")
        return cfg

    @property
    def bisect_config(self) -> "BisectConfig":
        return BisectConfig.from_params(self.bisect or {}, "tune.bisect")


@dataclass(frozen=True)
class BisectConfig:
    max_trials: int = 7       # unlearn + evaluate trials per run, the same for every run
    tolerance: float = 0.005  # done once model utility is within this above the floor
    factor: float = 2.0       # the bracketing steps: lr × factor up, or / factor down
    probe_past: list = field(default_factory=lambda: [2.0, 4.0])  # trials at the crossing's lr × each, beyond
                              # max_trials: does utility stay below the floor past it? []: no probes
    probe_below: list = field(default_factory=list)  # trials at the chosen lr × each (below 1) where no trial
                              # lies that low: the front over a span of max(probe_past) / min(probe_below)

    @classmethod
    def from_params(cls, values: dict, where: str = "tune.bisect") -> "BisectConfig":
        cfg = dataclass_from_params(cls, values, where)
        positive = Rule(lambda v: isinstance(v, (int, float)) and v > 0, "a positive number")
        above_one = Rule(lambda v: all(isinstance(x, (int, float)) and not isinstance(x, bool) and x > 1 for x in v),
                         "a list of factors above 1, e.g. [2, 4]")
        check_rules(cfg, {"max_trials": Rule(lambda v: isinstance(v, int) and v >= 2, "an integer of at least 2"),
                          "tolerance": positive, "factor": Rule(lambda v: isinstance(v, (int, float)) and v > 1,
                                                                "a number above 1"),
                          "probe_past": above_one,
                          "probe_below": Rule(lambda v: all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                            and 0 < x < 1 for x in v),
                                              "a list of factors between 0 and 1, e.g. [0.5]")}, where)
        return cfg


def round_lr(lr: float) -> float:
    """Three significant digits: the rates a bisection tries are written as such, and their trials named by them."""
    return float(f"{lr:.2e}")


def bisect_lr(trial_at: Callable[[float], dict], start_lr: float, utility_min: float, cfg: BisectConfig,
              lr_rule: Rule | None = None, utility: str = "model_utility") -> dict:
    """The learning rate where model utility falls to `utility_min`, assuming it falls as the rate grows.
    `trial_at(lr)` unlearns and evaluates at `lr` and returns the trial (lr, forget_es, its `utility`).

    From `start_lr`, step by `cfg.factor` (up while utility holds, down while it does not) until one trial keeps
    the floor and a higher rate breaks it; then try the false-position point in log lr between them (kept off the
    bracket's ends, so that a curved utility cannot stall it at one end), until the kept end is within
    `cfg.tolerance` of the floor or `cfg.max_trials` are spent. Returns {trials, chosen}: the chosen trial is the
    bracket's kept end (the highest rate keeping the floor: the most forgetting at that utility), or, when no rate
    keeps it, the highest utility (meets_floor false); `converged` says whether it is within the tolerance.

    A trial marked `diverged` (it has no utility) breaks the floor; the step after a diverged upper end halves the
    bracket in log lr, since false position needs a utility there. `diverged` lists those rates; `chosen` is None
    when every trial diverged.

    Every rate tried passes `lr_rule` (the rule of `unlearn.train.lr`): a step that would leave it stops the search
    at the edge, `converged` false and `stopped` saying why, and probes past the crossing outside it are not tried.
    """
    trials: list[dict] = []
    stopped = None  # why the search ended early, if it did
    diverged: list[dict] = []
    kept = broken = None  # the bracket: the highest lr keeping the floor, the lowest lr breaking it above it

    def spent() -> int:
        return len(trials) + len(diverged)

    def run(lr: float) -> None:
        nonlocal kept, broken
        trial = trial_at(round_lr(lr))
        if trial.get("diverged"):
            diverged.append(trial)
            if broken is None or trial["lr"] < broken["lr"]:
                broken = trial
            return
        trials.append(trial)
        if trial[utility] >= utility_min:
            if kept is None or trial["lr"] > kept["lr"]:
                kept = trial
        elif broken is None or trial["lr"] < broken["lr"]:
            broken = trial

    def allowed(lr: float) -> bool:
        return lr_rule is None or lr_rule.ok(round_lr(lr))

    if not allowed(start_lr):
        raise ParamError(f"the bisection's start, lr {start_lr:g}, must be {lr_rule.expect}")
    run(start_lr)
    while (kept is None or broken is None) and spent() < cfg.max_trials:
        step = kept["lr"] * cfg.factor if kept is not None else broken["lr"] / cfg.factor
        if not allowed(step):
            stopped = (f"model utility stays at or above the floor up to lr {kept['lr']:.3g}, and lr {step:.3g} "
                       f"is outside the allowed rates ({lr_rule.expect})") if kept is not None else \
                      f"no rate keeps the floor down to lr {broken['lr']:.3g} ({lr_rule.expect})"
            break
        run(step)
    while (kept is not None and broken is not None and spent() < cfg.max_trials
           and kept[utility] - utility_min > cfg.tolerance):
        lo, hi = math.log(kept["lr"]), math.log(broken["lr"])
        if utility in broken:
            f_lo, f_hi = kept[utility] - utility_min, broken[utility] - utility_min
            x = lo + f_lo * (hi - lo) / (f_lo - f_hi)
            x = min(max(x, lo + 0.1 * (hi - lo)), hi - 0.1 * (hi - lo))
        else:  # diverged there: no utility to interpolate
            x = (lo + hi) / 2
        if round_lr(math.exp(x)) in (kept["lr"], broken["lr"]):
            break  # the bracket is narrower than the rates' three digits
        run(math.exp(x))
    if kept is not None:
        chosen = {**kept, "meets_floor": True}
    elif trials:
        chosen = {**max(trials, key=lambda t: (t[utility], -t["lr"])), "meets_floor": False}
    else:
        chosen = None
    converged = stopped is None and kept is not None and kept[utility] - utility_min <= cfg.tolerance
    # Past the crossing (the lowest rate breaking the floor): the bisection's assumption, checked where it matters
    past: list[dict] = []
    below: list[dict] = []
    if kept is not None and broken is not None:
        for factor in cfg.probe_past:
            if allowed(broken["lr"] * factor):
                past.append(trial_at(round_lr(broken["lr"] * factor)))
        lowest = min(t["lr"] for t in trials)
        for factor in sorted(cfg.probe_below, reverse=True):  # the grid below the crossing, where not yet tried
            lr = round_lr(kept["lr"] * factor)
            if lr < lowest and allowed(lr):
                below.append(trial_at(lr))
                lowest = lr
    found = {"trials": sorted(trials, key=lambda t: t["lr"]), "chosen": chosen, "converged": converged,
             "diverged": sorted(t["lr"] for t in diverged), "past_crossing": past}
    if cfg.probe_below:  # only then, so that a tuning without them writes the choice.json it always did
        found["below_crossing"] = sorted(below, key=lambda t: t["lr"])
    return found | ({"stopped": stopped} if stopped else {})


def choose(trials: list[dict], utility_min: float, utility: str = "model_utility") -> dict:
    """The rule: among trials with `utility` ≥ `utility_min` the lowest `forget_es` (ties: the higher
    utility, then the lower lr); if no trial qualifies, the highest utility. Each trial: lr, forget_es,
    `utility` (model_utility unless tune.utility chose another)."""
    if not trials:
        raise ParamError("no trials to choose from")
    kept = [t for t in trials if t[utility] >= utility_min]
    if kept:
        best = min(kept, key=lambda t: (t["forget_es"], -t[utility], t["lr"]))
        return {**best, "meets_floor": True}
    best = max(trials, key=lambda t: (t[utility], -t["lr"]))
    return {**best, "meets_floor": False}


def _short(utility: str) -> str:
    """The utility's name in tables and log lines: MU for TOFU's model utility, else the key itself."""
    return "MU" if utility == "model_utility" else utility


def _target(result: dict) -> float:
    """The target's utility in a choice.json (`target_model_utility` where the utility is model utility)."""
    return result["target_utility"] if "utility" in result else result["target_model_utility"]


def _lr_name(lr: float) -> str:
    return f"lr{lr:.2e}"


def tune_group(group: str, runs: dict, cfg: TuneConfig, unlearn_one: Callable, evaluate_one: Callable,
               target_utility: float, out_dir: Path, diverges: tuple[type[Exception], ...] = (),
               lr_rule: Rule | None = None) -> dict:
    """Tune every run of `group`. `runs`: name -> (UnlearnConfig, TrainConfig), the TrainConfig's lr the start of
    a bisection. `unlearn_one(name, ucfg, train, work_dir)` unlearns into `work_dir/model`;
    `evaluate_one(model_dir, eval_dir)` evaluates it and returns its summary (forget_es and cfg.utility at least),
    so this module needs neither the trainer nor the evaluation. A trial's evaluation is kept in
    `out_dir/trials/NAME/LR.json` and found there on a rerun, so a killed tuning resumes where it stopped; models
    are deleted once evaluated. `unlearn_one` raising one of `diverges` (training that diverged) makes a trial that
    breaks the floor, kept as {lr, diverged: the error}. Every rate tried passes `lr_rule` (unlearn.train.lr's).
    Writes `out_dir/choice.json` and returns it."""
    utility, utility_min = cfg.utility, cfg.utility_floor * target_utility
    trial_root = out_dir / "trials"
    result: dict = {"group": group, "search": cfg.search, "lrs": cfg.lrs, "seed": cfg.seed,
                    "utility_floor": cfg.utility_floor, "target_model_utility": target_utility,
                    "utility_min": round(utility_min, 6), "runs": {}}
    if utility != "model_utility":  # a choice.json without `utility` is one of model utility, as before it
        del result["target_model_utility"]
        result = {"utility": utility, "target_utility": target_utility, **result}
    if cfg.search == "bisect":
        bisect = cfg.bisect_config
        result |= {"lrs": None, "bisect": {"max_trials": bisect.max_trials, "tolerance": bisect.tolerance,
                                           "factor": bisect.factor, "probe_past": bisect.probe_past}}
        if bisect.probe_below:
            result["bisect"]["probe_below"] = bisect.probe_below
    for name, (ucfg, train) in runs.items():
        def trial_at(lr: float, name=name, ucfg=ucfg, train=train) -> dict:
            file = trial_root / name / f"{_lr_name(lr)}.json"
            if file.is_file():
                return json.loads(file.read_text())
            work = out_dir / "work" / name / _lr_name(lr)
            shutil.rmtree(work, ignore_errors=True)
            try:
                unlearn_one(name, ucfg, replace(train, lr=float(lr), seed=cfg.seed), work)
            except diverges as e:
                trial = {"lr": float(lr), "diverged": str(e).splitlines()[0]}
                write_json(file, trial)
                shutil.rmtree(work, ignore_errors=True)
                log.warning("tune %s lr %.2e: diverged, so it counts as below the floor (%s)", name, lr,
                            trial["diverged"])
                return trial
            summary = evaluate_one(work / "model", work / "eval")
            missing = [k for k in ("forget_es", utility) if k not in summary]
            if missing:
                raise DataError(f"tuning needs {missing} from the evaluation (tune.utility: {utility}): "
                                + ("evaluate.tofu_sets must hold forget, retain, real_authors and world_facts"
                                   if utility == "model_utility" else "the evaluation params must produce it"))
            trial = {"lr": float(lr), **{k: summary[k] for k in
                                         ("forget_es", "retain_es", "model_utility", "log10_forget_quality", utility)
                                         if k in summary}}
            write_json(file, trial)
            shutil.rmtree(work)
            log.info("tune %s lr %.2e: forget ES %.3f, %s %.3f", name, lr, trial.get("forget_es", float("nan")),
                     utility.replace("_", " "), trial.get(utility, float("nan")))
            return trial

        past: list[dict] = []
        if cfg.search == "bisect":
            found = bisect_lr(trial_at, train.lr, utility_min, bisect, lr_rule, utility)
            trials, chosen, diverged = found["trials"], found["chosen"], found["diverged"]
            extra = {"start_lr": train.lr, "converged": found["converged"]}
            if "stopped" in found:
                extra["stopped"] = found["stopped"]
                log.warning("tune %s: not converged: %s", name, found["stopped"])
            past = found["past_crossing"]
            if "below_crossing" in found:
                extra["below_crossing"] = found["below_crossing"]
        else:
            done = [trial_at(float(lr)) for lr in cfg.lrs]
            trials = [t for t in done if not t.get("diverged")]
            diverged = [t["lr"] for t in done if t.get("diverged")]
            chosen, extra = (choose(trials, utility_min, utility) if trials else None), {}
        if chosen is None:
            rates = ", ".join(f"{lr:.2e}" for lr in diverged)
            raise ParamError(f"unlearn.runs.{name}: every tuning trial diverged (lr {rates}; {trial_root / name}): "
                             "start lower (its train.lr, or tune.lrs)")
        if diverged:  # only then, so that a tuning with none writes the choice.json it always did
            extra["diverged"] = diverged
        at_floor = forget_es_at(trials, utility_min, utility)
        everything = trials + past + extra.get("below_crossing", [])
        lrs = [t["lr"] for t in everything if not t.get("diverged")]
        result["runs"][name] = {"chosen": chosen, "trials": trials, **extra,
                                "forget_es_at_floor": None if at_floor is None else round(at_floor, 6),
                                "past_crossing": past, "recovers_at": recovers_at(everything, utility_min, utility),
                                "front": front(everything, utility_min, utility),
                                "lr_span": round(max(lrs) / min(lrs), 3) if lrs else None}
        if result["runs"][name]["recovers_at"]:
            log.warning("tune %s: utility falls below the floor and is back above it at lr %s: the first "
                        "crossing is not the run's best point (front: forget ES %.3f at lr %.2e)", name,
                        ", ".join(f"{lr:.2e}" for lr in result["runs"][name]["recovers_at"]),
                        result["runs"][name]["front"]["forget_es"], result["runs"][name]["front"]["lr"])
        log.info("tune %s: lr %.2e (forget ES %.3f, %s %.3f%s)", name, chosen["lr"], chosen["forget_es"],
                 _short(utility), chosen[utility], "" if chosen["meets_floor"] else ", below the utility floor")
    write_json(out_dir / "choice.json", result)
    shutil.rmtree(out_dir / "work", ignore_errors=True)
    return result


def choice_table(result: dict) -> str:
    """Markdown: forget ES / utility (MU unless tune.utility chose another) of every run at every lr, the chosen one
    in bold."""
    if result.get("search") == "bisect":
        return bisect_table(result)
    lrs, utility = result["lrs"], result.get("utility", "model_utility")
    u = _short(utility)
    lines = [f"Group {result['group']}: utility floor {result['utility_floor']} × target {u} "
             f"{_target(result):.3f} = {result['utility_min']:.3f}; cells: forget ES / {u}",
             "", "| run | " + " | ".join(f"lr {lr:.1e}" for lr in lrs) + " | chosen | forget ES at the floor |",
             "|---|" + "---|" * (len(lrs) + 2)]
    for name, entry in result["runs"].items():
        by_lr = {t["lr"]: t for t in entry["trials"]}
        cells = []
        for lr in lrs:
            t = by_lr.get(float(lr))
            if t is None:
                cells.append("diverged")
                continue
            cell = f"{t['forget_es']:.3f} / {t[utility]:.3f}"
            cells.append(f"**{cell}**" if t["lr"] == entry["chosen"]["lr"] else cell)
        chosen = entry["chosen"]
        note = "" if chosen["meets_floor"] else " (below floor)"
        at_floor = entry.get("forget_es_at_floor")
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {chosen['lr']:.1e}{note} | "
                     + ("–" if at_floor is None else f"{at_floor:.3f}") + " |")
    return "\n".join(lines) + "\n"


def bisect_table(result: dict) -> str:
    """Markdown: each run's trials in lr order (lr: forget ES / utility), the chosen one in bold."""
    b, utility = result["bisect"], result.get("utility", "model_utility")
    u = _short(utility)
    lines = [f"{result['group']}: lr bisected onto the utility floor {result['utility_floor']} × target {u} "
             f"{_target(result):.3f} = {result['utility_min']:.3f} (at most {b['max_trials']} trials, "
             f"tolerance {b['tolerance']}); cells: lr: forget ES / {u}", "",
             f"| run | trials | chosen lr | {u} | forget ES | forget ES at the floor | past the crossing | front: lr, "
             f"forget ES / {u} |", "|---|---|---|---|---|---|---|---|"]
    for name, entry in result["runs"].items():
        chosen = entry["chosen"]
        cells = []
        for t in entry["trials"]:
            cell = f"{t['lr']:.2e}: {t['forget_es']:.3f} / {t[utility]:.3f}"
            cells.append(f"**{cell}**" if t["lr"] == chosen["lr"] else cell)
        cells += [f"{lr:.2e}: diverged" for lr in entry.get("diverged", [])]
        note = "" if chosen["meets_floor"] else " (below floor)"
        note += "" if entry.get("converged", True) else " (not within tolerance)"
        at_floor = entry.get("forget_es_at_floor")
        past = "; ".join(f"{t['lr']:.2e}: diverged" if t.get("diverged") else
                         f"{t['lr']:.2e}: {t['forget_es']:.3f} / {t[utility]:.3f}"
                         for t in entry.get("past_crossing", [])) or "–"
        if entry.get("recovers_at"):
            past += " (utility recovers)"
        best = entry.get("front")
        best = "–" if best is None else f"{best['lr']:.2e}, {best['forget_es']:.3f} / {best[utility]:.3f}"
        lines.append(f"| {name} | " + "; ".join(cells) + f" | {chosen['lr']:.2e}{note} | {chosen[utility]:.3f}"
                     f" | {chosen['forget_es']:.3f} | " + ("–" if at_floor is None else f"{at_floor:.3f}")
                     + f" | {past} | {best} |")
    return "\n".join(lines) + "\n"
