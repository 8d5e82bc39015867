"""Membership-inference attacks as open-unlearning defines them: per-sample scores from the answer tokens'
log-probabilities, their AUC between the forget set and a holdout set, and privleak against the retain model.

Checked against open-unlearning's src/evals/metrics/mia/*.py, privacy.py and configs/eval/tofu_metrics/mia_*.yaml.
Every score is signed like a loss: higher means less likely a member. The tokens are the labelled ones of the
question-answer encoding (the answer and its EOS), as the TOFU metrics score them:

  loss             mean NLL over every labelled token (open-unlearning's avg_loss)
  zlib             loss / the zlib-compressed length in bytes of the labelled tokens' text, decoded without special
                   tokens (Carlini et al., 2021)
  min_k            −mean of the k fraction of lowest log-probabilities (Min-K%, Shi et al., 2024), over the labelled
                   tokens but the last (open-unlearning leaves out the EOS prediction); k = 0.4 as its TOFU config
  min_k_plus_plus  the same over z_i = (log p(s_i) − μ_i) / σ_i, μ_i and σ_i² the mean and variance of log p under
                   the model's own next-token distribution at i, σ² clamped at 1e-6 (Min-K%++, Zhang et al., 2024)
  gradnorm         the mean over the model's parameter tensors of the p-norm of each one's gradient of the loss
                   over the labelled tokens but the last (open-unlearning's tokenwise_logprobs), p = 2 as its TOFU
                   config (Wang et al., 2024; mimir's GradNorm, Duan et al., 2024); one backward pass per sample.
                   Higher: less likely a member, as open-unlearning's current sign (its first version returned −norm)
  reference        loss − the reference model's loss on the same tokens (a reference model as Carlini et al., 2021,
                   as a difference of losses as mimir; open-unlearning's ReferenceAttack with avg_loss, the loss
                   above); the reference model's losses come from its own evaluation or from loading it (below)
Min-K% and Min-K%++ keep the lowest max(1, int(n·k)) values; a sample with no token scores 0, as there.

AUC: the forget samples labelled 0 and the holdout samples 1 (sklearn's roc_auc_score on the raw scores), so 0.5 is
a model that cannot tell them apart and near 1 one that still knows the forget set (lower scores on it).
privleak: (s − s_ref) / (s_ref + 1e-10) × 100 with s = 1 − AUC and s_ref = 1 − the retain model's AUC of the same
attack (open-unlearning's privleak, whose TOFU and MUSE configs read mia_min_k): 0 for the retain model, negative
(towards −100) for a model that still tells the forget set apart.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Literal, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from pipeline.common.errors import DataError
from pipeline.common.progress import progress
from pipeline.data.batching import pad_batch
from pipeline.data.templates import IGNORE_INDEX, EncodedSample, PromptTemplate, encode_qa

log = logging.getLogger(__name__)

EPS = 1e-10  # open-unlearning's guard in privleak's denominator


# ---- pure scores ------------------------------------------------------------------------------------------------

def lowest_fraction(values: np.ndarray, k: float) -> np.ndarray:
    """The max(1, int(n·k)) lowest values (none of an empty array)."""
    values = np.sort(np.asarray(values, dtype=np.float64))
    return values[: max(1, int(len(values) * k))]


def loss_score(token_logp: np.ndarray) -> float:
    return float(-np.mean(token_logp)) if len(token_logp) else 0.0


def zlib_score(token_logp: np.ndarray, text: str) -> float:
    return loss_score(token_logp) / len(zlib.compress(text.encode("utf-8")))


def min_k_score(token_logp: np.ndarray, k: float = 0.4) -> float:
    return float(-np.mean(lowest_fraction(token_logp, k))) if len(token_logp) else 0.0


def min_k_pp_score(token_logp: np.ndarray, mu: np.ndarray, sigma2: np.ndarray, k: float = 0.4) -> float:
    z = (np.asarray(token_logp) - np.asarray(mu)) / np.sqrt(np.maximum(np.asarray(sigma2), 1e-6))
    return min_k_score(z, k)


def vocab_moments(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """μ = Σ p·log p and σ² = Σ p·(log p)² − μ² of softmax(logits), per row ([N, vocab] -> [N], [N])."""
    logp = torch.log_softmax(logits.float(), -1)
    p = logp.exp()
    mu = (p * logp).sum(-1)
    return mu, (p * logp.square()).sum(-1) - mu.square()


def reference_score(loss: float, reference_loss: float) -> float:
    """The target's loss minus the reference model's: low where the target knows a sample the reference does not."""
    return loss - reference_loss


def mean_norm(norms: Sequence[float]) -> float:
    """gradnorm's statistic from the per-tensor gradient norms: their mean (0 for a sample with no gradient)."""
    return float(np.mean(norms)) if len(norms) else 0.0


