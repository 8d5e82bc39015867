"""The forward pass of unlearning: the decoder's hidden states, and the LM head only where a loss reads it.

No [batch, length, vocab] logits: the head runs at the scored positions, `chunk_size` at a time, each chunk's logits
recomputed in the backward pass (pipeline.training.losses.by_chunks).
"""

from __future__ import annotations

from typing import Callable

import torch

from pipeline.common.modeling import decoder, lm_head_logits
from pipeline.training.losses import by_chunks, token_logp_from_logits


def inner_model(model):
    """The Hugging Face model inside a DeepSpeed engine: its decoder and head are called directly."""
    return getattr(model, "module", model)


def run_decoder(net, batch: dict, output_hidden_states: bool = False):
    """The decoder alone on a padded batch: `last_hidden_state` (and `hidden_states`, every layer's, if asked)."""
    return decoder(net)(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                        output_hidden_states=output_hidden_states)


def head_of(net) -> Callable[[torch.Tensor], torch.Tensor]:
    """The LM head as a function of hidden states, for by_chunks."""
    return lambda hidden: lm_head_logits(net, hidden)


def next_token_values(fn: Callable, net, last_hidden: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor,
                      chunk_size: int, *at_token: torch.Tensor) -> torch.Tensor:
    """fn(logits predicting token i, ids[b, i], *(x[b, i] for x in at_token)) at the positions marked (i ≥ 1), 0
    elsewhere: [B, T]. `fn` maps [N, vocab] logits, [N] tokens (and the [N, ...] values of `at_token`, [B, T, ...]
    each) to [N]; it runs on `chunk_size` positions at a time."""
    positions = positions.clone()
    positions[:, 0] = False  # the first token has no prefix
    rows, cols = positions.nonzero(as_tuple=True)
    values = by_chunks(fn, head_of(net), last_hidden[rows, cols - 1], ids[rows, cols],
                       *(x[rows, cols] for x in at_token), chunk=chunk_size)
    return torch.zeros(ids.shape, dtype=values.dtype, device=values.device).index_put((rows, cols), values)


def next_token_logp(net, last_hidden: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor,
                    chunk_size: int) -> torch.Tensor:
    """log p_θ(ids[b, i] | s_<i) at the positions marked (i ≥ 1), 0 elsewhere: [B, T]."""
    return next_token_values(token_logp_from_logits, net, last_hidden, ids, positions, chunk_size)


def predicting_positions(batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, positions) p whose next token p + 1 is labelled: where the retain terms compare distributions."""
    return (batch["labels"][:, 1:] != -100).nonzero(as_tuple=True)
