"""GA: gradient ascent on the forget set's NLL. ℓ_i = log p_θ(s_i), minimised."""

from __future__ import annotations

import torch

from pipeline.training.methods.base import ForwardOut, Method, NoParams


def ga_token_loss(logp: torch.Tensor) -> torch.Tensor:
    return logp


def token_loss(out: ForwardOut, batch: dict, params: NoParams) -> torch.Tensor:
    return ga_token_loss(out.logp)


METHOD = Method("ga", token_loss, title="GA")
