"""Attribution quality against ground truth: how well each sample's top-r tokens find its fact tokens, where the
data marks them (the embedded world's annotations)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.attribution.shards import iter_rows
from pipeline.attribution.signals import attribution_score
from pipeline.attribution.weights import hard_weights


def topr_counts(score: np.ndarray, fact: np.ndarray, r: float) -> np.ndarray:
    """(selected, selected that are facts, facts) for the top-r fraction of one sample's scored tokens."""
    chosen = hard_weights(score, r=r).astype(bool)
    return np.array([chosen.sum(), (chosen & fact).sum(), fact.sum()], dtype=np.float64)


def attribution_quality(shard_dir: Path, rs: list[float], seed: int = 0) -> dict | None:
    """Precision and recall of each sample's top-r tokens against its fact tokens (micro-averaged), for φ
    (α = 0.7), Δ alone (α = 1), H alone (α = 0) and a random choice. None where the data has no fact spans."""
    rng = np.random.default_rng(seed)
    scorers = {
        "phi": lambda d, h: attribution_score(d, h, 0.7),
        "delta": lambda d, h: attribution_score(d, h, 1.0),
        "entropy": lambda d, h: attribution_score(d, h, 0.0),
        "random": lambda d, h: rng.random(len(d)),
    }
    counts = {(r, name): np.zeros(3) for r in rs for name in scorers}  # selected, hits, facts
    fact_tokens = scored_tokens = 0
    for row in iter_rows(shard_dir, columns=["scored", "delta", "entropy", "fact"], verify=False):
        if row["fact"] is None:
            return None
        scored = np.array(row["scored"])
        d, h = np.array(row["delta"])[scored], np.array(row["entropy"])[scored]
        fact = np.array(row["fact"])[scored]
        fact_tokens, scored_tokens = fact_tokens + fact.sum(), scored_tokens + len(fact)
        for name, scorer in scorers.items():
            score = scorer(d, h)
            for r in rs:
                counts[(r, name)] += topr_counts(score, fact, r)
    out: dict = {"fact_token_share": float(fact_tokens / max(scored_tokens, 1))}
    for (r, name), (selected, hits, facts) in counts.items():
        out.setdefault(f"r={r}", {})[name] = {"precision": float(hits / max(selected, 1)),
                                              "recall": float(hits / max(facts, 1))}
    return out
