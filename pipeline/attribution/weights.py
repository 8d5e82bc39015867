"""Token weights ω from attribution scores φ, within one sample's scored tokens: pure functions of φ.

Stage two derives its weights with them (r and τ are its params, never stage one's); they live beside φ so that
stage one's inspection and quality measures use the same selection without importing the trainer.

- uniform: ω = 1 (the sequence-level baseline);
- hard:    ω = 1 for the top-r fraction of φ (at least one token; ties go to the earlier position), else 0;
- soft:    ω = softmax(φ / τ);
- proportional: ω = max(φ, 0), each token in proportion to its score (ETW's weighting, with score `etw`: the
  entropy of θ_o's next-token distribution; docs/methods.md); a sample whose scores are all 0 falls back to ω = 1.

Stage two uses the weighted mean Σ ω_i ℓ_i / Σ ω_i, so uniform gives the token mean, hard the mean over the
selected tokens and soft the softmax-weighted average.

`mix` (hard and soft) keeps that share of each sample's push on every scored token: the weights become the mixture
of two distributions over the sample's n scored tokens, ω_i = mix·1/n + (1 − mix)·ω_i / Σ_j ω_j, so mix = 0 gives
the weights above unchanged (the same array) and mix = 1 the token mean of the uniform weighting.

`focus` (hard and soft) says where each selected stretch of the answer is pushed. `all` (the default): on every
token, as above. `first`: each stretch of consecutive tokens weighted at or above the sample's mean weight (hard:
the selected tokens) carries its whole weight on its first token, the rest of the stretch on 0; tokens outside the
stretches keep theirs, so Σ ω is unchanged. Why: greedy extraction is decided at a fact's first token (once it
flips the continuation derails), and the tokens after it are predicted from it. It is applied before `mix`.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from pipeline.common.errors import ParamError


def uniform_weights(phi: np.ndarray, **_) -> np.ndarray:
    return np.ones(len(phi))


def hard_weights(phi: np.ndarray, r: float = 0.2, **_) -> np.ndarray:
    if not 0.0 < r <= 1.0:
        raise ParamError(f"r={r}: must be in (0, 1]")
    n = len(phi)
    k = max(1, math.ceil(r * n)) if n else 0
    order = np.lexsort((np.arange(n), -np.asarray(phi)))  # by φ descending, then position ascending
    w = np.zeros(n)
    w[order[:k]] = 1.0
    return w


def soft_weights(phi: np.ndarray, tau: float = 0.5, **_) -> np.ndarray:
    if tau <= 0:
        raise ParamError(f"tau={tau}: must be positive")
    z = np.asarray(phi, dtype=np.float64) / tau
    if z.size == 0:
        return z
    e = np.exp(z - z.max())
    return e / e.sum()


def proportional_weights(phi: np.ndarray, **_) -> np.ndarray:
    w = np.maximum(np.asarray(phi, dtype=np.float64), 0.0)
    return w if w.sum() > 0 else np.ones(len(w))  # no score anywhere: nothing to prefer


WEIGHTING: dict[str, Callable[..., np.ndarray]] = {
    "uniform": uniform_weights,
    "hard": hard_weights,
    "soft": soft_weights,
    "proportional": proportional_weights,
}


def check_mix(mix, where: str = "mix") -> float:
    """`mix` as a number in [0, 1], or an error naming `where` (the param's key)."""
    if isinstance(mix, bool) or not isinstance(mix, (int, float, np.integer, np.floating)):
        raise ParamError(f"{where}={mix!r}: expected a number in [0, 1]")
    if not 0.0 <= mix <= 1.0:  # NaN fails too
        raise ParamError(f"{where}={mix!r}: must be in [0, 1]")
    return float(mix)


def mixed_weights(weights: np.ndarray, mix: float) -> np.ndarray:
    """mix·1/n + (1 − mix)·ω / Σ ω over one sample's n scored tokens; mix = 0: `weights` itself, untouched."""
    mix = check_mix(mix)
    if mix == 0.0 or len(weights) == 0:
        return weights
    total = weights.sum()
    if not total > 0:  # hard weights select at least one token and soft ones sum to 1: never here
        raise ValueError(f"token weights summing to {total}: cannot be normalised for mix={mix}")
    return mix / len(weights) + (1.0 - mix) * (weights / total)


FOCUS = ("all", "first")


def check_focus(focus, where: str = "focus") -> str:
    """`focus` as one of FOCUS, or an error naming `where` (the param's key)."""
    if focus not in FOCUS:
        raise ParamError(f"{where}={focus!r}: expected one of {list(FOCUS)}")
    return focus


def first_token_weights(weights: np.ndarray) -> np.ndarray:
    """Each stretch of consecutive tokens whose weight is at or above the sample's mean moves its summed weight
    onto its first token; the other tokens keep theirs. [0, 1, 1, 0, 1] -> [0, 2, 0, 0, 1]."""
    w = np.asarray(weights, dtype=np.float64)
    if w.size == 0:
        return w
    inside = w >= w.mean()
    starts = inside & ~np.concatenate(([False], inside[:-1]))
    stretch = np.cumsum(starts) - 1  # the stretch each token inside one belongs to
    out = np.where(inside, 0.0, w)
    out[starts] = np.bincount(stretch[inside], weights=w[inside], minlength=int(starts.sum()))
    return out


def token_weights(strategy: str, phi: np.ndarray, r: float = 0.2, tau: float = 0.5, mix: float = 0.0,
                  focus: str = "all") -> np.ndarray:
    try:
        fn = WEIGHTING[strategy]
    except KeyError:
        raise ParamError(f"weighting='{strategy}': unknown (choose from {sorted(WEIGHTING)})") from None
    weights = fn(np.asarray(phi, dtype=np.float64), r=r, tau=tau)
    if strategy == "uniform":
        if check_mix(mix) != 0.0:
            raise ParamError(f"mix={mix!r}: the uniform weighting spreads the push evenly already; mix is for "
                             f"hard and soft weights")
        if check_focus(focus) != "all":
            raise ParamError(f"focus={focus!r}: uniform weights select no stretch of the answer; focus is for hard "
                             f"and soft weights")
        return weights
    if check_focus(focus) == "first":
        weights = first_token_weights(weights)
    return mixed_weights(weights, mix)
