"""UNDIAL (Dong et al. 2025, "UNDIAL: Self-Distillation with Adjusted Logits for Robust Unlearning in Large
Language Models"): at each scored token y = s_i, the cross-entropy between θ_o's next-token distribution with y's
logit lowered by β (no gradient through it) and θ's:

    ℓ_i = −Σ_v q(v) · log p_θ(v | s_<i),    q = softmax(z^o − β·e_y),  z^o θ_o's logits predicting s_i

i.e. q is θ_o's distribution with p_o(y) scaled by e^{−β} and renormalised. It moves θ towards θ_o with the
forgotten token made less likely: a bounded, self-distilling push, unlike GA's.

θ_o comes from stage one (`attribution.teacher_top_k: k`; `pipeline/attribution/teacher.py`): its top-k tokens
with their log-probabilities, the true token's (`logp_orig`) and one tail bucket for every other token. The
adjustment is exact on these values (y is always known, in or out of the top k); the cross-entropy is that of the
two distributions coarsened to (top-k tokens, y, the rest): exact on the k tokens and y, the tail a single bucket
(p_θ's tail mass against q's), as the retain KL's cache (`losses.topk_kl_from_logits`). It is at most CE(q, p_θ),
and up to q's entropy (a constant) its gradient is that of the coarsened KL, a lower bound of KL(q ‖ p_θ) equal to
it when p_θ's tail is q's tail rescaled; with k ≥ the vocabulary it is CE(q, p_θ). No resident reference model.

Where this follows whom: the paper's and the authors' loss at each position, averaged; the authors' code
(`dong-river/LLM_unlearning`) trains on every position of raw text and has a per-position "focus" weight (hard or
soft), which our token weights ω are. open-unlearning (undial.py, β = 10, no retain term) averages over all
B·(T−1) positions, prompt and padding included (there the one-hot wraps to token V−100, a distillation to θ_o);
ours averages over the answer tokens only (Σ ω ℓ / Σ ω per sample, `reduction`), so padding and prompt length do
not change its scale. β: the paper sweeps {3, 10, 30}; 10 (open-unlearning's) by default. No retain term of its own
(the paper has none; open-unlearning's α = 0); the run's `retain_loss` applies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.attribution.teacher import rest_logmass
from pipeline.common.numerics import LOG_TAIL_FLOOR
from pipeline.common.params import positive
from pipeline.training.methods.base import ForwardOut, Method


@dataclass(frozen=True)
class Params:
    beta: float = 10.0  # how far θ_o's logit of the forgotten token is lowered in the target


def undial_from_logits(logits: torch.Tensor, targets: torch.Tensor, top_ids: torch.Tensor, top_logp: torch.Tensor,
                       tail: torch.Tensor, true_logp: torch.Tensor, params: Params) -> torch.Tensor:
    """CE(q, p_θ) per position over the buckets (θ_o's top-k tokens, the target y, the rest), q = θ_o's
    distribution with p_o(y)·e^{−β}, renormalised: logits [N, vocab] (θ's), targets [N], top_ids / top_logp [N, k]
    (θ_o's top k), tail [N] (log of θ_o's mass outside them and y), true_logp [N] (log p_o(y)) -> [N]."""
    logp = torch.log_softmax(logits.float(), -1)
    targets, top_ids = targets.long(), top_ids.long()
    is_y = top_ids == targets[:, None]                      # y among the top k
    in_top = is_y.any(-1)
    minus_inf = torch.tensor(float("-inf"), device=logp.device)
    # θ_o's log-masses of the buckets, y's lowered by β: the top k (y's there if it is), y (if not), the rest
    target = torch.cat([top_logp.float() - params.beta * is_y,
                        torch.where(in_top, minus_inf, true_logp.float() - params.beta)[:, None],
                        tail.float()[:, None]], -1)
    q = torch.softmax(target, -1)                           # renormalised over the buckets
    own_top = logp.gather(-1, top_ids)
    own_y = torch.where(in_top, minus_inf, logp.gather(-1, targets[:, None])[:, 0])
    own_rest = rest_logmass(logp, top_ids, targets)         # Σ over the rest (no 1 − Σ: rounding)
    own = torch.cat([own_top, own_y[:, None].clamp(min=LOG_TAIL_FLOOR), own_rest[:, None]], -1)
    return -(q * own).sum(-1)


def undial_exact(logits: torch.Tensor, ref_logits: torch.Tensor, targets: torch.Tensor, beta: float) -> torch.Tensor:
    """The paper's loss from θ_o's full logits (tests): CE(softmax(z^o − β·e_y), softmax(z)) per position."""
    adjusted = ref_logits.float().scatter_add(-1, targets.long()[:, None],
                                              torch.full_like(ref_logits[:, :1], -beta, dtype=torch.float32))
    return -(torch.softmax(adjusted, -1) * torch.log_softmax(logits.float(), -1)).sum(-1)


def token_loss(out: ForwardOut, batch: dict, params: Params) -> torch.Tensor:
    return out.from_logits


METHOD = Method("undial", token_loss, params=Params, rules={"beta": positive()}, inputs=("from_logits",),
                from_logits=undial_from_logits, teacher=True, title="UNDIAL")
