"""NPO: negative preference optimisation against θ_o, whose log-probabilities the shards hold (`ref_logp`), so no
reference model runs on the forget set.

    token level     ℓ_i = (2/β) · log(1 + (p_θ(s_i) / p_ref(s_i))^β)             (hard and soft weights)
    sequence level  L   = −(2/β) · log σ(−β · Σ_i (log p_θ(s_i) − log p_ref(s_i)))  (uniform: the original NPO)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pipeline.common.params import positive
from pipeline.training.methods.base import ForwardOut, Method


@dataclass(frozen=True)
class Params:
    beta: float = 0.1  # β, the inverse temperature


def npo_token_loss(logp: torch.Tensor, ref_logp: torch.Tensor, beta: float = 0.1) -> torch.Tensor:
    # log(1 + exp(β·(log p − log p_ref))) = softplus(β·(log p − log p_ref)), computed stably
    return (2.0 / beta) * F.softplus(beta * (logp - ref_logp))


def npo_sequence_loss(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor,
                      beta: float = 0.1) -> torch.Tensor:
    """The original NPO on summed log-probabilities: −(2/β)·log σ(−β·Σ(log p − log p_ref)), batch mean."""
    margin = ((logp - ref_logp) * mask).sum(-1)
    return ((2.0 / beta) * F.softplus(beta * margin)).mean()


def token_loss(out: ForwardOut, batch: dict, params: Params) -> torch.Tensor:
    return npo_token_loss(out.logp, batch["ref_logp"], params.beta)


def sequence_loss(out: ForwardOut, batch: dict, params: Params) -> torch.Tensor:
    return npo_sequence_loss(out.logp, batch["ref_logp"], batch["scored"], params.beta)


METHOD = Method("npo", token_loss, Params, rules={"beta": positive()}, sequence_loss=sequence_loss, title="NPO")
