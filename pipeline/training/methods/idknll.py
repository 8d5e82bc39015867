"""IdkNLL: teach the model to answer "I don't know" to the forget questions: the NLL of each sample's idk answer
(TOFU's "idk" objective; open-unlearning's IdkNLL checkpoints):

    L = mean over samples of −(1/m) Σ_j log p_θ(y_j),    y the idk answer, m its scored tokens (its tokens and EOS)

No θ_o, and the forget answer itself is never run: the idk answer and its tokens come from stage one
(`attribution.alternatives: [idk]`, `pipeline.attribution.alternatives`). Token weights ω are defined on the forget
answer's tokens and there is none to match on the idk answer, so only uniform weights are accepted. TOFU pools the
idk and retain tokens of one forward pass (one mean); open-unlearning's checkpoints (`..._IdkNLL_..._alpha2_...`)
imply GradDiff's form γ·NLL(idk) + α·NLL(retain). The mean is per sample here, as for every method's
`reduction: sample`.

Retain: none of its own, so the run's `retain_loss` applies; GradDiff's form is `retain_loss: nll, retain_weight: 1`
(open-unlearning's released checkpoints also tune α, e.g. 2).
"""

from __future__ import annotations

import torch

from pipeline.training.methods.base import ForwardOut, Method, NoParams


def idk_nll(logp: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """Each sample's mean NLL over its scored tokens, then the mean over samples: [B, T] log p, [B, T] 0/1."""
    return (-(logp * scored).sum(-1) / scored.sum(-1).clamp(min=1)).mean()


def sequence_loss(out: ForwardOut, batch: dict, params: NoParams) -> torch.Tensor:
    return idk_nll(out.alternative_logp, batch["alternative"]["scored"])


METHOD = Method("idknll", None, sequence_loss=sequence_loss, inputs=("alternative_logp",), alternative="idk",
                token_weights=False, title="IdkNLL")
