"""IdkDPO: DPO (Rafailov et al. 2023) with an "I don't know" answer y_w preferred to the forget answer y_l, against
θ_o, as open-unlearning's DPO trainer on its idk data computes it (dpo.py, `compute_dpo_loss`):

    L = −(2/β) · log σ(β · [(log π_θ(y_w) − log π_o(y_w)) − (S_ω(θ) − S_ω(θ_o))]) = (2/β) · softplus(−β · (Δ_w − Δ_l))

per sample, then the mean over samples. log π(y) sums log p over the answer's scored tokens (its tokens and EOS, as
open-unlearning's `compute_batch_nll`). The factor 2/β is open-unlearning's (and AltPO's authors'), an NPO
convention: the DPO paper has none, so with β = 0.1 the forget term is 20× the paper's, which weighs it against the
retain term. β = 0.1 is open-unlearning's (configs/trainer/DPO.yaml).

θ_o is read, never loaded: its Σ log p of the idk answer comes from stage one (`attribution.alternatives: [idk]`,
the shards' `idk_logp`), its per-token log p of the forget answer from the shards' `logp_orig`, as NPO's. The idk
answer is one of ours (`pipeline.data.idk`), fixed per question (`pipeline.attribution.alternatives`);
open-unlearning draws one of TOFU's 100 at random each time an item is loaded.

Token weights ω are defined on the forget answer's tokens, so they enter the loser's term only, the same ω on θ and
θ_o's side (the W-seq rule): S_ω = n · Σ_i ω_i log p(s_i) / Σ_i ω_i, n its scored tokens. Uniform weights give
log π(y_l) itself, so this is DPO; hard and soft weights give the ω-weighted mean log p scaled to the answer's
length, so the loser's term keeps the scale of the winner's (unweighted) sum and β keeps its meaning whatever the
weighting (a plain Σ ω log p would be r or 1/n of it). It is one loss of whole sequences under every weighting.

Retain: none of its own (as NPO here), so the run's `retain_loss` applies. open-unlearning's IdkDPO adds NLL on the
retain set with γ = α = 1: here `retain_loss: nll, retain_weight: 1`.
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


def weighted_answer_logp(logp: torch.Tensor, weights: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """S_ω = n · Σ ω log p / Σ ω per sample [B] (n the scored tokens): Σ log p under uniform weights; 0 for a sample
    whose weights sum to 0."""
    totals = weights.sum(-1)
    weighted = (logp * weights).sum(-1) * scored.sum(-1)
    return torch.where(totals > 0, weighted / totals.clamp(min=torch.finfo(totals.dtype).tiny), 0.0)


def dpo_loss(win_logratio: torch.Tensor, lose_logratio: torch.Tensor, beta: float = 0.1) -> torch.Tensor:
    """(2/β)·softplus(−β·(Δ_w − Δ_l)) = −(2/β)·log σ(β·(Δ_w − Δ_l)), the mean over samples; Δ = log π_θ − log π_o
    of the preferred (w) and the forget (l) answer, [B] each."""
    return ((2.0 / beta) * F.softplus(-beta * (win_logratio - lose_logratio))).mean()


def sequence_loss(out: ForwardOut, batch: dict, params: Params) -> torch.Tensor:
    """DPO with the batch's alternative answer (here the idk answer) preferred to the forget answer."""
    alt = batch["alternative"]
    win = (out.alternative_logp * alt["scored"]).sum(-1) - alt["ref_logp"]
    weights, scored = batch["weights"], batch["scored"]
    lose = weighted_answer_logp(out.logp, weights, scored) - weighted_answer_logp(batch["ref_logp"], weights, scored)
    return dpo_loss(win, lose, params.beta)


METHOD = Method("idkdpo", None, Params, rules={"beta": positive()}, sequence_loss=sequence_loss,
                inputs=("logp", "alternative_logp"), alternative="idk", title="IdkDPO")
