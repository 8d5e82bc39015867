"""The forget stream's samples as what the loop trains on: padded micro-batches (with the alternative answers and
θ_o's top-k where a method reads them), and the token weights a run used, written as Parquet beside its model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from pipeline.common.atomic import atomic_file
from pipeline.training.forget_stream import AlternativeSample, ForgetSample, ForgetStream


def forget_batch(samples: list[ForgetSample], pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(s.input_ids) for s in samples)
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(samples), width), dtype=torch.long)
    weights, ref, scored = (torch.zeros((len(samples), width)) for _ in range(3))
    for b, s in enumerate(samples):
        n = len(s.input_ids)
        ids[b, :n] = torch.from_numpy(s.input_ids)
        attention[b, :n] = 1
        weights[b, :n] = torch.from_numpy(s.weights)
        ref[b, :n] = torch.from_numpy(s.ref_logp)
        scored[b, :n] = torch.from_numpy(s.scored)
    batch = {"input_ids": ids, "attention_mask": attention, "weights": weights, "ref_logp": ref, "scored": scored}
    if samples[0].alternative is not None:
        batch["alternative"] = alternative_batch([s.alternative for s in samples], pad_id)
    if samples[0].teacher is not None:
        batch.update(teacher_batch(samples, width))
    return batch


def teacher_batch(samples: list[ForgetSample], width: int) -> dict[str, torch.Tensor]:
    """θ_o's top-k at each scored token of a forget micro-batch, at the token's position (UNDIAL's teacher):
    `teacher_ids` [B, T, k], `teacher_logp` [B, T, k], `teacher_tail` [B, T]; 0 where a token is not scored."""
    k = samples[0].teacher[0].shape[1]
    ids = torch.zeros((len(samples), width, k), dtype=torch.long)
    logp = torch.zeros((len(samples), width, k))
    tail = torch.zeros((len(samples), width))
    for b, s in enumerate(samples):
        at = torch.from_numpy(np.flatnonzero(s.scored))
        ids[b, at] = torch.from_numpy(s.teacher[0])
        logp[b, at] = torch.from_numpy(s.teacher[1]).float()
        tail[b, at] = torch.from_numpy(s.teacher[2]).float()
    return {"teacher_ids": ids, "teacher_logp": logp, "teacher_tail": tail}


def alternative_batch(samples: list[AlternativeSample], pad_id: int) -> dict[str, torch.Tensor]:
    """The alternative answers of a forget micro-batch, padded like it, with θ_o's log-likelihood of each [B]."""
    width = max(len(s.input_ids) for s in samples)
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(samples), width), dtype=torch.long)
    scored = torch.zeros((len(samples), width))
    for b, s in enumerate(samples):
        n = len(s.input_ids)
        ids[b, :n] = torch.from_numpy(s.input_ids)
        attention[b, :n] = 1
        scored[b, :n] = torch.from_numpy(s.scored)
    return {"input_ids": ids, "attention_mask": attention, "scored": scored,
            "ref_logp": torch.tensor([s.ref_logp for s in samples])}


WEIGHTS_SCHEMA = pa.schema([
    ("sample_id", pa.int64()), ("input_ids", pa.list_(pa.int32())), ("scored", pa.list_(pa.bool_())),
    ("phi", pa.list_(pa.float32())), ("weight", pa.list_(pa.float32())),
])


def write_token_weights(stream: ForgetStream, path: Path) -> None:
    """The weights a run used, per token, for inspection: one row group per shard, written atomically. Its
    metadata names only the parameters the weights depend on, so a new τ leaves a hard or uniform run's
    output, and what DVC runs after it, unchanged."""
    schema = WEIGHTS_SCHEMA.with_metadata({b"tokenunlearn": json.dumps(stream.weighting.used()).encode()})
    with atomic_file(path, "wb") as f, pq.ParquetWriter(f, schema, compression="zstd") as writer:
        for shard in range(len(stream.files)):
            samples = stream._decode(shard)
            writer.write_table(pa.table({
                "sample_id": [s.sample_id for s in samples],
                "input_ids": [s.input_ids.tolist() for s in samples],
                "scored": [s.scored.tolist() for s in samples],
                "phi": [s.phi.tolist() for s in samples],
                "weight": [s.weights.tolist() for s in samples],
            }, schema=schema))
