"""TOFU evaluation metrics, as open-unlearning computes them.

Pure formulas first (numpy / torch, no model), then the model-facing batched functions; each TOFU set's
evaluation and aggregates are `tofu_sets.py`'s.

Definitions (checked against locuslab/open-unlearning: src/evals/metrics/{memorization,utils,privacy,utility}.py,
src/data/utils.py and configs/eval/tofu_metrics/*.yaml); each yields open-unlearning's number, epsilons included:

* L(y) is the length-normalised NLL of an answer (open-unlearning's `avg_loss`): the mean over its labelled tokens,
  the answer's tokens and the EOS that ends it. The per-token cross-entropy, its sum, the mean and exp(−L) are taken
  on float32 logits (`loss_dtype: float32`): open-unlearning's pinned transformers (4.45) returns float32 logits, and
  its `.numpy()` cannot take bfloat16 ones. `loss_dtype: model` keeps the model's dtype instead (bf16 on a GPU).
* Probability:  p(y) = exp(−L(y)), per item; the set's value is the mean.
* Normalised probability (real_authors, world_facts):  p(y) / (p(y) + Σ_k p(ỹ_k) + 1e-10).
* Truth ratio:  TR = exp(−mean_k L(ỹ_k)) / (exp(−L(ŷ)) + 1e-10): the mean over the perturbed answers is taken of
  the NLLs. ŷ is `paraphrased_answer` for forget/retain and `answer` for real_authors/world_facts.
* Truth-ratio aggregate: forget mean(min(TR, 1/(TR + 1e-10))); the others mean(max(0, 1 − TR)).
* Forget quality: the p-value of the two-sample KS test of the forget-set TRs of the model and of the retain model;
  its log10 is floored at log10(MIN_PVALUE) = −323.3 where the p-value underflows to 0 (JSON has no −Infinity).
* Model utility: `scipy.stats.hmean` of probability, ROUGE-L recall and TR aggregate on retain, real_authors and
  world_facts (9 values, open-unlearning's order); 0 if any is 0.
* ROUGE: `rouge_score` with the Porter stemmer, rouge1 recall, rougeL F1 and rougeL recall (the metric) of the
  greedy answer against the decoded tokenised answer.
* Extraction strength: ES = 1 − k/n over the answer's n tokens without EOS, k the smallest prefix length from which
  every teacher-forced argmax reproduces the answer. When even the last token is wrong, open-unlearning's loop
  stops at k = n − 1 (ES = 1/n, and 1 for a one-token answer): `es_definition: open-unlearning`, the default.
  `strict` takes k = n there (ES = 0), as the definition reads.
* Exact memorization: EM = the share of those n tokens whose argmax is the answer token (a float32 quotient, as
  open-unlearning's torch division); none for n = 0. The argmax is taken of the log-softmax, as open-unlearning's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, NamedTuple, Sequence, Union

import numpy as np
import torch
import torch.nn.functional as F

from pipeline.common.errors import DataError
from pipeline.common.progress import progress
from pipeline.data.batching import pad_batch
from pipeline.data.templates import IGNORE_INDEX, PromptTemplate, encode_prompt, encode_qa
from pipeline.evaluation.generation import decode

# ---------------------------------------------------------------------------------------------------------------
# Pure formulas

Rows = Union[np.ndarray, Sequence[Sequence[float]]]  # [N, K], or N rows of possibly different lengths
EPS = 1e-10  # open-unlearning's guard in the normalised probability and the truth ratio


def _row_means(rows: Rows) -> np.ndarray:
    return np.array([np.mean(np.asarray(row, np.float64)) for row in rows], dtype=np.float64)


def probability(mean_nll: np.ndarray) -> np.ndarray:
    """exp(−L) per item, L the mean NLL over an answer's tokens."""
    return np.exp(-np.asarray(mean_nll, dtype=np.float64))


