"""MUSE's metrics as its authors compute them (Shi et al., 2024; their code: muse_bench's `eval.py` and
`metrics/{verbmem,knowmem,privleak}.py`), on a MUSE source (`pipeline/data/muse.py`). All four are in percent,
as MUSE reports them:

  VerbMem   100 · mean ROUGE-L F1 (rouge-score, no stemming) of the greedy continuation of each verbmem prompt
            (at most 128 new tokens) against the ground truth `gt` cut to its first 128 tokens (the tokenizer's
            special tokens counted, as MUSE encodes it). Lower is better on forget.
  KnowMem   100 · mean ROUGE-L F1 of the greedy answer (at most 32 new tokens) to "Question: q\\nAnswer: " after the
            split's in-context examples, each "Question: q\\nAnswer: a\\n\\n", the answer cut before the first
            "\\n\\n", then "\\nQuestion", then "Question:". On forget lower is better; on retain, higher.
  Utility preserved   MUSE's C4: KnowMem on the retain set (knowmem_r), higher is better.
  PrivLeak  (AUC − AUC_retain) / AUC_retain · 100, AUC the Min-K% Prob (k = 40%) membership AUC of the privleak
            forget texts against the holdout texts in MUSE's orientation (holdout labelled 1, scored by −Min-K%,
            the mean of the lowest 40% token log-probabilities: the share of (forget, holdout) pairs whose
            holdout text scores lower than the forget text, ties one half), AUC_retain the same of the retain
            model (MUSE retrains on the retain set only). 0 is the retain model; negative is under-unlearning
            (the forget texts still stand out: a target model is near −100 on News), positive over-unlearning.

Every text is encoded as MUSE encodes it: as is, with the tokenizer's special tokens (BOS); generation is greedy
and stops at the model's EOS. Min-K%++ (Zhang et al., 2024) is scored from the same forward passes, and its
PrivLeak is reported beside MUSE's (`privleak_min_k_plus_plus`).

open-unlearning's MUSE evaluation (configs/eval/muse_metrics/*.yaml, src/evals/metrics/{memorization,privacy}.py,
src/data/utils.py) differs: its ROUGE stems words (rouge-score's Porter stemmer); VerbMem's reference is the whole
`gt` (up to 2048 tokens), not its first 128 tokens, and is tokenized after "prompt + ' '"; its Min-K% leaves out the
last token of each text and reads at most 2048 tokens; its AUC is labelled the other way round, so its privleak
takes 1 − AUC of both models first (the same number) and adds 1e-10 to the denominator; without the retain
model's logs it takes AUC_retain = 0.5; its references are decoded from their tokens. Batching aside, the rest is
the same.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Sequence

import numpy as np

from pipeline.common.errors import DataError, ParamError
from pipeline.data.muse import MuseEvalSets, QAPair, VerbmemItem, load_eval_sets
from pipeline.data.templates import PromptTemplate
from pipeline.evaluation import eval_io
from pipeline.evaluation.generation import decode, greedy_answers
from pipeline.evaluation.mia import answer_tokens, auc, item_scores

log = logging.getLogger(__name__)

# MUSE's settings (muse_bench eval.py: verbmem_max_new_tokens, knowmem_max_new_tokens, privleak_auc_key
# 'forget_holdout_Min-40%'; metrics/knowmem.py's stop words).
VERBMEM_MAX_NEW_TOKENS = 128
KNOWMEM_MAX_NEW_TOKENS = 32
KNOWMEM_STOPS = ("\n\n", "\nQuestion", "Question:")
MIN_K = 0.4
PRIVLEAK_ATTACKS = ("min_k", "min_k_plus_plus")  # scored on every text; privleak reads `MuseSettings.attack`

# The text as is, with the tokenizer's special tokens: MUSE's `tokenizer(prompt, add_special_tokens=True)`.
RAW_TEXT = PromptTemplate("muse-raw")


# ---- pure formulas ------------------------------------------------------------------------------------------

def knowmem_prompt(shots: Sequence[QAPair], question: str) -> str:
    """MUSE's few-shot prompt: each shot "Question: q\\nAnswer: a\\n\\n", then "Question: q\\nAnswer: "."""
    head = "".join(f"Question: {s.question}\nAnswer: {s.answer}\n\n" for s in shots)
    return f"{head}Question: {question}\nAnswer: "