@dataclass
class SampleTokens:
    """One sample's labelled tokens under the model: log p of each, the moments of the model's distribution where
    each was predicted, and their decoded text; where those attacks run, gradnorm's statistic and the reference
    model's loss on the same tokens."""

    logp: np.ndarray
    mu: np.ndarray
    sigma2: np.ndarray
    text: str
    grad_norm: float | None = None
    reference_loss: float | None = None


def _needed(value: float | None, attack: str) -> float:
    if value is None:
        raise ValueError(f"membership inference: the {attack} attack's input was not computed for this sample")
    return value


# name -> score of one sample (open-unlearning's metric is mia_<name>)
MIA_ATTACKS: dict[str, Callable[[SampleTokens, float], float]] = {
    "loss": lambda s, k: loss_score(s.logp),
    "zlib": lambda s, k: zlib_score(s.logp, s.text),
    "min_k": lambda s, k: min_k_score(s.logp[:-1], k),  # the EOS prediction left out, as open-unlearning
    "min_k_plus_plus": lambda s, k: min_k_pp_score(s.logp[:-1], s.mu[:-1], s.sigma2[:-1], k),
    "gradnorm": lambda s, k: _needed(s.grad_norm, "gradnorm"),
    "reference": lambda s, k: reference_score(loss_score(s.logp), _needed(s.reference_loss, "reference")),
}
# What evaluate.mia.attacks runs when unset: the forward-only attacks that need no other model (gradnorm costs a
# backward pass per sample, reference a reference model's losses: both are asked for by name).
DEFAULT_ATTACKS = ("loss", "zlib", "min_k", "min_k_plus_plus")
PRIVLEAK_ATTACK = "min_k"  # the attack privleak reads in open-unlearning's TOFU and MUSE configs
GRADNORM_ORDERS = (1, 2, math.inf)  # open-unlearning's allowed p


def auc(forget_scores, holdout_scores) -> float:
    """ROC AUC with the forget samples labelled 0 and the holdout samples 1: the probability that a holdout
    sample scores higher than a forget sample, ties counting one half (the Mann-Whitney statistic, which is
    sklearn's roc_auc_score)."""
    f = np.asarray(forget_scores, dtype=np.float64)
    h = np.asarray(holdout_scores, dtype=np.float64)
    if f.size == 0 or h.size == 0:
        raise ValueError("auc: both the forget and the holdout scores must be non-empty")
    if not (np.isfinite(f).all() and np.isfinite(h).all()):
        raise ValueError("auc: a score is NaN or infinite")
    greater = (h[:, None] > f[None, :]).sum()
    ties = (h[:, None] == f[None, :]).sum()
    return float((greater + 0.5 * ties) / (f.size * h.size))


def privleak(auc_model: float, auc_retain: float) -> float:
    """open-unlearning's privleak: (s − s_ref) / (s_ref + 1e-10) × 100, s = 1 − AUC, s_ref = 1 − the retain
    model's AUC; 0 for the retain model itself, −100 for a model whose forget samples all score below the
    holdout samples where the retain model's AUC is 0.5."""
    score, ref = 1 - auc_model, 1 - auc_retain
    return (score - ref) / (ref + EPS) * 100.0


# ---- the model's side -------------------------------------------------------------------------------------------