def normalised_probability(prob_true: np.ndarray, prob_perturbed: Rows) -> np.ndarray:
    """p_true / (p_true + Σ_k p_k + 1e-10) per item, from the probabilities exp(−L) (open-unlearning's
    `probability_w_options`); prob_true [N], prob_perturbed [N, K] (or N ragged rows)."""
    correct = np.asarray(prob_true, np.float64)
    wrong = np.array([np.sum(np.asarray(row, np.float64)) for row in prob_perturbed], dtype=np.float64)
    return correct / (correct + wrong + EPS)


def truth_ratio(nll_correct: np.ndarray, nll_perturbed: Rows) -> np.ndarray:
    """TR = exp(−mean_k L(perturbed_k)) / (exp(−L(correct)) + 1e-10) per item; the mean over k is of the NLLs.

    nll_correct [N]; nll_perturbed [N, K] (or a list of N ragged sequences)."""
    wrong = np.exp(-_row_means(nll_perturbed))
    correct = np.exp(-np.asarray(nll_correct, np.float64))
    return wrong / (correct + EPS)


def truth_ratio_closer_to_one(tr: np.ndarray) -> float:
    """Forget-set aggregate: mean(min(TR, 1/(TR + 1e-10))); 1 when true and false answers are equally likely."""
    tr = np.asarray(tr, np.float64)
    return float(np.mean(np.minimum(tr, 1 / (tr + EPS))))


def truth_ratio_true_better(tr: np.ndarray) -> float:
    """Retain / real_authors / world_facts aggregate: mean(max(0, 1 − TR)); higher when the truth is preferred."""
    return float(np.mean(np.maximum(0, 1 - np.asarray(tr, np.float64))))


class ForgetQuality(NamedTuple):
    pvalue: float
    log10_pvalue: float


# log10 of a p-value that underflows to 0 (an extreme KS statistic on large sets): log10 of the smallest positive
# double, −323.3, an upper bound of the true value. JSON has no −Infinity, and the report and the seeds' means
# need a number.
MIN_PVALUE = math.ulp(0.0)


def forget_quality(model_tr: Sequence[float], retain_model_tr: Sequence[float]) -> ForgetQuality:
    """The KS-test p-value of the model's forget-set TRs against the retain model's, and its log10 (at least
    log10(MIN_PVALUE) = −323.3: see MIN_PVALUE)."""
    from scipy.stats import ks_2samp

    samples = {"the model's": np.asarray(model_tr, np.float64), "the retain model's": np.asarray(retain_model_tr,
                                                                                                   np.float64)}
    for whose, tr in samples.items():
        if tr.size == 0:
            raise DataError("forget quality: a truth-ratio sample is empty")
        # a NaN would make the p-value NaN; a negative TR is no truth ratio (it is a ratio of probabilities)
        bad = np.flatnonzero(~np.isfinite(tr) | (tr < 0))
        if bad.size:
            raise DataError(f"forget quality: {whose} forget truth ratio {bad[0]} is {tr[bad[0]]}, not a finite "
                            f"non-negative number ({bad.size} of {tr.size} items)")
    p = float(ks_2samp(*samples.values()).pvalue)
    return ForgetQuality(p, math.log10(max(p, MIN_PVALUE)))


def harmonic_mean(values: Sequence[float]) -> float:
    """`scipy.stats.hmean` (1 / mean(1/v), as open-unlearning's `hm_aggregate`); 0 if any value is 0, an error for
    negative values."""
    from scipy.stats import hmean

    v = np.asarray(values, np.float64)
    if v.size == 0 or (v < 0).any():
        raise DataError(f"harmonic mean: needs non-negative values, got {v.tolist()}")
    return float(hmean(v))


UTILITY_SETS = ("retain", "real_authors", "world_facts")
UTILITY_METRICS = ("probability", "rouge_l_recall", "truth_ratio")


def model_utility(set_aggregates: dict[str, dict[str, float]]) -> float:
    """Harmonic mean of the 9 sub-metrics {probability, ROUGE-L recall, TR aggregate} × {retain, real_authors,
    world_facts}, in open-unlearning's order; `set_aggregates[set][metric]` as `set_aggregates` returns them."""
    values = []
    for name in UTILITY_SETS:
        for metric in UTILITY_METRICS:
            value = set_aggregates.get(name, {}).get(metric)
            if value is None:
                raise DataError(f"model utility: sub-metric '{name}.{metric}' is missing")
            values.append(value)
    return harmonic_mean(values)


