"""WGA: GA with each token's gradient scaled by its probability. ℓ_i = sg[p_θ(s_i)^γ] · log p_θ(s_i), sg: no
gradient through the factor, so tokens already unlikely stop being pushed."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.common.params import at_least
from pipeline.training.methods.base import ForwardOut, Method


@dataclass(frozen=True)
class Params:
    gamma: float = 1.0  # the exponent of the factor p^γ (0: GA)


def wga_token_loss(logp: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    return logp.detach().exp().pow(gamma) * logp


def token_loss(out: ForwardOut, batch: dict, params: Params) -> torch.Tensor:
    return wga_token_loss(out.logp, params.gamma)


METHOD = Method("wga", token_loss, Params, rules={"gamma": at_least(0)}, title="WGA")