@torch.no_grad()
def answer_tokens(model, tokenizer, template: PromptTemplate, questions: Sequence[str], answers: Sequence[str],
                  batch_size: int = 32, desc: str = "membership inference") -> list[SampleTokens]:
    """Each answer's labelled tokens under teacher forcing, in input order: log p (float32 logits, as the TOFU
    metrics), the moments of the model's next-token distribution there, and the text they decode to."""
    samples = [encode_qa(tokenizer, template, q, a) for q, a in zip(questions, answers)]
    out: list[SampleTokens | None] = [None] * len(samples)
    device = next(model.parameters()).device
    model.eval()
    order = sorted(range(len(samples)), key=lambda i: len(samples[i]))
    starts = range(0, len(samples), batch_size)
    for start in progress(starts, total=len(starts), desc=desc):
        idx = order[start : start + batch_size]
        batch = {k: v.to(device) for k, v in pad_batch([samples[i] for i in idx], tokenizer.pad_token_id).items()}
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
        labels = batch["labels"][:, 1:]  # logits at t predict the token at t + 1
        for row, i in enumerate(idx):
            where = labels[row] != IGNORE_INDEX
            rows = logits[row][where].float()  # the labelled positions only: [n, vocab]
            targets = labels[row][where]
            logp = -F.cross_entropy(rows, targets, reduction="none")
            mu, sigma2 = vocab_moments(rows)
            text = tokenizer.decode(targets.tolist(), skip_special_tokens=True)
            out[i] = SampleTokens(*(t.double().cpu().numpy() for t in (logp, mu, sigma2)), text)
    return out


@contextmanager
def parameter_gradients(model, on_grad: Callable[[torch.Tensor], None]):
    """Inside, every floating-point parameter requires grad, and a backward pass hands each parameter's gradient to
    `on_grad` as soon as it is complete, then drops it: no gradient is kept, so memory holds one gradient tensor at
    a time beside the activations, and no optimizer state exists. On leaving (an error too), each parameter's
    requires_grad and .grad and the model's training mode are as they were."""
    params = [p for p in model.parameters() if p.is_floating_point()]  # tied weights once, as open-unlearning
    saved = [(p.requires_grad, p.grad) for p in params]
    was_training = model.training

    def hand_over(param: torch.Tensor) -> None:
        on_grad(param.grad)
        param.grad = None

    handles = []
    try:
        for p in params:
            p.grad = None  # a gradient already there (training) would be added to: set aside, put back below
            p.requires_grad_(True)
            handles.append(p.register_post_accumulate_grad_hook(hand_over))
        model.eval()  # no dropout, as open-unlearning's evaluation
        yield
    finally:
        for handle in handles:
            handle.remove()
        for p, (requires_grad, grad) in zip(params, saved):
            p.requires_grad_(requires_grad)
            p.grad = grad
        model.train(was_training)


def gradient_norms(model, samples: Sequence[EncodedSample], p: float = 2, desc: str = "gradnorm") -> np.ndarray:
    """gradnorm's statistic per sample, in input order: the mean over the parameter tensors that get a gradient of
    the p-norm of each one's gradient of the sample's loss, the mean NLL (float32 logits) of its labelled tokens
    but the last, as open-unlearning's tokenwise_logprobs. One sample and one backward pass at a time; the model's
    parameters, gradients and mode are left as they were (`parameter_gradients`)."""
    if p not in GRADNORM_ORDERS:
        raise ValueError(f"gradnorm: p={p!r} is not one of {list(GRADNORM_ORDERS)}")
    device = next(model.parameters()).device
    norms: list[torch.Tensor] = []  # one 0-d tensor per parameter, kept on the device: no sync per tensor
    out = np.zeros(len(samples))
    with torch.enable_grad(), parameter_gradients(model, lambda g: norms.append(g.detach().float().norm(p))):
        for i in progress(range(len(samples)), total=len(samples), desc=desc, unit="sample"):
            labels = torch.tensor(samples[i].labels[1:], device=device)  # logits at t predict the token at t + 1
            where = (labels != IGNORE_INDEX).nonzero().flatten()[:-1]  # the last labelled token left out
            if where.numel() == 0:
                continue  # nothing to score: 0, as the other attacks
            ids = torch.tensor([samples[i].input_ids], device=device)
            logits = model(input_ids=ids).logits[0, :-1][where].float()
            norms.clear()
            F.cross_entropy(logits, labels[where]).backward()
            out[i] = mean_norm(torch.stack(norms).double().cpu().numpy()) if norms else 0.0
    return out


