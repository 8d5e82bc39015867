"""Every training loss as a pure function of a model's outputs, weights and masks: finetuning's NLL, the
pooling of the unlearning token losses, and the retention terms. Each method's own token loss is in its module,
`pipeline.training.methods`.

Finetuning minimises the mean NLL of the labelled (answer and EOS) tokens.

Forget losses are per-token `ℓ_i` (lower is more forgetting; the trainer minimises them), pooled with the token
weights ω by the run's `reduction`:

    sample  the mean over samples of Σ_i ω_i ℓ_i / Σ_i ω_i (the default): each sample counts the same. With ω = 1
            that is each sample's token mean; hard weights give the mean over its selected tokens; soft weights a
            softmax-weighted average.
    token   Σ_{b,i} ω_bi ℓ_bi / Σ_{b,i} ω_bi over the micro-batch (open-unlearning's): each token counts the same,
            so a sample weighs by its tokens' total weight.

Retention: KL(p_ref(·|s_<k) ‖ p_θ(·|s_<k)) summed over the answer tokens of each retain sample, NLL, and
RMU's activation matching ‖h_θ − h_ref‖² (mean over hidden dimensions and over the positions).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pipeline.common.numerics import LOG_TAIL_FLOOR, log1mexp
from pipeline.data.templates import IGNORE_INDEX


# ---- finetuning -----------------------------------------------------------------------------------------------

def shifted_token_nll(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token negative log-likelihood of labels[:, 1:] under logits[:, :-1], and the mask of labelled tokens."""
    logits, labels = logits[:, :-1], labels[:, 1:]
    mask = labels != IGNORE_INDEX
    nll = F.cross_entropy(
        logits.reshape(-1, logits.size(-1)).float(), labels.clamp(min=0).reshape(-1), reduction="none"
    ).view(labels.shape)
    return nll * mask, mask


def causal_lm_loss(model, batch: dict) -> tuple[torch.Tensor, dict[str, float]]:
    """Mean NLL over the labelled (answer and EOS) tokens of the batch: the finetuning objective."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    nll, mask = shifted_token_nll(logits, batch["labels"])
    return nll.sum() / mask.sum().clamp(min=1), {}


# ---- unlearning -----------------------------------------------------------------------------------------------

def weighted_sample_mean(token_losses: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Mean over samples of Σ_i ω_i ℓ_i / Σ_i ω_i; a sample whose weights sum to 0 is left out.

    token_losses, weights: [batch, tokens]; weights are 0 at positions that are not scored."""
    totals = weights.sum(-1)
    keep = totals > 0
    if not keep.any():
        return token_losses.sum() * 0.0  # keeps the graph: a zero loss with a gradient of zero
    per_sample = (token_losses * weights).sum(-1)[keep] / totals[keep]
    return per_sample.mean()


