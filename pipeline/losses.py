"""Training objectives as pure functions of a model's outputs and a batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .templates import IGNORE_INDEX


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
