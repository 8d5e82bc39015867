"""TOFU's sets: each set's per-item metrics from one teacher-forced and one greedy pass, and its aggregates
(`SET_METRICS`, each a metric of `registry.py`'s `TOFU_SET`); the formulas they use are `tofu_metrics.py`'s.

A forget or retain set of plain question-answer rows (a user's own data: `evaluate.perturbed` false) is scored by the
same code without the answer variants: no truth ratio, and no paraphrased or perturbed columns (`PERTURBED_ONLY`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from pipeline.common.errors import DataError
from pipeline.data.templates import PromptTemplate
from pipeline.evaluation.generation import greedy_answers
from pipeline.evaluation.tofu_metrics import (AnswerStats, answer_statistics, normalised_probability,
                                              rouge_references, rouge_scores, truth_ratio,
                                              truth_ratio_closer_to_one, truth_ratio_true_better)


# ---------------------------------------------------------------------------------------------------------------
# One TOFU perturbed set


@dataclass(frozen=True)
class SetSpec:
    """How a kind of TOFU set is scored."""

    correct_field: str                         # the answer in the truth ratio's denominator
    tr_aggregate: Callable[[np.ndarray], float]
    normalise_probability: bool                # TOFU reports p / (p + Σ p_perturbed) for these sets


SET_SPECS: dict[str, SetSpec] = {
    "forget": SetSpec("paraphrased_answer", truth_ratio_closer_to_one, False),
    "retain": SetSpec("paraphrased_answer", truth_ratio_true_better, False),
    "real_authors": SetSpec("answer", truth_ratio_true_better, True),
    "world_facts": SetSpec("answer", truth_ratio_true_better, True),
}


@dataclass
class ItemArrays:
    """Per-item metric values of one set, in row order."""

    probability: np.ndarray
    truth_ratio: np.ndarray | None  # None: plain rows, without perturbed answers
    rouge_l_recall: np.ndarray | None  # None: a set scored without greedy answers (`generate` false)
    extraction_strength: np.ndarray
    exact_memorization: np.ndarray  # NaN where an answer has no token

    @classmethod
    def from_items(cls, items: Sequence[dict], perturbed: bool = True) -> "ItemArrays":
        """From the per-item records of `SetResult.items` (or the rows of items/<set>.parquet); `perturbed` false:
        records of plain rows, which have no truth ratio."""
        column = lambda key: np.array([np.nan if it[key] is None else it[key] for it in items], dtype=np.float64)
        generated = bool(items) and has_greedy_answers(items[0])
        return cls(column("probability"), column("truth_ratio") if perturbed else None,
                   column("rouge_l_recall") if generated else None,
                   *(column(f) for f in ("extraction_strength", "exact_memorization")))


def _mean_of_present(values: np.ndarray) -> float:
    """The mean over the items that have a value (open-unlearning leaves out EM's None)."""
    present = values[~np.isnan(values)]
    return float(np.mean(present)) if present.size else math.nan


# Per-set aggregates: name -> function of the set's item arrays and its spec.
SET_METRICS: dict[str, Callable[[ItemArrays, SetSpec], float]] = {
    "probability": lambda a, spec: float(np.mean(a.probability)),
    "truth_ratio": lambda a, spec: spec.tr_aggregate(a.truth_ratio),
    "rouge_l_recall": lambda a, spec: float(np.mean(a.rouge_l_recall)),
    "extraction_strength": lambda a, spec: float(np.mean(a.extraction_strength)),
    "exact_memorization": lambda a, spec: _mean_of_present(a.exact_memorization),
}


# The aggregates and item columns that need perturbed (and paraphrased) answers: none for plain rows.
PERTURBED_METRICS = ("truth_ratio",)
PERTURBED_ONLY = ("truth_ratio", "paraphrased_mean_nll", "paraphrased_probability", "perturbed_mean_nll",
                  "perturbed_probability")
PLAIN_KINDS = ("forget", "retain")  # the kinds whose probability needs no perturbed answers (no normalisation)
# The aggregates and item columns of the greedy answers: none for a set scored with `generate` false.
GENERATED_METRICS = ("rouge_l_recall",)
GENERATED_ONLY = ("rouge_l_recall", "rouge1_recall", "rouge_l_f1", "generated")


def has_greedy_answers(item: dict) -> bool:
    """Whether a set's per-item record (or its items file's columns) holds GENERATED_ONLY's: false for a set
    scored with `generate` false (evaluate.forget_rouge: false)."""
    return "rouge_l_recall" in item


def set_aggregates(items: Sequence[dict], kind: str, perturbed: bool = True) -> dict[str, float]:
    """SET_METRICS over one set's per-item records (without PERTURBED_METRICS for plain rows, nor GENERATED_METRICS
    for a set scored without greedy answers)."""
    arrays, spec = ItemArrays.from_items(items, perturbed), SET_SPECS[kind]
    return {metric: fn(arrays, spec) for metric, fn in SET_METRICS.items()
            if (perturbed or metric not in PERTURBED_METRICS)
            and (arrays.rouge_l_recall is not None or metric not in GENERATED_METRICS)}


@dataclass
class SetResult:
    """`probability` is TOFU's "Prob.": exp(−L(answer)) for forget/retain, normalised for the other two."""

    items: list[dict]             # per row: ITEM_COLUMNS (the paraphrased ones for forget/retain only, none of
                                  # PERTURBED_ONLY for plain rows)
    aggregates: dict[str, float]  # SET_METRICS over the items
    truth_ratios: np.ndarray | None  # per row, for forget quality; None for plain rows


# The per-item record of a set (items/<set>.parquet holds these, and open_unlearning.py exports them).
ITEM_COLUMNS = (
    "index",                                         # the row's position in its split (open-unlearning's index)
    "probability", "truth_ratio", "rouge_l_recall", "extraction_strength", "exact_memorization",
    "answer_mean_nll", "answer_probability",         # L(answer) and exp(−L), unnormalised
    "paraphrased_mean_nll", "paraphrased_probability",  # forget and retain only
    "perturbed_mean_nll", "perturbed_probability",   # lists, one per perturbed answer
    "rouge1_recall", "rouge_l_f1", "prompt", "ground_truth", "generated",
)


def _check_rows(rows: Sequence[dict], fields: Sequence[str], where: str) -> None:
    if not rows:
        raise DataError(f"{where}: no rows")
    for i, row in enumerate(rows, start=1):
        for field in fields:
            value = row.get(field) if isinstance(row, dict) else None
            if field == "perturbed_answer":
                ok = isinstance(value, list) and value and all(isinstance(v, str) for v in value)
            else:
                ok = isinstance(value, str)
            if not ok:
                raise DataError(f"{where}: row {i}: missing or malformed field '{field}'")


def evaluate_set(model, tokenizer, template: PromptTemplate, rows: Sequence[dict], kind: str,
                 batch_size: int = 32, max_new_tokens: int = 64, name: str | None = None,
                 es_definition: str = "open-unlearning", loss_dtype: str = "float32",
                 perturbed: bool = True, generate: bool = True) -> SetResult:
    """Score one TOFU perturbed set of `kind` (forget, retain, real_authors, world_facts) named `name`; with
    `perturbed` false, a forget or retain set of plain question-answer rows (`_plain_set`).

    Teacher-forced passes: the answers, the paraphrased answers (forget/retain) and all perturbed answers
    flattened into one list; then one batched greedy generation for ROUGE, unless `generate` is false (no ROUGE:
    none of GENERATED_ONLY in the items; a tuning trial reads ES, and the generation is most of a set's time)."""
    if kind not in SET_SPECS:
        raise DataError(f"evaluate_set: unknown set kind '{kind}' (choose from {sorted(SET_SPECS)})")
    spec, where = SET_SPECS[kind], name or kind
    if not perturbed:
        return _plain_set(model, tokenizer, template, rows, kind, batch_size, max_new_tokens, where, es_definition,
                          loss_dtype, generate)
    _check_rows(rows, ("question", "answer", spec.correct_field, "perturbed_answer"), where)

    def stats_of(questions: list[str], answers: list[str]) -> AnswerStats:
        return answer_statistics(model, tokenizer, template, questions, answers, batch_size, es_definition,
                                 loss_dtype)

    questions, answers = [r["question"] for r in rows], [r["answer"] for r in rows]
    stats = stats_of(questions, answers)
    paraphrased = spec.correct_field == "paraphrased_answer"
    correct = stats_of(questions, [r[spec.correct_field] for r in rows]) if paraphrased else stats
    owner = [i for i, r in enumerate(rows) for _ in r["perturbed_answer"]]
    flat = stats_of([questions[i] for i in owner], [p for r in rows for p in r["perturbed_answer"]])
    bounds = np.cumsum([0] + [len(r["perturbed_answer"]) for r in rows])
    spans = list(zip(bounds[:-1], bounds[1:]))
    perturbed_nll = [flat.mean_nll[a:b] for a, b in spans]
    perturbed_prob = [flat.probability[a:b] for a, b in spans]

    prob = normalised_probability(stats.probability, perturbed_prob) if spec.normalise_probability \
        else stats.probability
    tr = truth_ratio(correct.mean_nll, perturbed_nll)
    greedy = _greedy(model, tokenizer, template, questions, answers, batch_size, max_new_tokens, generate)

    items = []
    for i in range(len(rows)):
        em = stats.exact_memorization[i]
        item = {"index": i, "probability": float(prob[i]), "truth_ratio": float(tr[i]),
                "extraction_strength": float(stats.extraction_strength[i]),
                "exact_memorization": None if np.isnan(em) else float(em),
                "answer_mean_nll": float(stats.mean_nll[i]), "answer_probability": float(stats.probability[i])}
        if paraphrased:
            item |= {"paraphrased_mean_nll": float(correct.mean_nll[i]),
                     "paraphrased_probability": float(correct.probability[i])}
        item |= {"perturbed_mean_nll": perturbed_nll[i].tolist(), "perturbed_probability": perturbed_prob[i].tolist(),
                 **greedy[i]}
        items.append(_in_column_order(item))
    return SetResult(items, set_aggregates(items, kind), tr)


def _greedy(model, tokenizer, template: PromptTemplate, questions: list[str], answers: list[str], batch_size: int,
            max_new_tokens: int, generate: bool) -> list[dict]:
    """Per question, the greedy answer and its ROUGE against the reference (the item columns from
    `rouge1_recall` on, and rouge_l_recall), or only the prompt and reference where `generate` is false."""
    prompts, truths = rouge_references(tokenizer, template, questions, answers)
    if not generate:
        return [{"prompt": p, "ground_truth": t} for p, t in zip(prompts, truths)]
    generated = greedy_answers(model, tokenizer, template, questions, max_new_tokens=max_new_tokens,
                               batch_size=batch_size)
    rouge = [rouge_scores(g, t) for g, t in zip(generated, truths)]
    return [{"rouge_l_recall": r["rougeL_recall"], "rouge1_recall": r["rouge1_recall"], "rouge_l_f1": r["rougeL_f1"],
             "prompt": p, "ground_truth": t, "generated": g} for r, p, t, g in zip(rouge, prompts, truths, generated)]


def _in_column_order(item: dict) -> dict:
    """The item's values in ITEM_COLUMNS' order, the items file's column order (a column it lacks, such as ROUGE
    without greedy answers, is left out, not written as a null a reader would average)."""
    return {k: item[k] for k in ITEM_COLUMNS if k in item}


def _plain_set(model, tokenizer, template: PromptTemplate, rows: Sequence[dict], kind: str, batch_size: int,
               max_new_tokens: int, where: str, es_definition: str, loss_dtype: str, generate: bool) -> SetResult:
    """`evaluate_set` of plain question-answer rows: the answers' teacher-forced pass and the greedy one, each
    per-item value as for a perturbed set (probability unnormalised, as forget's and retain's are there)."""
    if kind not in PLAIN_KINDS:
        raise DataError(f"evaluate_set: a {kind} set needs perturbed answers (its probability is normalised over "
                        f"them); plain question-answer rows are scored as {' or '.join(PLAIN_KINDS)}")
    _check_rows(rows, ("question", "answer"), where)
    questions, answers = [r["question"] for r in rows], [r["answer"] for r in rows]
    stats = answer_statistics(model, tokenizer, template, questions, answers, batch_size, es_definition, loss_dtype)
    greedy = _greedy(model, tokenizer, template, questions, answers, batch_size, max_new_tokens, generate)
    items = []
    for i in range(len(rows)):
        em = stats.exact_memorization[i]
        items.append(_in_column_order({
            "index": i, "probability": float(stats.probability[i]),
            "extraction_strength": float(stats.extraction_strength[i]),
            "exact_memorization": None if np.isnan(em) else float(em),
            "answer_mean_nll": float(stats.mean_nll[i]), "answer_probability": float(stats.probability[i]),
            **greedy[i]}))
    return SetResult(items, set_aggregates(items, kind, perturbed=False), None)