def cut_at_stops(text: str, stops: Sequence[str] = KNOWMEM_STOPS) -> str:
    """The text before each stop in turn (MUSE's `get_prefix_before_words_occur`)."""
    for stop in stops:
        text = text.split(stop)[0]
    return text


@lru_cache(maxsize=2)
def _scorer(stemmer: bool):
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rouge1", "rougeL"], use_stemmer=stemmer)


def rouge(generated: str, reference: str, stemmer: bool = False) -> dict[str, float]:
    """ROUGE-L and ROUGE-1 F1 and recall of `generated` against `reference` (MUSE: no stemming; open-unlearning
    stems, `stemmer=True`)."""
    s = _scorer(stemmer).score(reference, generated)
    return {"rougeL_f1": float(s["rougeL"].fmeasure), "rougeL_recall": float(s["rougeL"].recall),
            "rouge1_f1": float(s["rouge1"].fmeasure), "rouge1_recall": float(s["rouge1"].recall)}


def percent_mean(values: Sequence[float]) -> float:
    """100 · the mean: MUSE reports its ROUGE means in percent."""
    if not len(values):
        raise DataError("a MUSE metric over no items")
    return 100.0 * float(np.mean(np.asarray(values, dtype=np.float64)))


def muse_auc(forget_scores, holdout_scores) -> float:
    """MUSE's membership AUC (`sweep` on −score with the holdout texts labelled 1): the probability that a holdout
    text scores lower (more member-like) than a forget text, ties one half. Near 0 for a model that knows the forget
    texts, 0.5 for one that cannot tell them apart. `mia.auc` labels the other way round, hence the swap."""
    return auc(holdout_scores, forget_scores)


def privleak(auc_model: float, auc_retain: float) -> float | None:
    """MUSE's PrivLeak: (AUC − AUC_retain) / AUC_retain · 100, both AUCs `muse_auc`; None where AUC_retain is 0
    (MUSE would divide by zero)."""
    if auc_retain == 0:
        return None
    return (auc_model - auc_retain) / auc_retain * 100.0


def data_hash(texts: Sequence[Sequence[str]]) -> str:
    """A short hash of the privleak texts, so a retain model's AUC is only ever compared on the same texts."""
    return hashlib.sha256(json.dumps([list(t) for t in texts]).encode()).hexdigest()[:16]


# ---- the model's side ---------------------------------------------------------------------------------------

def verbmem_reference(tokenizer, gt: str, max_new_tokens: int) -> str:
    """MUSE's reference: `gt` encoded with the tokenizer's special tokens, cut to `max_new_tokens` ids (a BOS
    counts among them), decoded without them."""
    ids = tokenizer(gt, add_special_tokens=True)["input_ids"][:max_new_tokens]
    return decode(tokenizer, ids)


def run_verbmem(model, tokenizer, items: Sequence[VerbmemItem], max_new_tokens: int, batch_size: int,
                stemmer: bool = False) -> list[dict]:
    """Per verbmem item: prompt, gt, the reference, the greedy continuation and its ROUGE."""
    outputs = greedy_answers(model, tokenizer, RAW_TEXT, [i.prompt for i in items], max_new_tokens, batch_size)
    records = []
    for item, generation in zip(items, outputs):
        reference = verbmem_reference(tokenizer, item.gt, max_new_tokens)
        records.append({"prompt": item.prompt, "gt": item.gt, "reference": reference, "generation": generation,
                        **rouge(generation, reference, stemmer)})
    return records


def run_knowmem(model, tokenizer, pairs: Sequence[QAPair], shots: Sequence[QAPair], max_new_tokens: int,
                batch_size: int, stemmer: bool = False) -> list[dict]:
    """Per question: question, answer, the greedy answer after the in-context `shots`, cut at MUSE's stops, and
    its ROUGE against the gold answer."""
    prompts = [knowmem_prompt(shots, p.question) for p in pairs]
    outputs = greedy_answers(model, tokenizer, RAW_TEXT, prompts, max_new_tokens, batch_size)
    return [{"question": p.question, "answer": p.answer, "generation": (g := cut_at_stops(o)),
             **rouge(g, p.answer, stemmer)} for p, o in zip(pairs, outputs)]


