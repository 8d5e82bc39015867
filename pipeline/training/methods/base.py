"""What every method module declares (`Method`) and what the loop hands its forget loss (`ForwardOut`).

A method is a token loss ℓ [batch, tokens], a pure function of the model's outputs and the forget batch; the loop
combines it with the token weights ω (`reduction`), adds the retain term and steps. A method without a token-level
form (SimNPO) is a loss of whole sequences that reads ω itself. Its hyper-parameters are a frozen dataclass with
their defaults (`params`) and the rules a value must meet (`rules`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Callable

import torch

from pipeline.common.params import Rule


@dataclass
class ForwardOut:
    """The inputs a method's loss reads, one field each, by the names it declares in `Method.inputs`; the loop
    fills those alone (pipeline.training.method_inputs), the rest stay None."""

    logp: torch.Tensor | None = None    # [B, T] log p_θ(s_i | s_<i), 0 where not scored
    hidden: torch.Tensor | None = None  # [B, T, d] hidden states at the run's hidden_layer (rmu_layer)
    from_logits: torch.Tensor | None = None  # [B, T] the method's `from_logits` at each scored token, 0 elsewhere
    alternative_logp: torch.Tensor | None = None  # [B, T'] log p_θ of the alternative answer's scored tokens
    #                                              (batch["alternative"]), 0 elsewhere


INPUTS = tuple(f.name for f in fields(ForwardOut))  # what a method may declare it reads
FORGET_ANSWER_INPUTS = ("logp", "hidden", "from_logits")  # those read from θ's pass on the forget answer


# A function of the whole next-token distribution at each scored position: (logits [N, vocab] that predict the N
# tokens, the tokens [N], then, for a method with `teacher`, θ_o's top-k ids [N, k], log-probs [N, k], tail [N] and
# log-prob of the token [N], and always the keyword `params`, the method's) -> [N]. The loop evaluates it
# `chunk_size` positions at a time (losses.by_chunks), so no [batch, length, vocab] tensor is made.
FromLogits = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


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
    token_loss: TokenLoss | None                     # None: no token-level form; its sequence_loss reads ω
    #                                                (batch["weights"]) and is its loss under every weighting
    params: type = NoParams                          # a frozen dataclass: the hyper-parameters and their defaults
    rules: dict[str, Rule] = field(default_factory=dict)  # the checks of params' fields, e.g. {"beta": positive()}
    sequence_loss: Callable[[ForwardOut, dict, Any], torch.Tensor] | None = None  # with uniform weights (with
    #                                                every weighting if token_loss is None), this loss of whole
    #                                                sequences instead (NPO's original); a scalar
    inputs: tuple[str, ...] = ("logp",)              # what its loss reads of the forward pass (`INPUTS`,
    #                                                ForwardOut's fields): logp (log p_θ of the scored tokens; the
    #                                                LM head runs there), hidden (the hidden states at the run's
    #                                                hidden_layer), from_logits, alternative_logp; the loop
    #                                                computes these alone
    from_logits: FromLogits | None = None            # with input from_logits: this function of the full next-token
    #                                                distribution (CE-U's), as out.from_logits
    skip_first: int = 0                              # the first n scored tokens of each sample get no loss and no
    #                                                weight (CE-U's `ignore_first_n_answer_tokens`)
    alternative: str | None = None                   # with input alternative_logp: trains on each forget sample's
    #                                                alternative answer of this kind (stage one's attribution.
    #                                                alternatives: idk, perturbed): the batch carries it with θ_o's
    #                                                Σ log p, the loop runs θ on it (out.alternative_logp)
    teacher: bool = False                            # its from_logits reads θ_o's top-k next-token distribution
    #                                                at each scored token, kept by stage one (attribution.
    #                                                teacher_top_k; UNDIAL): no reference model in stage two
    token_weights: bool = True                       # whether ω means something for it; False (a loss on another
    #                                                answer's tokens alone, IdkNLL): only uniform weights
    own_retain: tuple[str, float] | None = None      # its own retain term and λ, as its authors define it
    title: str = ""                                  # its name as its authors write it (SimNPO), for the tables;
    #                                                empty: the name in capitals
    prepare: Callable[..., Prepared] | None = None   # (model, params, hidden_layer, seed) -> Prepared: RMU's
    #                                                frozen layers and control vector
    dual: Callable[..., Any] | None = None           # (params, retain_weight, steps per epoch, θ_o's retain loss
    #                                                as a function) -> the retain weight λ as a dual variable
    #                                                (PDU's): its `value` weighs each step's retain term,
    #                                                `after_step(done, history row)` updates it, `restore(history)`
    #                                                sets it on resume

    def __post_init__(self):
        if self.token_loss is None and self.sequence_loss is None:
            raise ValueError(f"method {self.name}: needs a token_loss or a sequence_loss")
        unknown = sorted(set(self.inputs) - set(INPUTS))
        if unknown or not self.inputs:
            raise ValueError(f"method {self.name}: inputs {list(self.inputs)}: one or more of {list(INPUTS)}")
        # an input and what it is computed from come together
        if ("from_logits" in self.inputs) != (self.from_logits is not None):
            raise ValueError(f"method {self.name}: the input from_logits and a from_logits function go together")
        if ("alternative_logp" in self.inputs) != (self.alternative is not None):
            raise ValueError(f"method {self.name}: the input alternative_logp and an alternative answer go together")

    @property
    def weighs_itself(self) -> bool:
        """Whether its sequence loss reads ω itself and is its loss under every weighting (no token-level form)."""
        return self.token_loss is None

    @property
    def reads_forget_answer(self) -> bool:
        """Whether its loss reads θ on the forget answer (all but IdkNLL): else that forward pass is skipped."""
        return any(name in self.inputs for name in FORGET_ANSWER_INPUTS)

    @property
    def needs_logp(self) -> bool:  # the earlier flags, read off `inputs`
        return "logp" in self.inputs

    @property
    def needs_hidden(self) -> bool:
        return "hidden" in self.inputs

    @property
    def hyperparameters(self) -> tuple[str, ...]:
        """The keys of its params: all its loss can read, so all a run's record must name."""
        return tuple(f.name for f in fields(self.params))
