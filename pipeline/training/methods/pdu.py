"""PDU (Entesari et al. 2025, "Constrained Entropic Unlearning: A Primal-Dual Framework for Large Language
Models"): unlearning as a constrained problem, forget as much as possible while the retain loss stays below ε,

    min_θ  L_f(θ)   subject to   L_r(θ) ≤ ε,     L_f: ℓ_i = (max_v z_v − mean_v z_v)²,  z the logits predicting s_i

solved by primal-dual steps on the Lagrangian L_f + λ·(L_r − ε): a gradient step on θ, then dual ascent on λ,

    λ ← max(0, λ + η·(L_r − ε))   after each optimizer step, from that step's retain loss (NLL on retain answers).

The forget loss flattens the logits towards uniform (no unbounded push, unlike GA); λ rises while the retain loss
is above ε and falls back to 0 once it is met, so ε, not a hand-set λ, decides how much utility is spent.
λ starts at the run's `retain_weight` (the paper: 50 to 100, as the forget loss is a squared logit gap).

ε: `epsilon_kind: absolute` takes `epsilon` as it is (open-unlearning's `retain_loss_eps`; the authors' TOFU
setting is 0.3); `relative` (our default) sets ε = (1 + epsilon)·L_r(θ_o), θ_o's mean NLL per retain answer token
over the retain samples the run uses, measured before the first step. The authors' advice is to pick ε "larger
than the retain loss of the pretrained model": relative says so once for every model and task.

Where this follows whom: the loss, the update and the warmup are open-unlearning's (pdu.py, contributed by the
authors), with three differences, all for consistency with the other methods here:
- λ is updated once per optimizer step from the step's retain loss averaged over its micro-batches and
  processes, so N processes train as one process with N-fold accumulation; open-unlearning updates it in every
  micro-batch's loss, on each process separately.
- ℓ is taken at the positions that predict the answer tokens, as every loss here; open-unlearning's mask is the
  labels' own, unshifted, one position later (it scores the position after the answer's last token, not the one
  before its first).
- ℓ pools with ω per sample (`reduction: sample`, hard and soft weights apply); open-unlearning averages over the
  batch's tokens (`reduction: token`).
The dual warmup counts epochs as open-unlearning does: no update before `dual_warmup_epochs` epochs are done.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable

import torch

from pipeline.common.params import at_least, one_of
from pipeline.training.methods.base import ForwardOut, Method

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Params:
    epsilon: float = 0.5               # the constraint L_r ≤ ε: relative, ε = (1 + epsilon)·L_r(θ_o); absolute, ε
    epsilon_kind: str = "relative"     # = epsilon (open-unlearning's retain_loss_eps)
    dual_step: float = 1.0             # η of λ ← max(0, λ + η·(L_r − ε)); 0: λ stays at retain_weight
    dual_warmup_epochs: float = 0.0    # no dual update before this many epochs are done (the authors' TOFU: 5)


def margin_from_logits(logits: torch.Tensor, targets: torch.Tensor, params: Params | None = None) -> torch.Tensor:
    """(max logit − mean logit)² per position: [N, vocab] logits (the token itself is not read) -> [N]."""
    logits = logits.float()
    return (logits.max(-1).values - logits.mean(-1)).pow(2)


def token_loss(out: ForwardOut, batch: dict, params: Params) -> torch.Tensor:
    return out.from_logits


class Dual:
    """λ, the weight of the retain term, one value per optimizer step. `value` is what the next step uses;
    `after_step` updates it from the finished step's retain loss and returns it for that step's history row, so a
    run resumed from a checkpoint restores it (`restore`) and continues as an unbroken one."""

    KEY = "dual"  # its column in the history (the loss-curve file)

    def __init__(self, params: Params, initial: float, steps_per_epoch: int,
                 retain_at_start: Callable[[], float]):
        self.value, self.step = float(initial), params.dual_step
        self.warmup_steps = math.ceil(params.dual_warmup_epochs * steps_per_epoch - 1e-9)
        if params.epsilon_kind == "absolute":
            self.epsilon = params.epsilon
        else:
            start = retain_at_start()
            self.epsilon = (1 + params.epsilon) * start
            log.info("PDU: θ_o's retain loss %.6g, so ε = (1 + %g) x %.6g = %.6g", start, params.epsilon, start,
                     self.epsilon)

    def after_step(self, done: int, row: dict) -> dict:
        if self.step and done > self.warmup_steps:
            self.value = max(0.0, self.value + self.step * (row["retain_loss"] - self.epsilon))
        return {self.KEY: self.value}

    def restore(self, history: list[dict]) -> None:
        if history and self.KEY in history[-1]:
            self.value = float(history[-1][self.KEY])


METHOD = Method("pdu", token_loss, params=Params,
                rules={"epsilon": at_least(0), "epsilon_kind": one_of(["absolute", "relative"]),
                       "dual_step": at_least(0), "dual_warmup_epochs": at_least(0)},
                inputs=("from_logits",), from_logits=margin_from_logits, own_retain=("nll", 100.0), dual=Dual,
                title="PDU")
