"""Membership-inference attacks as open-unlearning defines them (issue 18): per-sample scores from the answer
tokens' log-probabilities, their AUC between the forget set and a holdout set, and privleak against the retain
model.

Every score is signed like a loss: higher means less likely a member. The AUC labels the forget samples 0 and
the holdout samples 1, so 0.5 is a model that cannot tell them apart (the retain model's ideal), near 1 one that
still knows the forget set (lower scores on it), as open-unlearning reports it.

  loss        mean negative log-likelihood of the answer tokens
  zlib        loss / the zlib-compressed length of the text in bytes (Carlini et al., 2021)
  min_k       −mean of the k fraction of lowest token log-probabilities (Min-K%, Shi et al., 2024; k = 0.4)
  min_k_pp    the same over z_i = (log p(s_i) − μ_i) / σ_i, μ_i and σ_i² the mean and variance of log p under the
              model's own next-token distribution at position i (Min-K%++, Zhang et al., 2024)
The lowest max(1, int(n·k)) tokens are kept, as open-unlearning keeps them.
"""

from __future__ import annotations

import zlib
from typing import Callable

import numpy as np
import torch


def lowest_fraction(values: np.ndarray, k: float) -> np.ndarray:
    """The max(1, int(n·k)) lowest values."""
    values = np.sort(np.asarray(values, dtype=np.float64))
    return values[: max(1, int(len(values) * k))]


def loss_score(token_logp: np.ndarray, **_) -> float:
    return float(-np.mean(token_logp))


def zlib_score(token_logp: np.ndarray, text: str, **_) -> float:
    return loss_score(token_logp) / len(zlib.compress(text.encode("utf-8")))


def min_k_score(token_logp: np.ndarray, k: float = 0.4, **_) -> float:
    return float(-np.mean(lowest_fraction(token_logp, k)))


def min_k_pp_score(token_logp: np.ndarray, mu: np.ndarray, sigma2: np.ndarray, k: float = 0.4, **_) -> float:
    z = (np.asarray(token_logp) - np.asarray(mu)) / np.sqrt(np.maximum(np.asarray(sigma2), 1e-6))
    return float(-np.mean(lowest_fraction(z, k)))


def vocab_moments(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """μ = Σ p·log p and σ² = Σ p·(log p)² − μ² of softmax(logits), per row ([N, vocab] -> [N], [N])."""
    logp = torch.log_softmax(logits.float(), -1)
    p = logp.exp()
    mu = (p * logp).sum(-1)
    return mu, (p * logp.square()).sum(-1) - mu.square()


# name -> score(token_logp, text=..., mu=..., sigma2=..., k=...): what each attack reads beyond log p
MIA_SCORES: dict[str, Callable[..., float]] = {
    "loss": loss_score,
    "zlib": zlib_score,
    "min_k": min_k_score,
    "min_k_pp": min_k_pp_score,
}


def auc(forget_scores, holdout_scores) -> float:
    """ROC AUC with the forget samples labelled 0 and the holdout samples 1: the probability that a holdout
    sample scores higher than a forget sample, ties counting one half (the Mann-Whitney statistic)."""
    f = np.asarray(forget_scores, dtype=np.float64)
    h = np.asarray(holdout_scores, dtype=np.float64)
    if f.size == 0 or h.size == 0:
        raise ValueError("auc: both the forget and the holdout scores must be non-empty")
    greater = (h[:, None] > f[None, :]).sum()
    ties = (h[:, None] == f[None, :]).sum()
    return float((greater + 0.5 * ties) / (f.size * h.size))


def privleak(auc_model: float, auc_retain: float) -> float:
    """(AUC − AUC of the retain model) / AUC of the retain model × 100: 0 for a model the attack sees as the
    retain model, positive where it still tells the forget set apart (open-unlearning's and MUSE's PrivLeak)."""
    return (auc_model - auc_retain) / auc_retain * 100.0