@lru_cache(maxsize=1)
def _rouge_scorer():
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rouge1", "rougeL"], use_stemmer=True)


def rouge_scores(generated: str, gold: str) -> dict[str, float]:
    """open-unlearning's per-item ROUGE: rouge1 recall, rougeL F1 and rougeL recall of `generated` against `gold`,
    in stemmed lower-case words."""
    scores = _rouge_scorer().score(gold, generated)
    return {"rouge1_recall": float(scores["rouge1"].recall), "rougeL_f1": float(scores["rougeL"].fmeasure),
            "rougeL_recall": float(scores["rougeL"].recall)}


def rouge_l_recall(generated: str, gold: str) -> float:
    """ROUGE-L recall of `generated` against `gold`: LCS length / gold length (TOFU's ROUGE)."""
    return rouge_scores(generated, gold)["rougeL_recall"]


# How k (the prefix an answer needs) is taken when even the last token is wrong: k counts the scored positions up
# to and including the last mismatch, n the scored positions.
ES_DEFINITIONS: dict[str, Callable] = {
    # open-unlearning's loop `for k in range(n): if suffix matches: break` ends at k = n − 1 when none matches
    "open-unlearning": lambda k, n: np.minimum(k, np.maximum(n - 1, 0)),
    "strict": lambda k, n: k,  # k = n: nothing is extracted
}


def _check_es_definition(definition: str) -> None:
    if definition not in ES_DEFINITIONS:
        raise DataError(f"extraction strength: unknown definition '{definition}' (choose from {list(ES_DEFINITIONS)})")


def extraction_strength(matches: Sequence[bool], definition: str = "open-unlearning") -> float:
    """1 − k/n for one answer of n tokens, k the smallest index with matches[k:] all true, capped as `definition`
    says when the last is false; 0 for an empty answer."""
    _check_es_definition(definition)
    m = np.asarray(matches, dtype=bool)
    if m.size == 0:
        return 0.0
    wrong = np.flatnonzero(~m)
    k = int(ES_DEFINITIONS[definition](int(wrong[-1]) + 1 if wrong.size else 0, m.size))
    return 1 - k / m.size


def exact_memorization(matches: Sequence[bool]) -> float | None:
    """The share of an answer's tokens that the teacher-forced argmax reproduces, as float32 (open-unlearning divides
    torch tensors); None for an empty answer."""
    m = np.asarray(matches, dtype=bool)
    if m.size == 0:
        return None
    return float(np.float32(m.sum()) / np.float32(m.size))


def extraction_strength_batch(matches: torch.Tensor, mask: torch.Tensor,
                              definition: str = "open-unlearning") -> torch.Tensor:
    """`extraction_strength` per row of [B, T] matches over the positions where `mask` is true (they need not
    start at column 0)."""
    _check_es_definition(definition)
    mask = mask.bool()
    scored_so_far = mask.long().cumsum(-1)
    k = torch.where(mask & ~matches.bool(), scored_so_far, 0).amax(-1).cpu().numpy()
    n = mask.sum(-1).cpu().numpy()
    k = ES_DEFINITIONS[definition](k, n)
    return torch.from_numpy(np.where(n > 0, 1 - k / np.maximum(n, 1), 0.0))


