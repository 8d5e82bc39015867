"""The evaluator interface: one benchmark (`evaluation/benchmarks/`) or attack (`evaluation/attacks/`) run on one
loaded model. `evaluate.evaluate_model` loads the inputs and the model once, runs the evaluators the params name in
`EVALUATORS`' order, checks every key they wrote against the metrics registry and writes the output directory
atomically.

An evaluator never writes into another's summary: it returns its part (`Part`), which is merged in order, and the
files it owns. What one leaves for a later one (TOFU's forget truth ratios for membership inference's item columns,
forget quality for open-unlearning's layout) goes through `Context.found`, and the TOFU items, to which the attacks
add per-item columns, through `Context.items`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from pipeline.data.templates import PromptTemplate
from pipeline.evaluation.config import EvalConfig
from pipeline.evaluation.inputs import EvalInputs


@dataclass
class Context:
    """What every evaluator of one model reads, made once by `evaluate_model`."""

    cfg: EvalConfig
    inputs: EvalInputs
    model_path: str
    tokenizer: object
    template: PromptTemplate
    own_retain: bool                  # the retain model's own evaluation: privleak and forget quality against itself
    has_retain: bool                  # a retain evaluation to compare with was named (else no forget quality)
    device: torch.device
    dtype: torch.dtype
    items: dict[str, list[dict]] = field(default_factory=dict)     # TOFU set -> its per-item records
    item_meta: dict[str, dict] = field(default_factory=dict)       # TOFU set -> its items file's metadata
    found: dict = field(default_factory=dict)                      # what one evaluator leaves for a later one


@dataclass
class Part:
    """An evaluator's share of one evaluation: its summary keys in its order (a section another evaluator made, such
    as a TOFU set's, is extended, never replaced) and its files, by path in the output directory."""

    summary: dict = field(default_factory=dict)
    files: dict[str, Callable[[Path], None]] = field(default_factory=dict)


class Evaluator:
    """One benchmark or attack. `benchmark`: the registry's name of the metrics it writes."""

    name: str = ""
    benchmark: str = ""

    def enabled(self, cfg: EvalConfig) -> bool:
        """Whether the params ask for it."""
        raise NotImplementedError

    def prepare(self, ctx: Context) -> None:
        """What it needs before the model loads (a check that fails in seconds, a reference model's losses)."""

    def run(self, model, ctx: Context) -> Part:
        raise NotImplementedError


def merge(summary: dict, part: dict) -> None:
    """`part` into `summary`, in its order: a section both have is extended."""
    for key, value in part.items():
        if isinstance(value, dict) and isinstance(summary.get(key), dict):
            summary[key].update(value)
        else:
            summary[key] = value
