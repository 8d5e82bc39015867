"""CE-U (Yang 2025, "CE-U: Cross Entropy Unlearning"): at each scored token y, the cross-entropy between θ's own
next-token distribution with y removed (no gradient through it) and θ's distribution, as open-unlearning's ceu.py
(contributed by the paper's author) computes it:

    ℓ_i = −Σ_{v ≠ y} q(v) · log p_θ(v | s_<i),    q = softmax(sg[z] with z_y = −∞),  z the logits predicting y = s_i

It pushes p_θ(y) down towards 0 with a bounded gradient (∂ℓ/∂z_y = p_θ(y), vanishing as y is forgotten, unlike GA)
and moves its mass to the other tokens in proportion to what θ already gives them. No reference model: q comes from
the model being trained. It reads the whole next-token distribution, so the loop evaluates `ceu_from_logits` on
the logits at the scored positions, `chunk_size` positions at a time (no [batch, length, vocab] tensor).

The first token of each answer is left out, no loss and no weight (open-unlearning's
`ignore_first_n_answer_tokens: 1`, after a footnote of the paper). Our weights pool ℓ like every token loss
(Σ ω_i ℓ_i / Σ ω_i over the rest); open-unlearning pools the batch's tokens (`reduction: token`). No retain term of
its own (open-unlearning's CEU has none); the run's `retain_loss` applies.
"""

from __future__ import annotations

import torch

from pipeline.training.methods.base import ForwardOut, Method, NoParams


def ceu_from_logits(logits: torch.Tensor, targets: torch.Tensor, params: NoParams | None = None) -> torch.Tensor:
    """CE(softmax(sg[z] with z_y = −∞), softmax(z)) per position: [N, vocab] logits, [N] tokens y -> [N]."""
    logits = logits.float()
    others = logits.detach().scatter(-1, targets.long()[:, None], float("-inf"))
    return -(torch.softmax(others, -1) * torch.log_softmax(logits, -1)).sum(-1)


def token_loss(out: ForwardOut, batch: dict, params: NoParams) -> torch.Tensor:
    return out.from_logits


METHOD = Method("ceu", token_loss, inputs=("from_logits",), from_logits=ceu_from_logits, skip_first=1, title="CE-U")
