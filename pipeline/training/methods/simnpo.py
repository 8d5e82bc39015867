"""SimNPO (Fan et al. 2024, "Simplicity Prevails"): NPO without a reference model, on the answer's length-normalised
log-likelihood. Per sample, as its authors' code (OPTML-Group/Unlearn-Simple, TOFU/dataloader.py) and
open-unlearning's simnpo.py compute it:

    L = −(2/β) · log σ(β · (m − δ)) = (2/β) · softplus(β · (δ − m)),    m = Σ_i ω_i ℓ_i / Σ_i ω_i,  ℓ_i = −log p_θ(s_i)

then the mean over samples. With uniform weights (ω = 1 on the scored tokens) m is the answer's mean NLL: SimNPO
itself. With hard or soft weights m is the ω-weighted mean NLL (the W-seq rule): length normalisation becomes weight
normalisation, so β keeps its scale. It is one loss of whole sequences under every weighting, so there are no token
losses to pool and `reduction: token` is refused.

The margin δ sits inside the product with β, as in the authors' code and open-unlearning; the paper writes
σ(−(β/|y|)·log π_θ(y|x) − γ), so the paper's γ is β·δ (open-unlearning issue #123). They agree at δ = 0, the
default. β = 4.5 and δ = 0 are open-unlearning's (configs/trainer/SimNPO.yaml).

Retain: none of its own, as NPO here; the run's `retain_loss` applies. The authors' `simnpo_grad_diff` and
open-unlearning add NLL on the retain set, γ·L + α·NLL with open-unlearning's γ = 0.125 (Unlearn-Simple's
npo_coeff), α = 1: here `retain_loss: nll, retain_weight: 8` (α/γ; the step's overall scale is the learning rate's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pipeline.common.params import at_least, positive
from pipeline.training.methods.base import ForwardOut, Method


@dataclass(frozen=True)
class Params:
    beta: float = 4.5   # β, the inverse temperature
    delta: float = 0.0  # δ, the margin on the mean NLL (open-unlearning's delta; the paper's γ is β·δ)


def simnpo_sequence_loss(logp: torch.Tensor, weights: torch.Tensor, beta: float = 4.5,
                         delta: float = 0.0) -> torch.Tensor:
    """(2/β)·softplus(β·(m_ω + δ)), m_ω = Σ ω log p / Σ ω each sample's weighted mean log p (minus its mean NLL),
    then the mean over samples; a sample whose weights sum to 0 is left out.

    logp, weights: [batch, tokens]; weights are 0 at positions that are not scored (uniform: 1 at the others)."""
    totals = weights.sum(-1)
    keep = totals > 0
    if not keep.any():
        return logp.sum() * 0.0  # keeps the graph: a zero loss with a gradient of zero
    mean_logp = (logp * weights).sum(-1)[keep] / totals[keep]
    return ((2.0 / beta) * F.softplus(beta * (mean_logp + delta))).mean()


def sequence_loss(out: ForwardOut, batch: dict, params: Params) -> torch.Tensor:
    return simnpo_sequence_loss(out.logp, batch["weights"], params.beta, params.delta)


METHOD = Method("simnpo", None, Params, rules={"beta": positive(), "delta": at_least(0)},
                sequence_loss=sequence_loss, title="SimNPO")
