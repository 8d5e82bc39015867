"""Synthetic attribution shards in the real format (ShardWriter and manifest), for tests and benchmarks."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.attribution.shards import ShardWriter, write_manifest


def write_synthetic_shards(out_dir: Path, n_samples: int, rows_per_shard: int, length: int = 48,
                           vocab: int = 400, seed: int = 0, metadata: dict | None = None) -> Path:
    """`n_samples` rows of `length` tokens whose last 60% are scored, with random Δ, H and log-probs."""
    rng = np.random.default_rng(seed)
    out_dir.mkdir(parents=True)
    writer = ShardWriter(out_dir, "part", rows_per_shard, metadata or {})
    for i in range(n_samples):
        scored = (np.arange(length) >= int(0.4 * length)).tolist()
        signal = [float(v) if s else float("nan") for v, s in zip(rng.random(length), scored)]
        writer.add({
            "sample_id": i, "split": "forget", "text": "", "input_ids": rng.integers(5, vocab, length).tolist(),
            "positions": list(range(length)), "token_start": [0] * length, "token_end": [0] * length,
            "scored": scored, "masked": [False] * length, "logp_orig": [-3 * v for v in signal],
            "logp_mask": signal, "delta": signal, "entropy": [v * 2 for v in signal], "phi": signal, "fact": None,
        })
    write_manifest(out_dir, writer.close(), metadata or {}, {})
    return out_dir
