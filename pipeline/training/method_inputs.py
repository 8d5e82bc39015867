"""What the loop hands a method's forget loss: the inputs its record declares (`Method.inputs`), each computed by
the provider of that name in `METHOD_INPUTS`, and nothing it does not declare (no LM head where no loss reads it).

A provider reads one forget micro-batch (`ForgetPass`): the model, the batch, the method and its params, the run's
`chunk_size` and `hidden_layer`. θ's pass on the forget answer runs once, when the first input that reads it asks.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch

from pipeline.training.forward import next_token_logp, next_token_values, run_decoder
from pipeline.training.methods.base import ForwardOut, Method

# θ_o at each scored token, stage one's (a method with `teacher`, UNDIAL): read by its from_logits after the tokens
TEACHER_KEYS = ("teacher_ids", "teacher_logp", "teacher_tail", "ref_logp")


@dataclass
class ForgetPass:
    """One forget micro-batch, as the providers read it."""

    net: Any              # the Hugging Face model (pipeline.training.forward.inner_model)
    batch: dict           # the forget micro-batch
    method: Method
    params: Any           # the method's hyper-parameters
    chunk_size: int       # positions per LM-head chunk
    hidden_layer: int     # the hidden_states index of the input `hidden`

    @functools.cached_property
    def answer(self):
        """θ on the forget answer, with every layer's hidden states if the method reads them."""
        return run_decoder(self.net, self.batch, output_hidden_states="hidden" in self.method.inputs)

    @functools.cached_property
    def scored(self) -> torch.Tensor:
        return self.batch["scored"] > 0


def _logp(at: ForgetPass) -> torch.Tensor:
    return next_token_logp(at.net, at.answer.last_hidden_state, at.batch["input_ids"], at.scored, at.chunk_size)


def _hidden(at: ForgetPass) -> torch.Tensor:
    return at.answer.hidden_states[at.hidden_layer]


def _from_logits(at: ForgetPass) -> torch.Tensor:
    teacher = [at.batch[k] for k in TEACHER_KEYS] if at.method.teacher else []
    return next_token_values(functools.partial(at.method.from_logits, params=at.params), at.net,
                             at.answer.last_hidden_state, at.batch["input_ids"], at.scored, at.chunk_size, *teacher)


def _alternative_logp(at: ForgetPass) -> torch.Tensor:
    """θ on the answer the method prefers (or trains on), stage one's."""
    alt = at.batch["alternative"]
    return next_token_logp(at.net, run_decoder(at.net, alt).last_hidden_state, alt["input_ids"], alt["scored"] > 0,
                           at.chunk_size)


# Every input a method may declare (ForwardOut's fields). The loop computes them in this order, whatever the order
# of a method's declaration: the graph, and so the gradients' summation order, stays the same.
METHOD_INPUTS: dict[str, Callable[[ForgetPass], torch.Tensor]] = {
    "logp": _logp,
    "hidden": _hidden,
    "from_logits": _from_logits,
    "alternative_logp": _alternative_logp,
}


def method_inputs(method: Method, params, net, batch: dict, chunk_size: int, hidden_layer: int) -> ForwardOut:
    """The inputs `method` declares, on forget micro-batch `batch`; the others are None."""
    at = ForgetPass(net, batch, method, params, chunk_size, hidden_layer)
    return ForwardOut(**{name: provide(at) for name, provide in METHOD_INPUTS.items() if name in method.inputs})