def weighted_token_mean(token_losses: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ ω_i ℓ_i / Σ ω_i over every token of the batch; 0 (with a zero gradient) if no token has weight.

    token_losses, weights: [batch, tokens]; weights are 0 at positions that are not scored."""
    total = weights.sum()
    if not total > 0:
        return token_losses.sum() * 0.0  # keeps the graph: a zero loss with a gradient of zero
    return (token_losses * weights).sum() / total


# `reduction`: how a method's token losses [batch, tokens] and the weights ω become the forget loss
FORGET_REDUCTIONS = {"sample": weighted_sample_mean, "token": weighted_token_mean}


def without_first_scored(batch: dict, n: int) -> dict:
    """The forget batch with the first n scored tokens of each sample neither scored nor weighted (CE-U leaves
    each answer's first token out). The other weights are kept as they are: the pooling divides by their sum."""
    scored = batch["scored"] > 0
    keep = scored & (scored.cumsum(-1) > n)
    return {**batch, "scored": batch["scored"] * keep, "weights": batch["weights"] * keep}


def activation_matching_loss(hidden: torch.Tensor, ref_hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """RMU's retain loss: the squared distance to the frozen model's activations, as a mean over hidden
    dimensions (RMU's MSE) and over the masked positions of the batch."""
    per_position = (hidden.float() - ref_hidden.float()).pow(2).mean(-1)
    return (per_position * mask).sum() / mask.sum().clamp(min=1)


def forward_kl_loss(ref_logits: torch.Tensor, logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """KL(p_ref ‖ p_θ) at each masked position, summed over a sample's positions, averaged over samples."""
    ref_logp = torch.log_softmax(ref_logits.float(), -1)
    logp = torch.log_softmax(logits.float(), -1)
    kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1)
    return (kl * mask).sum(-1).mean()


def nll_loss(logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood over the masked tokens of the batch."""
    return -(logp * mask).sum() / mask.sum().clamp(min=1)


def token_logp(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(labels[:, i]) under logits[:, i−1], aligned with labels (position 0 gets 0), and the mask of
    labelled positions (labels ≠ −100)."""
    mask = labels != IGNORE_INDEX
    mask[:, 0] = False
    logp = torch.zeros(labels.shape, dtype=torch.float32, device=logits.device)
    lsm = torch.log_softmax(logits[:, :-1].float(), -1)
    logp[:, 1:] = lsm.gather(-1, labels[:, 1:].clamp(min=0)[..., None])[..., 0]
    return logp * mask, mask


# ---- the LM head, a chunk of positions at a time -----------------------------------------------------------------
# A [batch, length, vocab] fp32 tensor (the logits, and again their log-softmax and gradient) is the largest thing
# an unlearning step holds for a large vocabulary. These compute what the losses need from the hidden states at
# the positions that are scored, `chunk` positions at a time; with gradients on, each chunk's logits are recomputed
# in the backward pass instead of kept (activation checkpointing of the head), so at most one chunk's
# [chunk, vocab] logits exist at a time. `head` maps hidden states to fp32 logits (the model's own head,
# soft-capping included: pipeline.common.modeling.lm_head_logits).

def topk_kl_from_logits(logits: torch.Tensor, ref_ids: torch.Tensor, ref_logp: torch.Tensor,
                        ref_tail: torch.Tensor) -> torch.Tensor:
    """KL(p_ref ‖ p_θ) per position with p_ref known on its top-k tokens and as one tail bucket: the KL between the
    two distributions coarsened to (the k tokens, everything else), exact on the k tokens and a lower bound of the
    full KL (coarsening never increases a KL), equal to it when p_θ's tail is p_ref's tail rescaled.

        Σ_{v ∈ top-k} p_ref(v)·(log p_ref(v) − log p_θ(v)) + T_ref·(log T_ref − log T_θ),  T = 1 − Σ_{top-k} p

    logits [N, vocab] (θ's), ref_ids / ref_logp [N, k], ref_tail [N] (log T_ref) -> [N]."""
    logp = torch.log_softmax(logits.float(), -1)
    own = logp.gather(-1, ref_ids.long())
    own_tail = log1mexp(torch.logsumexp(own, -1)).clamp(min=LOG_TAIL_FLOOR)
    head = (ref_logp.exp() * (ref_logp - own)).sum(-1)
    return head + ref_tail.exp() * (ref_tail - own_tail)


def forward_kl_from_logits(ref_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(p_ref ‖ p_θ) per position over the whole vocabulary: [N, vocab] x 2 -> [N]."""
    ref_logp = torch.log_softmax(ref_logits.float(), -1)
    return (ref_logp.exp() * (ref_logp - torch.log_softmax(logits.float(), -1))).sum(-1)


def token_logp_from_logits(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) per position: [N, vocab], [N] -> [N]."""
    logits = logits.float()
    return logits.gather(-1, targets.long()[:, None])[:, 0] - torch.logsumexp(logits, -1)


def by_chunks(fn, head, hidden: torch.Tensor, *per_row: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """`fn(head(hidden[i:j]), *(x[i:j] for x in per_row))` over chunks of rows, concatenated. With gradients on,
    each chunk is checkpointed: its logits are recomputed in the backward pass, never kept."""
    from torch.utils.checkpoint import checkpoint

    def piece(h, *rows):
        return fn(head(h), *rows)

    keep = torch.is_grad_enabled() and hidden.requires_grad
    # determinism_check off: under ZeRO-3 a frozen head's weight is released after the recomputed forward and
    # gathered again for its backward, which the check would take for a changed tensor
    out = [checkpoint(piece, hidden[i: i + chunk], *(x[i: i + chunk] for x in per_row), use_reentrant=False,
                      determinism_check="none")
           if keep else piece(hidden[i: i + chunk], *(x[i: i + chunk] for x in per_row))
           for i in range(0, hidden.size(0), chunk)]
    return torch.cat(out) if out else hidden.new_zeros(0, dtype=torch.float32)
