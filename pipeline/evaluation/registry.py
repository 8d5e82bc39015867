"""The metrics registry: the only list of the metrics TokenUnlearn computes. Each is one `Metric`: its key as the
evaluator writes it, its title and direction, the range its values lie in, the benchmark or attack whose evaluator
writes it, the tables it is a column of, its place in the headline (`dvc metrics show`), and the metrics it is
computed from. The evaluation checks every key it writes against this list (`unregistered`); the monitor, the
report, the significance tests over model seeds, MUSE's report and the stages' log lines read their keys, titles
and labels from it.

A new metric is one `Metric` here plus the function that computes it in its benchmark's module. Metrics named at
evaluation time are a `Family`, not entries: every `mc_<set>` key of a summary (the sets of
`evaluate.multiple_choice`) is a column of the main table titled "<set> acc", and every `lmeval_<task>_...` key
(`evaluate.lm_eval`, lm_eval_tasks.py) one titled "lm-eval <task>_...", its `_stderr` checked but no column. An
attack's repeat of a metric is an `Attacked` key: `q<bits>_<key>` (the quantization attack), `relearn_<how>_<key>`
(the relearning attack), with the metric's range.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pipeline.common.errors import TokenUnlearnError

# Directions: which way is better.
HIGHER, LOWER, NEAREST = +1, -1, 0  # NEAREST: nearest a reference (privleak: 0; an AUC: the retain model's)
ARROWS = {HIGHER: "↑", LOWER: "↓", NEAREST: "→"}
# The tables.
MAIN = "main"              # the paper's Table 1: report's results.md and results.csv, its ablations and plots
ROBUSTNESS = "robustness"  # is it forgotten or only hidden: report's robustness table, robustness.csv
SEEDS = "seeds"            # the table over model seeds and its paired significance tests (report-seeds)
TABLES = (MAIN, ROBUSTNESS, SEEDS)
# Ranges a value must lie in (None: unbounded on that side).
SHARE = (0.0, 1.0)         # ES, EM, accuracy, AUC, model utility
PERCENT = (0.0, 100.0)     # MUSE's ROUGE-L F1 in percent
LOG10_P = (None, 0.0)      # log10 of a p-value
ANY = (None, None)
SPREAD = (0.0, None)       # a standard deviation over seeds (`<key>_std`) or a standard error (`<key>_stderr`)
SPREAD_SUFFIXES = ("_std", "_stderr")
# The benchmarks and attacks, each the evaluator that writes its metrics. TOFU's per-set aggregates sit under each
# set's name in the summary (`summary["forget"]["truth_ratio"]`); MUSE's in a MUSE evaluation's summary; the
# monitor's in the loss curves of an unlearning run; every other at the top of `evaluate`'s summary.
TOFU_SET = "tofu_set"
TOFU = "tofu"
PARAPHRASE = "paraphrase"
MIA = "mia"
QUANTIZATION = "quantization"
RELEARNING = "relearning"
MULTIPLE_CHOICE = "multiple_choice"
LM_EVAL = "lm_eval"
MUSE = "muse"
MONITOR = "monitor"
SAMPLING = "sampling"
IN_EVALUATE_SUMMARY = (TOFU, PARAPHRASE, MIA, QUANTIZATION, RELEARNING, MULTIPLE_CHOICE, LM_EVAL, SAMPLING)
# `evaluate`'s summary key {metric or evaluator: why it was not computed} (evaluate.perturbed false: plain splits);
# no number, so no metric, and `unregistered` passes it as it passes `definitions`
SKIPPED = "skipped"
# membership inference's attacks (mia.MIA_ATTACKS; a test keeps the two lists equal) and the one privleak reads
MIA_ATTACKS = ("loss", "zlib", "min_k", "min_k_plus_plus", "gradnorm", "reference")


@dataclass(frozen=True)
class Metric:
    key: str                   # as its evaluator writes it (a run's: the mean over seeds; `<key>_std` beside it)
    title: str                 # the column's title, with its direction
    better: int                # HIGHER, LOWER or NEAREST
    tables: tuple[str, ...] = ()  # the tables it is a column of, in registry order; none: checked, not shown
    range: tuple[float | None, float | None] = SHARE
    benchmark: str = TOFU      # the evaluator that writes it
    headline: int | None = None   # its place in the headline (`dvc metrics show`); None: not there
    depends_on: tuple[str, ...] = ()  # the registered metrics it is computed from
    label: str = ""            # its name in log lines; empty: the title without its direction
    meaning: str = ""          # one line for a report's legend, where it has one

    @property
    def name(self) -> str:
        return self.label or self.title.removesuffix(self.direction).rstrip()

    @property
    def direction(self) -> str:
        """The end of the title that says which way is better: ↑, ↓, (→0), → 0."""
        m = re.search(r"\s*(\(→[^)]*\)|[↑↓]|→ ?\S+)$", self.title)
        return m.group(1) if m else ""


_TR = "truth_ratio"
# In column order: each table takes its entries in this order.
REGISTRY: tuple[Metric, ...] = (
    # TOFU, each set's aggregates of its items (tofu_sets.SET_METRICS computes them)
    Metric("probability", "probability ↑", HIGHER, benchmark=TOFU_SET),
    Metric("truth_ratio", "truth ratio ↑", HIGHER, benchmark=TOFU_SET, range=(0.0, None)),
    Metric("rouge_l_recall", "ROUGE-L recall ↑", HIGHER, benchmark=TOFU_SET),
    Metric("extraction_strength", "ES ↑", HIGHER, benchmark=TOFU_SET),
    Metric("exact_memorization", "EM ↑", HIGHER, benchmark=TOFU_SET),
    Metric("para_extraction_strength", "ES, paraphrased ↑", HIGHER, benchmark=TOFU_SET),
    Metric("para_rouge_l_recall", "ROUGE-L recall, paraphrased ↑", HIGHER, benchmark=TOFU_SET),
    # TOFU, the summary's headline numbers
    Metric("retain_es", "retain ES ↑", HIGHER, (MAIN, SEEDS), headline=2, depends_on=("extraction_strength",)),
    Metric("forget_es", "forget ES ↓", LOWER, (MAIN, SEEDS), headline=1, depends_on=("extraction_strength",)),
    Metric("model_utility", "MU ↑", HIGHER, (MAIN, SEEDS), headline=3, label="model utility",
           depends_on=("probability", "rouge_l_recall", _TR)),
    Metric("log10_forget_quality", "log10 FQ ↑", HIGHER, (MAIN, SEEDS), LOG10_P, headline=4,
           label="log10 forget quality", depends_on=("forget_quality",)),
    Metric("forget_quality", "forget quality ↑", HIGHER, depends_on=(_TR,)),  # the KS test against the retain model's
    Metric("forget_em", "forget EM ↓", LOWER, depends_on=("exact_memorization",)),
    Metric("retain_em", "retain EM ↑", HIGHER, depends_on=("exact_memorization",)),
    Metric("forget_rouge", "forget ROUGE-L ↓", LOWER, depends_on=("rouge_l_recall",)),  # the probes', and TOFU's
    # on plain splits (evaluate.perturbed false) with the retain set's, where model utility cannot be had
    Metric("retain_rouge", "retain ROUGE-L ↑", HIGHER, depends_on=("rouge_l_recall",)),
    # Is it forgotten or only hidden (evaluate.mia, paraphrase, quantize; the relearn stages as `relearn_*`), where
    # evaluated: each attack's forget ES and forget multiple-choice accuracy, against the same model unattacked.
    Metric("privleak", "privleak (→0)", NEAREST, (ROBUSTNESS,), ANY, benchmark=MIA, headline=5,
           depends_on=("mia_min_k_auc",)),
    Metric("mia_min_k_plus_plus_auc", "Min-K%++ AUC (→retain)", NEAREST, (ROBUSTNESS,), benchmark=MIA),
    # every other attack's privleak against the retain model's AUC of it (evaluate.mia): GradNorm's and Reference's
    # are columns; the others', beside min_k's privleak and the Min-K%++ AUC, are checked but not shown
    Metric("privleak_gradnorm", "privleak, GradNorm (→0)", NEAREST, (ROBUSTNESS,), ANY, benchmark=MIA),
    Metric("privleak_reference", "privleak, Reference (→0)", NEAREST, (ROBUSTNESS,), ANY, benchmark=MIA),
    Metric("privleak_loss", "privleak, LOSS (→0)", NEAREST, (), ANY, benchmark=MIA),
    Metric("privleak_zlib", "privleak, Zlib (→0)", NEAREST, (), ANY, benchmark=MIA),
    Metric("privleak_min_k_plus_plus", "privleak, Min-K%++ (→0)", NEAREST, (), ANY, benchmark=MIA),
    *(Metric(f"mia_{a}_auc", f"{a} AUC (→retain)", NEAREST, benchmark=MIA) for a in MIA_ATTACKS
      if a != "min_k_plus_plus"),
    Metric("forget_para_es", "forget ES, paraphrased ↓", LOWER, (ROBUSTNESS,), benchmark=PARAPHRASE,
           depends_on=("para_extraction_strength",)),
    Metric("forget_para_rouge", "forget ROUGE-L, paraphrased ↓", LOWER, benchmark=PARAPHRASE,
           depends_on=("para_rouge_l_recall",)),
    Metric("retain_para_es", "retain ES, paraphrased ↑", HIGHER, benchmark=PARAPHRASE,
           depends_on=("para_extraction_strength",)),
    Metric("retain_para_rouge", "retain ROUGE-L, paraphrased ↑", HIGHER, benchmark=PARAPHRASE,
           depends_on=("para_rouge_l_recall",)),
    Metric("q8_forget_es", "forget ES, 8-bit ↓", LOWER, (ROBUSTNESS,), benchmark=QUANTIZATION),
    Metric("q4_forget_es", "forget ES, 4-bit ↓", LOWER, (ROBUSTNESS,), benchmark=QUANTIZATION),
    Metric("relearn_before_forget_es", "forget ES, unseen rows ↓", LOWER, (ROBUSTNESS,), benchmark=RELEARNING),
    Metric("relearn_forget_forget_es", "… after relearning on forget ↓", LOWER, (ROBUSTNESS,), benchmark=RELEARNING),
    Metric("relearn_retain_forget_es", "… after relearning on retain ↓", LOWER, (ROBUSTNESS,), benchmark=RELEARNING),
    # the embedded world's multiple choice (evaluate.multiple_choice `world`, cloze; `world_letter`, letter)
    Metric("mc_world_forget", "forget MC, cloze ↓", LOWER, (ROBUSTNESS, SEEDS), benchmark=MULTIPLE_CHOICE),
    Metric("mc_world_letter_forget", "forget MC, letter ↓", LOWER, (ROBUSTNESS,), benchmark=MULTIPLE_CHOICE),
    Metric("q4_mc_world_forget", "forget MC, 4-bit ↓", LOWER, (ROBUSTNESS,), benchmark=QUANTIZATION),
    Metric("relearn_forget_mc_world_forget", "forget MC, relearned ↓", LOWER, (ROBUSTNESS,), benchmark=RELEARNING),
    Metric("mc_world_retain", "retain MC, cloze ↑", HIGHER, (SEEDS,), benchmark=MULTIPLE_CHOICE),
    # MUSE (benchmarks/muse.py, muse.py), in percent as its authors report them; its report's columns in this order
    Metric("verbmem_f", "VerbMem ↓", LOWER, range=PERCENT, benchmark=MUSE,
           meaning="ROUGE-L F1 (%) of the greedy continuation of forget excerpts against the true one: verbatim "
                   "memorisation of the forget corpus"),
    Metric("knowmem_f", "KnowMem forget ↓", LOWER, range=PERCENT, benchmark=MUSE,
           meaning="ROUGE-L F1 (%) of answers to questions on the forget corpus: knowledge of it"),
    Metric("knowmem_r", "KnowMem retain ↑", HIGHER, range=PERCENT, benchmark=MUSE,
           meaning="ROUGE-L F1 (%) of answers to questions on the retain corpus: MUSE's utility preservation"),
    Metric("privleak", "PrivLeak → 0", NEAREST, range=(-100.0, None), benchmark=MUSE,
           meaning="(AUC − AUC of the retain model) / AUC of the retain model · 100, AUC of Min-40% separating "
                   "forget from holdout texts: below 0 the forget texts still look like training data, above 0 they "
                   "look less so than to a model that never saw them"),
    Metric("utility_preserved", "utility preserved ↑", HIGHER, range=PERCENT, benchmark=MUSE,
           depends_on=("knowmem_r",)),  # MUSE's C4: KnowMem on the retain set
    Metric("privleak_min_k_plus_plus", "PrivLeak Min-K%++ → 0", NEAREST, range=ANY, benchmark=MUSE),
    # the evaluation during unlearning (monitor.py), each as stage three computes it, on a fixed subsample
    Metric("eval_forget_es", "forget ES ↓", LOWER, benchmark=MONITOR, depends_on=("extraction_strength",)),
    Metric("eval_retain_es", "retain ES ↑", HIGHER, benchmark=MONITOR, depends_on=("extraction_strength",)),
    Metric("eval_retain_mu", "retain MU ↑", HIGHER, benchmark=MONITOR,
           depends_on=("eval_retain_probability", "eval_retain_rouge", "eval_retain_truth_ratio")),
    Metric("eval_retain_probability", "retain probability ↑", HIGHER, benchmark=MONITOR),
    Metric("eval_retain_rouge", "retain ROUGE-L recall ↑", HIGHER, benchmark=MONITOR),
    Metric("eval_retain_truth_ratio", "retain truth ratio ↑", HIGHER, benchmark=MONITOR, range=(0.0, None)),
)


def of(benchmark: str) -> tuple[Metric, ...]:
    """The metrics `benchmark`'s evaluator writes, in registry order."""
    return tuple(m for m in REGISTRY if m.benchmark == benchmark)