def tokens_hash(tokenizer, template: PromptTemplate, rows: Sequence[dict]) -> str:
    """A hash of the samples the attacks score: each row's encoded question and answer (token ids and labels), in
    order. Two evaluations with the same hash scored the same tokens: same questions, answers, order, template
    and tokenizer, so one's per-sample losses can serve as the other's reference."""
    digest = hashlib.sha256()
    for r in rows:
        sample = encode_qa(tokenizer, template, r["question"], r["answer"])
        digest.update(json.dumps([sample.input_ids, sample.labels]).encode())
    return digest.hexdigest()[:16]


def item_scores(samples: Sequence[SampleTokens], attacks: Sequence[str], k: float) -> dict[str, np.ndarray]:
    """Each attack's score per sample."""
    return {name: np.array([MIA_ATTACKS[name](s, k) for s in samples]) for name in attacks}


@dataclass
class MIAResult:
    forget: dict[str, np.ndarray]    # attack -> per forget sample
    holdout: dict[str, np.ndarray]   # attack -> per holdout sample
    auc: dict[str, float]            # attack -> forget-vs-holdout AUC


# The reference model's per-sample losses (loss_score) on the forget and the holdout rows, or "self": the model
# evaluated is its own reference (the retain model with reference: retain), every reference score 0.
ReferenceLosses = tuple[Sequence[float], Sequence[float]] | Literal["self"]


def membership_inference(model, tokenizer, template: PromptTemplate, forget_rows: Sequence[dict],
                         holdout_rows: Sequence[dict], attacks: Sequence[str], k: float,
                         batch_size: int = 32, p: float = 2,
                         reference_losses: ReferenceLosses | None = None) -> MIAResult:
    """Every attack's per-sample scores on the forget and the holdout rows (question, answer), and its AUC.
    `p`: gradnorm's norm order; `reference_losses`: what the reference attack compares with (needed for it)."""
    unknown = [a for a in attacks if a not in MIA_ATTACKS]
    if unknown:
        raise DataError(f"membership inference: unknown attacks {unknown} (choose from {list(MIA_ATTACKS)})")
    if "reference" in attacks and reference_losses is None:
        raise DataError("membership inference: the reference attack needs the reference model's losses")
    scores = []
    for part, (rows, what) in enumerate(((forget_rows, "forget"), (holdout_rows, "holdout"))):
        questions, answers = [r["question"] for r in rows], [r["answer"] for r in rows]
        tokens = answer_tokens(model, tokenizer, template, questions, answers, batch_size,
                               desc=f"membership inference: {what}")
        if "gradnorm" in attacks:
            encoded = [encode_qa(tokenizer, template, q, a) for q, a in zip(questions, answers)]
            for s, norm in zip(tokens, gradient_norms(model, encoded, p, desc=f"gradnorm: {what}")):
                s.grad_norm = float(norm)
        if "reference" in attacks:
            own = isinstance(reference_losses, str)  # "self"
            theirs = [loss_score(s.logp) for s in tokens] if own else reference_losses[part]
            if len(theirs) != len(tokens):
                raise DataError(f"membership inference: {len(theirs)} reference losses for {len(tokens)} {what} "
                                "samples")
            for s, loss in zip(tokens, theirs):
                s.reference_loss = float(loss)
        scores.append(item_scores(tokens, attacks, k))
    forget, holdout = scores
    return MIAResult(forget, holdout, {a: auc(forget[a], holdout[a]) for a in attacks})


TOKENS_HASH = "mia_tokens_hash"  # the items' metadata key of `tokens_hash`
