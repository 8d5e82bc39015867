"""One tuning as the `tune` stage and the Python API run it: each run's learning rate found by `tune_group`
(tuning.py), with the trainer and the evaluation plugged in, the floor set by the target's own summary, the
trade-off plotted; and the rate a tuning chose, read back and checked as `unlearn.train.lr` is (`unlearn --lr-from`,
`ForgetRequest.tune`)."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

from pipeline.common.artifacts import read_json, value_at
from pipeline.common.atomic import atomic_file
from pipeline.common.errors import DataError
from pipeline.common.params import LEARNING_RATE, between, section
from pipeline.common.plots import pyplot, save_figure
from pipeline.data.config import DataConfig
from pipeline.evaluation.config import EvalConfig, eval_config
from pipeline.evaluation.evaluate import evaluate_model
from pipeline.evaluation.inputs import load_inputs
from pipeline.studies.tuning import UTILITY_KEYS, TuneConfig, choice_table, tune_group
from pipeline.training.engine import TrainConfig, TrainingDiverged
from pipeline.training.run_config import run_configs
from pipeline.training.unlearn import run_unlearn

__all__ = ["target_utility", "trial_eval_config", "run_tuning", "chosen_lr", "plot_tradeoff"]

log = logging.getLogger(__name__)


def target_utility(target_results: str | Path, utility: str) -> float:
    """The target's value of `utility` (tune.utility) from its evaluation summary: the floor is a share of it, so
    a missing, negative or non-finite one would move the floor silently."""
    summary = read_json(target_results, "evaluation summary of the target",
                        "evaluate the target first (DVC stage evaluate_target)")
    if isinstance(summary, dict) and utility not in summary:
        raise DataError(f"{target_results}: no {utility} in it, the utility the floor is measured on "
                        "(tune.utility): evaluate the target with params that produce it, or choose another utility")
    return value_at(summary, target_results, utility, between(0, 1))


def trial_eval_config(params: dict, utility: str) -> EvalConfig:
    """What a trial evaluates: the choice reads forget ES and `utility` only (TOFU's sets, or an lm-eval task's
    accuracy), so the forget set's greedy answers, the attacks and the multiple choice are left to the reported
    runs' evaluations, where they cost once per run, not once per trial."""
    full = eval_config(params)
    return replace(full, forget_rouge=False, mia={}, paraphrase=False, quantize={}, sampling={}, multiple_choice={},
                   probe_sets=[],  # the probes' sets may name multiple-choice sets, which are off here
                   lm_eval=full.lm_eval if utility not in UTILITY_KEYS else {})


def run_tuning(params: dict, group: str, names: list[str], shards: str | Path, reference: str | Path | None,
               target_results: str | Path, retain_results: str | Path | None, out_dir: Path) -> dict:
    """Tune the learning rate of each run of `names` on `params` (tune, unlearn, evaluate, data), trials under
    `out_dir`; writes choice.json, choice.md and tradeoff.png there and returns the choice."""
    cfg = TuneConfig.from_params(section(params, "tune"))
    runs = {name: run_configs(params, name) for name in names}
    data = DataConfig.from_params(section(params, "data"))
    model_path = str(section(params, "unlearn.model"))
    utility = target_utility(target_results, cfg.utility)
    eval_cfg = trial_eval_config(params, cfg.utility)
    retain_dir = Path(retain_results) if retain_results else None
    inputs = load_inputs(eval_cfg, retain_dir)  # every evaluation input, checked before the first trial

    def unlearn_one(name, ucfg, train, work: Path) -> None:
        run_unlearn(name, ucfg, train, data, model_path, Path(shards), work, work / "checkpoints",
                    work / "losses.csv", resume=False, reference_dir=Path(reference) if reference else None)

    def evaluate_one(model_dir: Path, eval_dir: Path) -> dict:
        return evaluate_model(str(model_dir), eval_cfg, eval_dir, retain_dir, inputs)

    result = tune_group(group, runs, cfg, unlearn_one, evaluate_one, utility, out_dir,
                        diverges=(TrainingDiverged,), lr_rule=LEARNING_RATE)
    table = choice_table(result)
    with atomic_file(out_dir / "choice.md") as f:
        f.write(table)
    plot_tradeoff(result, out_dir / "tradeoff.png")
    log.info("tune %s:\n%s", group, table)
    return result


def chosen_lr(choice_file: Path, run: str) -> float:
    """The learning rate a tuning (its choice.json) chose for `run`, checked as `unlearn.train.lr` is: a clear error
    if the file, the run or the rate is not there or not valid, or if the tuning found no rate that keeps the
    utility floor (a comparison at equal utility would not be one)."""
    choice = read_json(choice_file, "tuning choice", "run `tokenunlearn tune` to write it")
    runs = value_at(choice, choice_file, "runs")
    if not isinstance(runs, dict) or run not in runs:
        have = sorted(runs) if isinstance(runs, dict) else []
        raise DataError(f"{choice_file}: no tuning of run '{run}' in it (runs: {have}); tune it with "
                        f"`tokenunlearn tune --run {run}`")
    lr = float(value_at(choice, choice_file, f"runs.{run}.chosen.lr", TrainConfig.RULES["lr"], "unlearn.train.lr"))
    chosen = runs[run]["chosen"]
    if chosen.get("meets_floor") is False:
        raise DataError(f"{choice_file}: run '{run}': no rate the tuning tried keeps the utility floor (its best, lr "
                        f"{lr:.3g}, has model utility {chosen.get('model_utility')}), so it is no equal-utility rate; "
                        f"tune again from a lower rate (unlearn.runs.{run}.train.lr) or with a lower "
                        "tune.utility_floor")
    if runs[run].get("converged") is False:
        log.warning("%s: run '%s': the bisection did not converge (%s): lr %.3g keeps the floor but may lie well "
                    "below it", choice_file, run, runs[run].get("stopped", "its trial budget ran out"), lr)
    return lr


def plot_tradeoff(result: dict, path: Path) -> None:
    """Forget ES against model utility at every lr, one line per run, the utility floor dashed: the variants'
    trade-off curves, which the chosen points sample."""
    plt, utility = pyplot(), result.get("utility", "model_utility")
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for name, entry in result["runs"].items():
        trials = sorted(entry["trials"], key=lambda t: t["lr"])
        line, = ax.plot([t[utility] for t in trials], [t["forget_es"] for t in trials], marker="o",
                        label=name)
        chosen = entry["chosen"]
        ax.plot([chosen[utility]], [chosen["forget_es"]], marker="*", markersize=14, color=line.get_color())
    ax.axvline(result["utility_min"], linestyle="--", color="grey", label="utility floor")
    ax.set_xlabel(f"{utility.replace('_', ' ')} ↑")
    ax.set_ylabel("forget extraction strength ↓")
    ax.set_title(f"{result['group']}: one point per lr (star: chosen), seed {result['seed']}")
    ax.legend()
    save_figure(fig, path)