def keys_of(benchmark: str) -> tuple[str, ...]:
    return tuple(m.key for m in of(benchmark))


# `evaluate`'s summary: its top-level metrics by key (MUSE's and the monitor's are in other files)
METRICS: dict[str, Metric] = {m.key: m for m in REGISTRY if m.benchmark in IN_EVALUATE_SUMMARY}
HEADLINE_KEYS = tuple(m.key for m in sorted((m for m in METRICS.values() if m.headline), key=lambda m: m.headline))


@dataclass(frozen=True)
class Family:
    """Metrics named at evaluation time, one per set or task evaluated: every `<prefix><name>` key of a summary
    (not a spread: `_std`, `_stderr`) is a column of `tables`, titled `title` with `name` filled in."""

    prefix: str
    title: str                 # "{name} acc": `name` is the key without the prefix
    range: tuple[float | None, float | None]
    benchmark: str
    tables: tuple[str, ...] = (MAIN,)
    better: int = NEAREST      # no one direction for the whole family (forget authors' accuracy: lower; MMLU's: higher)

    def column(self, key: str) -> Metric:
        return Metric(key, self.title.format(name=key.removeprefix(self.prefix)), self.better, self.tables,
                      self.range, self.benchmark)

    def keys(self, summaries) -> list[str]:
        """The family's keys some of `summaries` has, sorted."""
        return sorted({k for s in summaries for k in s
                       if k.startswith(self.prefix) and not k.endswith(SPREAD_SUFFIXES)})