def privleak_scores(model, tokenizer, texts: Sequence[str], k: float, batch_size: int,
                    desc: str) -> dict[str, np.ndarray]:
    """Min-K% and Min-K%++ of each text over its tokens after the first, as MUSE's `compute_ppl` reads them
    (`mia.answer_tokens` with an empty prompt: the text is the answer, the EOS it appends is left out)."""
    samples = answer_tokens(model, tokenizer, RAW_TEXT, [""] * len(texts), list(texts), batch_size, desc=desc)
    return item_scores(samples, PRIVLEAK_ATTACKS, k)


# ---- one evaluation -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MuseSettings:
    """What changes MUSE's numbers; the defaults are MUSE's."""

    verbmem_max_new_tokens: int = VERBMEM_MAX_NEW_TOKENS
    knowmem_max_new_tokens: int = KNOWMEM_MAX_NEW_TOKENS
    k: float = MIN_K
    attack: str = "min_k"          # the attack PrivLeak reads (MUSE: Min-K% Prob)
    rouge_stemmer: bool = False    # MUSE: none; open-unlearning: Porter
    batch_size: int = 8

    def __post_init__(self):
        for name in ("verbmem_max_new_tokens", "knowmem_max_new_tokens", "batch_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ParamError(f"{name}={getattr(self, name)!r}: must be a positive integer")
        if not 0 < self.k <= 1:
            raise ParamError(f"k={self.k}: Min-K%'s fraction must be in (0, 1]")
        if self.attack not in PRIVLEAK_ATTACKS:
            raise ParamError(f"attack={self.attack!r}: PrivLeak reads one of {list(PRIVLEAK_ATTACKS)}")


def load_retain_auc(retain: Path, privleak_data: str, settings: MuseSettings) -> dict[str, float]:
    """The retain model's AUC of each attack, from its own `evaluate-muse` output (the directory or its
    metrics.json), checked to be of the same privleak texts and k."""
    file = retain / "metrics.json" if retain.is_dir() else retain
    if not file.is_file():
        raise DataError(f"{retain}: no evaluate-muse output of the retain model (metrics.json); evaluate it first")
    data = eval_io.read_json(file, "evaluate-muse summary")
    if data.get("privleak_data") != privleak_data:
        raise DataError(f"{file}: the retain model was evaluated on other privleak texts (hash "
                        f"{data.get('privleak_data')}, here {privleak_data}); evaluate it on the same MUSE source")
    if (data.get("definitions") or {}).get("k") != settings.k:
        raise DataError(f"{file}: the retain model's Min-K% k is {(data.get('definitions') or {}).get('k')}, here "
                        f"{settings.k}; evaluate both with the same k")
    aucs = data.get("auc")
    if not isinstance(aucs, dict):
        raise DataError(f"{file}: auc: {aucs!r} is not an object of attacks")
    return {a: eval_io.number(aucs.get(a), f"{file}: auc.{a}", 0.0, 1.0) for a in PRIVLEAK_ATTACKS}


def _set_summary(records: list[dict]) -> dict:
    keys = ("rougeL_f1", "rougeL_recall", "rouge1_f1", "rouge1_recall")
    return {"n": len(records), **{k: round(percent_mean([r[k] for r in records]), 6) for k in keys}}


@dataclass(frozen=True)
class MuseInputs:
    """What a MUSE evaluation reads besides the model, loaded before it: the sets, and the retain model's AUCs."""

    sets: MuseEvalSets
    privleak_data: str                    # the hash of the privleak texts
    retain_auc: dict[str, float] | None   # per attack; None: no PrivLeak, or this is the retain model (its own)


def load_muse_inputs(source: str, settings: MuseSettings, retain_dir: Path | None, own_retain: bool,
                     retain_auc: float | None = None) -> MuseInputs:
    """MUSE's sets from `source`, and the retain model's AUC for PrivLeak: from `retain_dir`, its own evaluation
    (unless this is the retain model's, `own_retain`: PrivLeak 0), or `retain_auc`, a published one (MUSE's
    retrained models: News 0.4772, Books 0.5393, for Min-40%); neither: no PrivLeak."""
    sets = load_eval_sets(source)
    privleak_data = data_hash([sets.privleak_forget, sets.privleak_holdout])
    if retain_dir is not None and retain_auc is not None:
        raise ParamError("give the retain model's evaluation or its AUC, not both")
    reference = None
    if retain_dir is not None and not own_retain:
        reference = load_retain_auc(Path(retain_dir), privleak_data, settings)
    elif retain_auc is not None:
        reference = {settings.attack: eval_io.number(retain_auc, "retain AUC", 0.0, 1.0)}
    return MuseInputs(sets, privleak_data, reference)


def score_muse(model, tokenizer, inputs: MuseInputs, settings: MuseSettings, own_retain: bool,
               source: str) -> tuple[dict, dict[str, list[dict]]]:
    """MUSE's summary of one model (VerbMem, KnowMem forget and retain, utility preserved, PrivLeak and its AUCs,
    each set's aggregates, the definitions) and its per-item records by table name."""
    sets, s = inputs.sets, settings
    verbmem = run_verbmem(model, tokenizer, sets.verbmem, s.verbmem_max_new_tokens, s.batch_size, s.rouge_stemmer)
    knowmem_f = run_knowmem(model, tokenizer, sets.knowmem_forget, sets.knowmem_forget_icl,
                            s.knowmem_max_new_tokens, s.batch_size, s.rouge_stemmer)
    knowmem_r = run_knowmem(model, tokenizer, sets.knowmem_retain, sets.knowmem_retain_icl,
                            s.knowmem_max_new_tokens, s.batch_size, s.rouge_stemmer)
    forget = privleak_scores(model, tokenizer, sets.privleak_forget, s.k, s.batch_size, "privleak: forget")
    holdout = privleak_scores(model, tokenizer, sets.privleak_holdout, s.k, s.batch_size, "privleak: holdout")
    aucs = {a: muse_auc(forget[a], holdout[a]) for a in PRIVLEAK_ATTACKS}
    reference = dict(aucs) if own_retain else inputs.retain_auc

    summary: dict = {"source": str(source),
                     "verbmem_f": round(percent_mean([r["rougeL_f1"] for r in verbmem]), 6),
                     "knowmem_f": round(percent_mean([r["rougeL_f1"] for r in knowmem_f]), 6),
                     "knowmem_r": round(percent_mean([r["rougeL_f1"] for r in knowmem_r]), 6)}
    summary["utility_preserved"] = summary["knowmem_r"]  # MUSE's C4: KnowMem on the retain set
    leaks = {a: privleak(aucs[a], reference[a]) if reference and a in reference else None
             for a in PRIVLEAK_ATTACKS}
    for a, value in leaks.items():
        if reference and a in reference and value is None:
            log.warning("PrivLeak of %s: the retain model's AUC is 0, so it is undefined (null)", a)
    summary["privleak"] = None if leaks[s.attack] is None else round(leaks[s.attack], 6)
    summary["privleak_min_k_plus_plus"] = None if leaks["min_k_plus_plus"] is None else \
        round(leaks["min_k_plus_plus"], 6)
    summary.update({
        "auc": {a: round(v, 6) for a, v in aucs.items()}, "retain_auc": reference,
        "sets": {"verbmem_forget": _set_summary(verbmem), "knowmem_forget": _set_summary(knowmem_f),
                 "knowmem_retain": _set_summary(knowmem_r),
                 "privleak": {"n_forget": len(sets.privleak_forget), "n_holdout": len(sets.privleak_holdout)}},
        "privleak_data": inputs.privleak_data,
        "definitions": {**asdict(s), "knowmem_stops": list(KNOWMEM_STOPS),
                        "n_icl": [len(sets.knowmem_forget_icl), len(sets.knowmem_retain_icl)]},
    })
    summary["definitions"].pop("batch_size")

    def privleak_rows(texts, scores):
        return [{"index": i, "text": t, **{a: float(scores[a][i]) for a in PRIVLEAK_ATTACKS}}
                for i, t in enumerate(texts)]

    tables = {"verbmem": verbmem, "knowmem_forget": knowmem_f, "knowmem_retain": knowmem_r,
              "privleak_forget": privleak_rows(sets.privleak_forget, forget),
              "privleak_holdout": privleak_rows(sets.privleak_holdout, holdout)}
    return summary, tables
