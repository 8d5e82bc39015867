"""Evaluation during unlearning: the monitor's hook in the training loop (`Watch`).

The monitor is stage three's (pipeline.evaluation.monitor, handed in by the stage: training does not import
evaluation). It gives `every`, `selects`, `evaluate(model, step) -> row` and `keep(row) -> bool`.
"""

from __future__ import annotations

from typing import Callable

from pipeline.common.errors import ParamError
from pipeline.training.engine import Engine, TrainConfig
from pipeline.training.forward import inner_model

# A monitor factory: called with the tokenizer, a new monitor for one seed; its `selection` is what a selection rule
# makes the written weights depend on (None without a rule), part of each seed's fingerprint.
MonitorFactory = Callable[[object], object]
EVAL_PREFIX = "eval_"  # a monitor row's metrics, in the history rows of the steps it evaluated


class Watch:
    """One seed's monitor in the training loop: step 0 (θ_o) before the first step, then every `every` steps and
    after the last; the weights of the step its rule keeps, copied to CPU memory."""

    def __init__(self, monitor, engine: Engine, total_steps: int, train: TrainConfig):
        if monitor.selects and train.checkpoint_every:
            raise ParamError("unlearn.monitor.select: the kept weights are held in memory, so a run resumed from a "
                             "checkpoint could not restore them; set the run's train.checkpoint_every to 0")
        self.monitor, self.engine, self.total_steps = monitor, engine, total_steps
        self.selected: tuple[int, dict] | None = None  # (step, state dict) the rule keeps
        self.first = self._evaluate(0)  # the weights before any step (also when a checkpoint is resumed)

    def _evaluate(self, step: int) -> dict:
        row = self.monitor.evaluate(inner_model(self.engine.engine), step)
        if self.monitor.keep(row):
            state = self.engine.full_state_dict()
            self.selected = (step, {k: v.detach().cpu().clone() for k, v in state.items()} if state else None)
        return row

    def on_step(self, step: int, row: dict | None = None) -> dict | None:
        if step % self.monitor.every and step != self.total_steps:
            return None
        return {k: v for k, v in self._evaluate(step).items() if k != "step"}

    def rows(self, history: list[dict]) -> list[dict]:
        """The monitor's rows, step 0 first: what the DVC plot shows."""
        later = [{"step": r["step"], **{k: v for k, v in r.items() if k.startswith(EVAL_PREFIX)}}
                 for r in history if any(k.startswith(EVAL_PREFIX) for k in r)]
        return [self.first] + later