# Multiple choice (evaluate.multiple_choice): each set's accuracy, a share.
MC = Family("mc_", "{name} acc", SHARE, MULTIPLE_CHOICE)
# lm-eval's own tasks (evaluate.lm_eval): each task's metric and filter; any finite value (perplexity, BLEU are not
# shares); its standard error `..._stderr` stays in the summaries.
LMEVAL = Family("lmeval_", "lm-eval {name}", ANY, LM_EVAL)
# The sampling attack (evaluate.sampling): for each k, the share of forget questions where one of k answers sampled
# at the attack's temperature says the fact (leak_at_<k>): lower is better, as forget ES.
LEAK = Family("leak_at_", "leak@{name} ↓", SHARE, SAMPLING, (ROBUSTNESS,), LOWER)
FAMILIES = (MC, LMEVAL, LEAK)  # in column order, after the registered columns


@dataclass(frozen=True)
class Attacked:
    """An attack's repeat of a metric: `<prefix><key>`, `key` a metric of the summary (or a family's), checked in
    its range, a column only where registered by its full key (q4_forget_es)."""

    pattern: str               # the prefix, a regular expression
    benchmark: str

    def column(self, key: str) -> Metric | None:
        m = re.fullmatch(f"({self.pattern})(.+)", key)
        base = metric(m.group(2)) if m else None
        if base is None:
            return None
        return Metric(key, f"{base.name}, {m.group(1).rstrip('_')} {base.direction}", base.better, (), base.range,
                      self.benchmark, depends_on=(base.key,))