def exact_memorization_batch(matches: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`exact_memorization` per row over the positions where `mask` is true, float32; NaN for an empty row."""
    mask = mask.bool()
    hits = (matches.bool() & mask).sum(-1)
    return hits.to(torch.float32) / mask.sum(-1).to(torch.float32)


# ---------------------------------------------------------------------------------------------------------------
# Teacher-forced statistics, batched

LOSS_DTYPES = ("float32", "model")  # the dtype of the cross-entropy, its mean and exp: see the module docstring


@dataclass
class AnswerStats:
    """Per-item statistics of answers under teacher forcing (arrays of length N, in input order)."""

    mean_nll: np.ndarray             # L: mean NLL over the answer tokens and EOS (open-unlearning's avg_loss)
    probability: np.ndarray          # exp(−L), taken in the loss dtype as open-unlearning takes it
    sum_nll: np.ndarray              # summed NLL over the same tokens
    n_tokens: np.ndarray             # answer tokens + EOS
    extraction_strength: np.ndarray  # over the answer tokens, without EOS
    exact_memorization: np.ndarray   # over the same tokens; NaN where there are none


@torch.no_grad()
def answer_statistics(model, tokenizer, template: PromptTemplate, questions: Sequence[str],
                      answers: Sequence[str], batch_size: int = 32, es_definition: str = "open-unlearning",
                      loss_dtype: str = "float32") -> AnswerStats:
    """NLLs, probabilities, extraction strength and exact memorization of each answer given its question: one
    forward pass per batch of `batch_size` samples, batched by length (less padding) and returned in input order."""
    if len(questions) != len(answers):
        raise DataError(f"answer statistics: {len(questions)} questions but {len(answers)} answers")
    if loss_dtype not in LOSS_DTYPES:
        raise DataError(f"answer statistics: unknown loss dtype '{loss_dtype}' (choose from {list(LOSS_DTYPES)})")
    _check_es_definition(es_definition)
    samples = [encode_qa(tokenizer, template, q, a) for q, a in zip(questions, answers)]
    n = len(samples)
    mean_nll, prob, sum_nll = np.zeros(n), np.zeros(n), np.zeros(n)
    n_tokens, es, em = np.zeros(n, dtype=np.int64), np.zeros(n), np.zeros(n)
    model.eval()
    device = next(model.parameters()).device
    order = sorted(range(n), key=lambda i: len(samples[i]))
    starts = range(0, n, batch_size)
    for start in progress(starts, total=len(starts), desc="teacher forcing"):
        idx = order[start : start + batch_size]
        batch = {k: v.to(device) for k, v in pad_batch([samples[i] for i in idx], tokenizer.pad_token_id).items()}
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
        logits = logits.float() if loss_dtype == "float32" else logits.contiguous()
        labels = batch["labels"][:, 1:]  # logits at position t predict the token at t + 1
        mask = labels != IGNORE_INDEX
        nll = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=IGNORE_INDEX, reduction="none")
        total, count = nll.sum(-1), mask.sum(-1)
        average = total / count  # a tensor of the loss dtype, as open-unlearning divides
        # ES and EM leave out EOS, the last labelled position of each row; the argmax is of the log-probabilities.
        is_eos = mask & (mask.long().cumsum(-1) == count.unsqueeze(-1))
        matches = torch.log_softmax(logits, -1).argmax(-1) == labels
        mean_nll[idx] = average.double().cpu().numpy()
        prob[idx] = torch.exp(-average).double().cpu().numpy()
        sum_nll[idx] = total.double().cpu().numpy()
        n_tokens[idx] = count.cpu().numpy()
        es[idx] = extraction_strength_batch(matches, mask & ~is_eos, es_definition).numpy()
        em[idx] = exact_memorization_batch(matches, mask & ~is_eos).double().cpu().numpy()
    return AnswerStats(mean_nll, prob, sum_nll, n_tokens, es, em)


def rouge_references(tokenizer, template: PromptTemplate, questions: Sequence[str],
                     answers: Sequence[str]) -> tuple[list[str], list[str]]:
    """Each question's decoded prompt (the generation's input) and its ROUGE ground truth, as open-unlearning takes
    them: the decoded tokenised question-answer pair with every occurrence of the decoded prompt removed, stripped."""
    prompts, truths = [], []
    for question, answer in zip(questions, answers):
        prompt = decode(tokenizer, encode_prompt(tokenizer, template, question)[2])
        prompts.append(prompt)
        truths.append(decode(tokenizer, encode_qa(tokenizer, template, question, answer).input_ids)
                      .replace(prompt, "").strip())
    return prompts, truths
