"""Batches: padding collation, and a step-indexed sample schedule.

The schedule is a pure function of (step, rank): a run resumed at step k sees exactly the batches an
uninterrupted run sees, and N processes see together the samples one process sees, in the same steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from pipeline.common.errors import ParamError
from pipeline.data.templates import IGNORE_INDEX, EncodedSample


def pad_batch(samples: Sequence[EncodedSample], pad_id: int, left: bool = False) -> dict[str, torch.Tensor]:
    """Pad input ids (with `pad_id`), attention mask and labels (with -100) to the longest sample."""
    width = max(len(s) for s in samples)
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(samples), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(samples), width), dtype=torch.long)
    for row, s in enumerate(samples):
        n = len(s)
        cols = slice(width - n, width) if left else slice(0, n)
        ids[row, cols] = torch.tensor(s.input_ids)
        labels[row, cols] = torch.tensor(s.labels)
        mask[row, cols] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@dataclass(frozen=True)
class StepSchedule:
    """Which samples each rank's micro-batches hold at each optimizer step.

    Each epoch is a fresh seeded permutation (or `order(epoch)`, e.g. a streaming reader's shard-window
    shuffle); the last step of an epoch wraps to the order's start, so every sample is seen once per epoch
    and every batch is full.
    """

    n_samples: int
    micro_batch_size: int
    grad_accum: int
    world_size: int
    seed: int
    order: Callable[[int], torch.Tensor] | None = field(default=None, compare=False)

    def __post_init__(self):
        if self.n_samples < 1:
            raise ParamError("no training samples")
        if min(self.micro_batch_size, self.grad_accum, self.world_size) < 1:
            raise ParamError("micro_batch_size, grad_accum and the number of processes must be at least 1")

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.grad_accum * self.world_size

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.n_samples / self.global_batch)

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if self.order is not None:
            perm = self.order(epoch)
        else:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            perm = torch.randperm(self.n_samples, generator=g)
        reps = math.ceil(self.steps_per_epoch * self.global_batch / self.n_samples)
        return perm.repeat(reps)

    def micro_batches(self, step: int, rank: int) -> list[list[int]]:
        """The `grad_accum` lists of sample indices that `rank` processes at optimizer step `step` (0-based)."""
        epoch, within = divmod(step, self.steps_per_epoch)
        chunk = self._epoch_order(epoch)[within * self.global_batch : (within + 1) * self.global_batch]
        # [accum, world, micro]: a single process with accum*world micro-batches sees the same micro-batches.
        grid = chunk.view(self.grad_accum, self.world_size, self.micro_batch_size)
        return [grid[k, rank].tolist() for k in range(self.grad_accum)]