ATTACKED = (Attacked(r"q\d+_", QUANTIZATION), Attacked(r"relearn_(?:before|forget|retain)_", RELEARNING))


def columns(table: str) -> list[Metric]:
    """The registered columns of `table`, in registry order (the families not included: `family_columns`)."""
    if table not in TABLES:
        raise ValueError(f"table '{table}': unknown (choose from {list(TABLES)})")
    return [m for m in METRICS.values() if table in m.tables]


def family_columns(table: str, summaries) -> list[Metric]:
    """The columns of `table` the families give for the keys some of `summaries` has: family by family, sorted."""
    summaries = list(summaries)
    return [f.column(k) for f in FAMILIES if table in f.tables for k in f.keys(summaries)]


def metric(key: str) -> Metric | None:
    """The metric `evaluate`'s summary key `key` is (a registered one, a family's, an attack's repeat of one: a
    family's `_stderr` is one too, whose range `value_range` gives by its suffix), else None."""
    if key in METRICS:
        return METRICS[key]
    family = next((f for f in FAMILIES if key.startswith(f.prefix)), None)
    if family is not None:
        return family.column(key)
    return next((m for a in ATTACKED if (m := a.column(key)) is not None), None)


def value_range(key: str) -> tuple[float | None, float | None]:
    """The range of a summary value of `key`, a metric or its spread (a standard deviation or error: ≥ 0)."""
    if key.endswith(SPREAD_SUFFIXES):
        return SPREAD
    found = metric(key)
    return found.range if found is not None else ANY


def label(key: str) -> str:
    """A metric's name in log lines (forget ES, model utility; MUSE's VerbMem)."""
    found = metric(key) or next((m for m in REGISTRY if m.key == key), None)
    return found.name if found is not None else key


def unregistered(summary: dict, benchmark: str | None = None) -> list[str]:
    """The numeric top-level keys of a summary that are no registered metric (nor its spread): `benchmark`'s
    where given (MUSE's summary), else `evaluate`'s."""
    known = set(keys_of(benchmark)) if benchmark else None
    found = []
    for key, value in summary.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        base = key.removesuffix("_std")
        if known is not None:
            if base not in known:
                found.append(key)
        elif metric(base) is None:
            found.append(key)
    return found


def check_registered(summary: dict, what: str, benchmark: str | None = None) -> None:
    """Every number an evaluator wrote is a metric of the registry: a key matched by its string alone would
    silently miss the report's columns and range checks."""
    unknown = unregistered(summary, benchmark)
    if unknown:
        raise TokenUnlearnError(f"evaluating {what}: {unknown} are no metric of pipeline/evaluation/registry.py: "
                                "register each (its title, direction, range and benchmark) before writing it")
