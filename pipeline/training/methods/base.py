"""What every method module declares (`Method`) and what the loop hands its forget loss (`ForwardOut`).

A method is a token loss ℓ [batch, tokens], a pure function of the model's outputs and the forget batch; the loop
combines it with the token weights ω (`reduction`), adds the retain term and steps. Its hyper-parameters are a
frozen dataclass with their defaults (`params`) and the rules a value must meet (`rules`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Callable

import torch

from pipeline.common.params import Rule


@dataclass
class ForwardOut:
    logp: torch.Tensor | None     # [B, T] log p_θ(s_i | s_<i), 0 where not scored (methods that read it)
    hidden: torch.Tensor | None   # [B, T, d] hidden states at rmu_layer (methods that read them)


@dataclass(frozen=True)
class NoParams:
    """The hyper-parameters of a method that has none."""


@dataclass(frozen=True)
class Prepared:
    """What a method sets up on the model before the first step."""

    parameters: list | None = None  # the parameters trained; None: all of them
    forget_extras: dict = field(default_factory=dict)  # added to every forget micro-batch (RMU's c·u)


# ℓ [B, T] from the forward pass, the forget micro-batch and the method's params; 0 where not scored
TokenLoss = Callable[[ForwardOut, dict, Any], torch.Tensor]


@dataclass(frozen=True)
class Method:
    name: str
    token_loss: TokenLoss
    params: type = NoParams                          # a frozen dataclass: the hyper-parameters and their defaults
    rules: dict[str, Rule] = field(default_factory=dict)  # the checks of params' fields, e.g. {"beta": positive()}
    sequence_loss: Callable[[ForwardOut, dict, Any], torch.Tensor] | None = None  # with uniform weights, this
    #                                                loss of whole sequences instead (NPO's original); a scalar
    needs_logp: bool = True                          # reads log p_θ of the scored tokens (the LM head runs there)
    needs_hidden: bool = False                       # reads the hidden states at rmu_layer
    own_retain: tuple[str, float] | None = None      # its own retain term and λ, as its authors define it
    prepare: Callable[..., Prepared] | None = None   # (model, params, rmu_layer, seed) -> Prepared: RMU's frozen
    #                                                layers and control vector

    @property
    def hyperparameters(self) -> tuple[str, ...]:
        """The keys of its params: all its loss can read, so all a run's record must name."""
        return tuple(f.name for f in fields(self.params))
