"""Token weights ω from attribution scores φ, within one sample's scored tokens: pure functions of φ.

Stage two derives its weights with them (r and τ are its params, never stage one's); they live beside φ so that
stage one's inspection and quality measures use the same selection without importing the trainer.

- uniform: ω = 1 (the sequence-level baseline);
- hard:    ω = 1 for the top-r fraction of φ (at least one token; ties go to the earlier position), else 0;
- soft:    ω = softmax(φ / τ).

Stage two uses the weighted mean Σ ω_i ℓ_i / Σ ω_i, so uniform gives the token mean, hard the mean over the
selected tokens and soft the softmax-weighted average.
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


WEIGHTING: dict[str, Callable[..., np.ndarray]] = {
    "uniform": uniform_weights,
    "hard": hard_weights,
    "soft": soft_weights,
}


def token_weights(strategy: str, phi: np.ndarray, r: float = 0.2, tau: float = 0.5) -> np.ndarray:
    try:
        fn = WEIGHTING[strategy]
    except KeyError:
        raise ParamError(f"weighting='{strategy}': unknown (choose from {sorted(WEIGHTING)})") from None
    return fn(np.asarray(phi, dtype=np.float64), r=r, tau=tau)
