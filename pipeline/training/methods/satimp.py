"""SatImp (Yang et al. 2025, "Exploring Criteria of Loss Reweighting to Enhance LLM Unlearning"): GA with each
token's loss scaled by a saturation × importance factor of its probability, as its authors' code (tmlr-group/SatImp,
dataloader_sat.py) and open-unlearning's satimp.py compute it:

    ℓ_i = sg[p_θ(s_i)^β1 · (1 − p_θ(s_i))^β2] · log p_θ(s_i)      sg: no gradient through the factor

so the tokens already unlikely (p → 0) and those the model is sure of (p → 1) are pushed least. β1 = 5, β2 = 1 are
open-unlearning's (and the authors'). Our weights combine with its factor as a product: the loop pools
Σ ω_i ℓ_i / Σ ω_i, the weight of token i being ω_i · its factor, as for WGA. Uniform weights give the authors' mean of
the weighted losses (per sample; `reduction: token` pools the batch's tokens as they do).

Retain: none of its own, as WGA here; the run's `retain_loss` applies. The authors' `satimp_gd` adds 0.1 · NLL on
the retain set (config/forget_sat.yaml): here `retain_loss: nll, retain_weight: 0.1`. open-unlearning's class
defaults agree (γ = 1, α = 0.1), but its configs/trainer/SatImp.yaml swaps them (γ = 0.1, α = 1, i.e. λ = 10); we
follow the authors. open-unlearning also loads a reference model that SatImp never reads: we load none.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.common.params import at_least
from pipeline.training.methods.base import ForwardOut, Method


@dataclass(frozen=True)
class Params:
    beta1: float = 5.0  # β1, the exponent of p (importance)
    beta2: float = 1.0  # β2, the exponent of 1 − p (saturation); β1 = β2 = 0: GA


def satimp_token_loss(logp: torch.Tensor, beta1: float = 5.0, beta2: float = 1.0) -> torch.Tensor:
    p = logp.detach().exp()
    return p.pow(beta1) * (1.0 - p).pow(beta2) * logp


def token_loss(out: ForwardOut, batch: dict, params: Params) -> torch.Tensor:
    return satimp_token_loss(out.logp, params.beta1, params.beta2)


METHOD = Method("satimp", token_loss, Params, rules={"beta1": at_least(0), "beta2": at_least(0)}, title="SatImp")
