"""The metrics the tables show, each registered once: its summary key, column title, direction, the tables it is a
column of, and the range its values lie in. The report (`report.py`: the main and robustness tables, and the
summaries' checks) and the table over model seeds with its significance tests (`significance.py`) read their
columns from here; the evaluation writes the keys.

A new metric is one `Metric` entry here (its key, as the evaluation writes it to the summary) plus the code that
computes it. The multiple-choice accuracies are a family, not entries: every `mc_<set>` key of a summary is a
column of the main table, titled "<set> acc" (the sets are the params', `evaluate.multiple_choice`).
"""

from __future__ import annotations

from dataclasses import dataclass

# Directions: which way is better.
HIGHER, LOWER, NEAREST = +1, -1, 0  # NEAREST: nearest a reference (privleak: 0; an AUC: the retain model's)
# The tables.
MAIN = "main"              # the paper's Table 1: report's results.md and results.csv, its ablations and plots
ROBUSTNESS = "robustness"  # is it forgotten or only hidden: report's robustness table, robustness.csv
SEEDS = "seeds"            # the table over model seeds and its paired significance tests (report-seeds)
TABLES = (MAIN, ROBUSTNESS, SEEDS)
# Ranges a value must lie in (None: unbounded on that side).
SHARE = (0.0, 1.0)         # ES, EM, accuracy, AUC, model utility
LOG10_P = (None, 0.0)      # log10 of a p-value
ANY = (None, None)


@dataclass(frozen=True)
class Metric:
    key: str                   # the evaluation summary's key (a run's: the mean over seeds; `<key>_std` beside it)
    title: str                 # the column's title, with its direction
    better: int                # HIGHER, LOWER or NEAREST
    tables: tuple[str, ...]    # the tables it is a column of, in registry order
    range: tuple[float | None, float | None] = SHARE


# In column order: each table takes its entries in this order.
REGISTRY: tuple[Metric, ...] = (
    Metric("retain_es", "retain ES ↑", HIGHER, (MAIN, SEEDS)),
    Metric("forget_es", "forget ES ↓", LOWER, (MAIN, SEEDS)),
    Metric("model_utility", "MU ↑", HIGHER, (MAIN, SEEDS)),
    Metric("log10_forget_quality", "log10 FQ ↑", HIGHER, (MAIN, SEEDS), LOG10_P),
    # Is it forgotten or only hidden (evaluate.mia, paraphrase, quantize; the relearn stages as `relearn_*`), where
    # evaluated: each attack's forget ES and forget multiple-choice accuracy, against the same model unattacked.
    Metric("privleak", "privleak (→0)", NEAREST, (ROBUSTNESS,), ANY),
    Metric("mia_min_k_plus_plus_auc", "Min-K%++ AUC (→retain)", NEAREST, (ROBUSTNESS,)),
    Metric("forget_para_es", "forget ES, paraphrased ↓", LOWER, (ROBUSTNESS,)),
    Metric("q8_forget_es", "forget ES, 8-bit ↓", LOWER, (ROBUSTNESS,)),
    Metric("q4_forget_es", "forget ES, 4-bit ↓", LOWER, (ROBUSTNESS,)),
    Metric("relearn_before_forget_es", "forget ES, unseen rows ↓", LOWER, (ROBUSTNESS,)),
    Metric("relearn_forget_forget_es", "… after relearning on forget ↓", LOWER, (ROBUSTNESS,)),
    Metric("relearn_retain_forget_es", "… after relearning on retain ↓", LOWER, (ROBUSTNESS,)),
    # the embedded world's multiple choice (evaluate.multiple_choice `world`, cloze; `world_letter`, letter)
    Metric("mc_world_forget", "forget MC, cloze ↓", LOWER, (ROBUSTNESS, SEEDS)),
    Metric("mc_world_letter_forget", "forget MC, letter ↓", LOWER, (ROBUSTNESS,)),
    Metric("q4_mc_world_forget", "forget MC, 4-bit ↓", LOWER, (ROBUSTNESS,)),
    Metric("relearn_forget_mc_world_forget", "forget MC, relearned ↓", LOWER, (ROBUSTNESS,)),
    Metric("mc_world_retain", "retain MC, cloze ↑", HIGHER, (SEEDS,)),
)
METRICS: dict[str, Metric] = {m.key: m for m in REGISTRY}
MC_PREFIX = "mc_"  # the multiple-choice family: mc_<set>, one per set evaluated


def columns(table: str) -> list[Metric]:
    """The registered columns of `table`, in registry order (the multiple-choice family not included)."""
    if table not in TABLES:
        raise ValueError(f"table '{table}': unknown (choose from {list(TABLES)})")
    return [m for m in REGISTRY if table in m.tables]


def mc_column(key: str) -> Metric:
    """The main table's column of a multiple-choice set's accuracy `mc_<set>`: "<set> acc", a share; which way is
    better depends on the set (forget authors: lower; world facts: higher), so it has no arrow."""
    return Metric(key, f"{key.removeprefix(MC_PREFIX)} acc", NEAREST, (MAIN,))


def mc_keys(summaries) -> list[str]:
    """The multiple-choice accuracies `mc_<set>` some of `summaries` has, sorted (not their `_std`)."""
    return sorted({k for s in summaries for k in s if k.startswith(MC_PREFIX) and not k.endswith("_std")})


def metric(key: str) -> Metric | None:
    """The metric summary key `key` is (a registered one, or a multiple-choice accuracy), else None."""
    return METRICS.get(key) or (mc_column(key) if key.startswith(MC_PREFIX) else None)


def value_range(key: str) -> tuple[float | None, float | None]:
    """The range of a summary value of `key`, a metric or its `<metric>_std` (a standard deviation: ≥ 0)."""
    if key.endswith("_std"):
        return 0.0, None
    found = metric(key)
    return found.range if found is not None else ANY
