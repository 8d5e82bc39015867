"""The metrics the tables show, each registered once: its summary key, column title, direction, the tables it is a
column of, and the range its values lie in. The report (`studies/report.py`: the main and robustness tables, and the
summaries' checks) and the table over model seeds with its significance tests (`studies/significance.py`) read their
columns from here; the evaluation writes the keys.

A new metric is one `Metric` entry here (its key, as the evaluation writes it to the summary) plus the code that
computes it. Metrics named at evaluation time are a `Family`, not entries: every `mc_<set>` key of a summary (the
sets of `evaluate.multiple_choice`) is a column of the main table titled "<set> acc", and every `lmeval_<task>_...`
key (`evaluate.lm_eval`, lm_eval_tasks.py) one titled "lm-eval <task>_...", its `_stderr` checked but no column.
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
SPREAD = (0.0, None)       # a standard deviation over seeds (`<key>_std`) or a standard error (`<key>_stderr`)
SPREAD_SUFFIXES = ("_std", "_stderr")


@dataclass(frozen=True)
class Metric:
    key: str                   # the evaluation summary's key (a run's: the mean over seeds; `<key>_std` beside it)
    title: str                 # the column's title, with its direction
    better: int                # HIGHER, LOWER or NEAREST
    tables: tuple[str, ...]    # the tables it is a column of, in registry order; none: checked in summaries only
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
    # every other attack's privleak against the retain model's AUC of it (evaluate.mia): GradNorm's and Reference's
    # are columns; the others', beside min_k's privleak and the Min-K%++ AUC, are checked but not shown
    Metric("privleak_gradnorm", "privleak, GradNorm (→0)", NEAREST, (ROBUSTNESS,), ANY),
    Metric("privleak_reference", "privleak, Reference (→0)", NEAREST, (ROBUSTNESS,), ANY),
    Metric("privleak_loss", "privleak, LOSS (→0)", NEAREST, (), ANY),
    Metric("privleak_zlib", "privleak, Zlib (→0)", NEAREST, (), ANY),
    Metric("privleak_min_k_plus_plus", "privleak, Min-K%++ (→0)", NEAREST, (), ANY),
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


@dataclass(frozen=True)
class Family:
    """Metrics named at evaluation time, one per set or task evaluated: every `<prefix><name>` key of a summary
    (not a spread: `_std`, `_stderr`) is a column of `tables`, titled `title` with `name` filled in."""

    prefix: str
    title: str                 # "{name} acc": `name` is the key without the prefix
    range: tuple[float | None, float | None]
    tables: tuple[str, ...] = (MAIN,)
    better: int = NEAREST      # no one direction for the whole family (forget authors' accuracy: lower; MMLU's: higher)

    def column(self, key: str) -> Metric:
        return Metric(key, self.title.format(name=key.removeprefix(self.prefix)), self.better, self.tables, self.range)

    def keys(self, summaries) -> list[str]:
        """The family's keys some of `summaries` has, sorted."""
        return sorted({k for s in summaries for k in s
                       if k.startswith(self.prefix) and not k.endswith(SPREAD_SUFFIXES)})


# Multiple choice (evaluate.multiple_choice): each set's accuracy, a share.
MC = Family("mc_", "{name} acc", SHARE)
# lm-eval's own tasks (evaluate.lm_eval): each task's metric and filter; any finite value (perplexity, BLEU are not
# shares); its standard error `..._stderr` stays in the summaries.
LMEVAL = Family("lmeval_", "lm-eval {name}", ANY)
FAMILIES = (MC, LMEVAL)  # in column order, after the registered columns


def columns(table: str) -> list[Metric]:
    """The registered columns of `table`, in registry order (the families not included: `family_columns`)."""
    if table not in TABLES:
        raise ValueError(f"table '{table}': unknown (choose from {list(TABLES)})")
    return [m for m in REGISTRY if table in m.tables]


def family_columns(table: str, summaries) -> list[Metric]:
    """The columns of `table` the families give for the keys some of `summaries` has: family by family, sorted."""
    summaries = list(summaries)
    return [f.column(k) for f in FAMILIES if table in f.tables for k in f.keys(summaries)]


def metric(key: str) -> Metric | None:
    """The metric summary key `key` is (a registered one, or a family's: a family's `_stderr` is one too, whose
    range `value_range` gives by its suffix), else None."""
    if key in METRICS:
        return METRICS[key]
    family = next((f for f in FAMILIES if key.startswith(f.prefix)), None)
    return family.column(key) if family is not None else None


def value_range(key: str) -> tuple[float | None, float | None]:
    """The range of a summary value of `key`, a metric or its spread (a standard deviation or error: ≥ 0)."""
    if key.endswith(SPREAD_SUFFIXES):
        return SPREAD
    found = metric(key)
    return found.range if found is not None else ANY
