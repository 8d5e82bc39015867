"""Small numerical helpers shared by the stages."""

from __future__ import annotations

import torch

LOG_TAIL_FLOOR = -30.0  # log of the smallest probability mass kept (1e-13): a mass of exactly 0 makes a KL infinite


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 − exp(x)) for x ≤ 0, stably (Mächler's split at −log 2)."""
    x = x.clamp(max=-1e-12)
    near_zero = x > -0.6931471805599453
    # Each branch sees only inputs it is finite on: torch.where's backward multiplies the unused branch's gradient
    # by 0, and 0 · ∞ is NaN (log1p(−exp(x)) is −∞ once exp(x) rounds to 1, x > −6e-8 in fp32: the retain tail of a
    # memorised model, which made every unlearning step's gradient NaN).
    high = torch.log(-torch.expm1(torch.where(near_zero, x, -1.0)))
    low = torch.log1p(-torch.exp(torch.where(near_zero, -1.0, x)))
    return torch.where(near_zero, high, low)
