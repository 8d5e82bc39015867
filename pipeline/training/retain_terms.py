"""The retain terms: what keeps the model's utility on retain data while it unlearns, one small function each,
registered by name in `RETAIN_LOSSES` (a run's `retain_loss`). The loop adds λ·term (λ: `retain_weight`).

Each term is `(net, reference, batch, cfg) -> scalar`: `net` the trained model, `batch` the padded retain
micro-batch (`input_ids`, `attention_mask`, `labels`), `cfg` the run's UnlearnConfig (`chunk_size`, and
`hidden_layer` for a term that reads hidden states). θ_o comes from the reference cache (`batch["ref"]`, written by
`tokenunlearn reference`) or, with `retain_reference: model`, from the frozen model itself (`reference`): a loaded
copy, or, for a model with LoRA adapters, the trained model with its adapters switched off (ADAPTERS_OFF: no
second copy).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch

from pipeline.common.errors import ParamError
from pipeline.common.modeling import lm_head_logits
from pipeline.data.batching import pad_batch
from pipeline.data.templates import EncodedSample
from pipeline.training.engine import Engine, to_device
from pipeline.training.forward import head_of, inner_model, predicting_positions, run_decoder
from pipeline.training.losses import by_chunks, forward_kl_from_logits, token_logp_from_logits, topk_kl_from_logits
from pipeline.training.lora import reference_view

ADAPTERS_OFF = "adapters switched off"


@contextlib.contextmanager
def theta_o(net, reference):
    """θ_o for the exact retain terms: the trained model's base with its adapters off, or the reference model."""
    if reference == ADAPTERS_OFF:
        with reference_view(net) as base:
            yield base
    elif reference is None:
        raise ParamError("a retain term that reads θ_o needs the reference cache or retain_reference: model")
    else:
        yield inner_model(reference)


def retain_kl(net, reference, batch: dict, cfg) -> torch.Tensor:
    """KL(p_θo ‖ p_θ) summed over each sample's answer positions, averaged over samples."""
    hidden, ref = run_decoder(net, batch).last_hidden_state, batch.get("ref")
    if ref is not None:  # θ_o's top-k and tail bucket: pipeline.training.losses.topk_kl_from_logits
        kl = by_chunks(topk_kl_from_logits, head_of(net), hidden[ref["rows"], ref["cols"]], ref["topk_ids"],
                       ref["topk_logp"], ref["tail_logp"], chunk=cfg.chunk_size)
    else:  # the exact KL; θ_o's logits at the answer positions are kept (no gradient): the measuring option
        rows, cols = predicting_positions(batch)
        with torch.no_grad(), theta_o(net, reference) as ref_net:
            ref_logits = lm_head_logits(ref_net, run_decoder(ref_net, batch).last_hidden_state[rows, cols])
        kl = by_chunks(lambda logits, ref: forward_kl_from_logits(ref, logits), head_of(net), hidden[rows, cols],
                       ref_logits, chunk=cfg.chunk_size)
    return kl.sum() / batch["input_ids"].size(0)


def retain_nll(net, reference, batch: dict, cfg) -> torch.Tensor:
    """The mean NLL of the retain answer tokens (GradDiff's term)."""
    rows, cols = predicting_positions(batch)
    logp = by_chunks(token_logp_from_logits, head_of(net), run_decoder(net, batch).last_hidden_state[rows, cols],
                     batch["input_ids"][rows, cols + 1], chunk=cfg.chunk_size)
    return -logp.mean()


def retain_activation(net, reference, batch: dict, cfg) -> torch.Tensor:
    """RMU's retain loss: ‖h_θ − h_θo‖² at the hidden layer (mean over hidden dimensions and answer positions)."""
    layer = cfg.hidden_layer
    hidden, ref = run_decoder(net, batch, output_hidden_states=True).hidden_states[layer], batch.get("ref")
    if ref is not None:
        rows, cols, ref_hidden = ref["rows"], ref["cols"], ref["act"]
    else:
        rows, cols = predicting_positions(batch)
        with torch.no_grad(), theta_o(net, reference) as ref_net:
            ref_hidden = run_decoder(ref_net, batch, output_hidden_states=True).hidden_states[layer][rows, cols]
    if rows.numel() == 0:
        return hidden.sum() * 0.0
    return (hidden[rows, cols].float() - ref_hidden.float()).pow(2).mean(-1).mean()


@dataclass(frozen=True)
class RetainLoss:
    loss: Callable[..., torch.Tensor]  # (net, reference, batch, cfg) -> the term, a scalar
    needs_reference: bool = False      # reads θ_o: the reference cache, or the model (`retain_reference`)
    reads_hidden: bool = False         # reads the hidden states at the run's hidden_layer (the cache keeps θ_o's)


RETAIN_LOSSES: dict[str, RetainLoss | None] = {
    "kl": RetainLoss(retain_kl, needs_reference=True),
    "nll": RetainLoss(retain_nll),
    "activation": RetainLoss(retain_activation, needs_reference=True, reads_hidden=True),  # RMU's original
    "none": None,
}


@torch.no_grad()
def retain_nll_at_start(engine: Engine, retain: list[EncodedSample], indices: list[int], micro_batch_size: int,
                        pad_id: int, chunk_size: int) -> float:
    """The model's mean NLL per retain answer token over `indices` (before the first step: θ_o's), the same on
    every process: each runs every index, in the same order. PDU's ε is relative to it."""
    net, total, count = inner_model(engine.engine), 0.0, 0
    training = net.training
    net.eval()  # no dropout: the measure draws none of training's random numbers
    for start in range(0, len(indices), micro_batch_size):
        batch = to_device(pad_batch([retain[i] for i in indices[start:start + micro_batch_size]], pad_id),
                          engine.device)
        rows, cols = predicting_positions(batch)
        logp = by_chunks(token_logp_from_logits, head_of(net), run_decoder(net, batch).last_hidden_state[rows, cols],
                         batch["input_ids"][rows, cols + 1], chunk=chunk_size)
        total, count = total - logp.double().sum().item(), count + logp.numel()
    net.train(training)
    return total / max(count, 1)
