"""Alternative answers of the forget samples, and θ_o's log-likelihood of each: what the preference methods (IdkDPO,
AltPO) prefer to the forget answer, and what IdkNLL trains on. Stage one computes them with the model it has loaded
(`attribution.alternatives`), so stage two holds no reference model for them, as for NPO's `logp_orig`.

Kinds (`pipeline.attribution.shards.ALTERNATIVES`):

* `idk`: one of our "I don't know" answers (`pipeline.data.idk`);
* `perturbed`: one of the row's `perturbed_answer`s, from the split's TOFU-style `<split>_perturbed` file (the
  embedded world writes them; real TOFU has them, e.g. forget10_perturbed). AltPO's authors generate alternatives
  with the model being unlearned (open-unlearning's AltPO reads such pre-generated alternates); stage one generates
  nothing (no sampling model in the offline pipeline, and sampled text would make the shards depend on a decoder's
  settings), so AltPO here prefers TOFU's perturbed answers: plausible wrong answers of the same form.

Each sample gets one answer of each kind, chosen from `attribution.alternatives_seed` and its question.
open-unlearning draws a random idk line each time an item is loaded; here the choice is fixed, so θ_o's cached
log-likelihood is that of the answer trained on, and a rerun writes the same shards. It is keyed on the question's
text, not its row, so a question gets the same answer in every split and under any number of processes.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from pipeline.attribution.signals import logp_and_entropy, pad_ids
from pipeline.common.errors import DataError
from pipeline.common.modeling import decoder, lm_head_logits
from pipeline.data.idk import IDK_ANSWERS
from pipeline.data.templates import IGNORE_INDEX, PromptTemplate, encode_qa
from pipeline.data.tofu import load_split


@dataclass
class Alternative:
    """One alternative answer of a forget sample, encoded like the sample (same prompt, template and end)."""

    answer: str
    input_ids: list[int]
    scored: list[bool]  # the answer tokens and what ends it, as the forget sample's `scored`


def choose(seed: int, kind: str, question: str, n: int) -> int:
    """A fixed index in 0..n-1 for this question: a pure function of the seed, the kind and the question's text."""
    digest = hashlib.sha256(f"{seed}\0{kind}\0{question}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % n


def perturbed_answers(source: str, split: str) -> tuple[dict[str, list[str]], str]:
    """Each question's perturbed answers, from `<split>_perturbed` of `source`, and where they were read."""
    name = f"{split}_perturbed"
    rows = load_split(source, name)
    if "perturbed_answer" not in rows[0]:
        raise DataError(f"{source}/{name}: no `perturbed_answer` field (attribution.alternatives: perturbed reads "
                        "TOFU's perturbed splits)")
    return {r["question"]: r["perturbed_answer"] for r in rows}, f"{source}/{name}"


def alternative_answers(kinds: list[str], records: list[dict], source: str, split: str,
                        seed: int) -> list[dict[str, str]]:
    """Each record's answer of each kind (see the module's docstring)."""
    perturbed, where = perturbed_answers(source, split) if "perturbed" in kinds else ({}, "")
    out = []
    for row, rec in enumerate(records, start=1):
        answers = {}
        if "idk" in kinds:
            answers["idk"] = IDK_ANSWERS[choose(seed, "idk", rec["question"], len(IDK_ANSWERS))]
        if "perturbed" in kinds:
            options = perturbed.get(rec["question"])
            if not options:
                raise DataError(f"{source}/{split}: row {row}: its question is not in {where} (attribution."
                                f"alternatives: perturbed needs each forget question's perturbed answers)")
            answers["perturbed"] = options[choose(seed, "perturbed", rec["question"], len(options))]
        out.append(answers)
    return out


def encode_alternative(tokenizer, template: PromptTemplate, question: str, answer: str) -> Alternative:
    """The question with this answer, scored where a forget sample is: the answer and its end, not position 0."""
    sample = encode_qa(tokenizer, template, question, answer)
    scored = [label != IGNORE_INDEX for label in sample.labels]
    scored[0] = False
    return Alternative(answer, sample.input_ids, scored)


@torch.no_grad()
def answer_logps(model, alternatives: list[Alternative], pad_id: int, chunk_size: int = 1024) -> np.ndarray:
    """θ_o's Σ log p(s_i | s_<i) over each alternative's scored tokens (float64, one per alternative), computed as
    the forget answers' `logp_orig` are (`score_batch`)."""
    device = next(model.parameters()).device
    ids, attention = pad_ids([a.input_ids for a in alternatives], pad_id)
    scored = torch.zeros(ids.shape, dtype=torch.bool)
    for b, a in enumerate(alternatives):
        scored[b, : len(a.scored)] = torch.tensor(a.scored)
    ids, attention = ids.to(device), attention.to(device)
    hidden = decoder(model)(input_ids=ids, attention_mask=attention).last_hidden_state
    rows, cols = (v.to(device) for v in scored.nonzero(as_tuple=True))
    sums = torch.zeros(len(alternatives), dtype=torch.float64, device=device)
    for start in range(0, len(rows), chunk_size):
        r, c = rows[start : start + chunk_size], cols[start : start + chunk_size]
        logp, _ = logp_and_entropy(lm_head_logits(model, hidden[r, c - 1]), ids[r, c])
        sums.index_add_(0, r, logp.double())
    return sums.cpu().numpy()


def alternative_columns(x_alternatives: dict[str, Alternative], logps: dict[str, float], sample_id: int,
                        model: str) -> dict:
    """A shard row's columns for its alternatives (`pipeline.attribution.shards.alternative_columns`)."""
    row = {}
    for kind, a in x_alternatives.items():
        if not np.isfinite(logps[kind]):
            raise DataError(f"model '{model}': non-finite log-likelihood of the {kind} answer of sample {sample_id} "
                            "(its weights may hold NaN or inf); nothing was written")
        row.update({f"{kind}_answer": a.answer, f"{kind}_ids": a.input_ids, f"{kind}_scored": a.scored,
                    f"{kind}_logp": float(logps[kind])})
    return row


def score_alternatives(model, batch: list, pad_id: int, chunk_size: int, model_name: str) -> list[dict]:
    """The alternative columns of each sample of `batch` (AttributionInputs carrying their `alternatives`): one
    forward pass over all their alternatives."""
    flat = [(b, kind, a) for b, x in enumerate(batch) for kind, a in x.alternatives.items()]
    if not flat:
        return [{} for _ in batch]
    sums = answer_logps(model, [a for _, _, a in flat], pad_id, chunk_size)
    logps: list[dict[str, float]] = [{} for _ in batch]
    for (b, kind, _), value in zip(flat, sums):
        logps[b][kind] = float(value)
    return [alternative_columns(x.alternatives, lp, x.sample_id, model_name) for x, lp in zip(batch, logps)]

