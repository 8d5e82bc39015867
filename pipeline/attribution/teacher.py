"""θ_o's next-token distribution at each scored token of a forget sample, kept by stage one for a method that
distils from it (UNDIAL, `pipeline.training.methods.undial`), so stage two holds no reference model
(`attribution.teacher_top_k`; 0, the default: not kept, the shards as without it).

Per scored token, from the logits `score_batch` computes `logp_orig` from, the teacher is kept as the reference cache
keeps θ_o on retain data (`pipeline.attribution.reference`): the top-k token ids and their log-probabilities, and
one tail bucket, the log of the mass of every other token **except the true token** s_i. The true token's own
log-probability is `logp_orig`, already in the shards, so the teacher is known exactly on the top-k tokens and s_i
(whether or not s_i is among the top k), and as one bucket for the rest. With k ≥ the vocabulary the tail is empty
and the teacher exact.

Columns (lists over the sample's scored tokens, in order; `TEACHER_COLUMNS`): `teacher_ids` and `teacher_logp`,
k values per scored token (flattened, n_scored·k), and `teacher_tail`, one per scored token.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch

from pipeline.common.errors import DataError
from pipeline.common.numerics import LOG_TAIL_FLOOR

TEACHER_COLUMNS = {"teacher_ids": pa.list_(pa.int32()),      # θ_o's top-k token ids, k per scored token
                   "teacher_logp": pa.list_(pa.float32()),   # their log-probabilities, k per scored token
                   "teacher_tail": pa.list_(pa.float32())}   # log of the mass outside the top-k and the true token
LOGP_TOLERANCE = 1e-4  # a log-probability above this is no probability (rounding allows a little above 0)


def teacher_topk(logits: torch.Tensor, targets: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                             torch.Tensor]:
    """θ_o's top-k token ids [N, k] and log-probabilities [N, k], and the log of the mass of all tokens but those
    and the target [N] (at least LOG_TAIL_FLOOR): logits [N, vocab], targets [N]."""
    logp = torch.log_softmax(logits.float(), -1)
    top_logp, top_ids = logp.topk(min(k, logp.size(-1)), dim=-1)
    return top_ids.int(), top_logp, rest_logmass(logp, top_ids, targets)


def rest_logmass(logp: torch.Tensor, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log Σ p(v) over the tokens v that are neither in `ids` [N, k] nor the target [N], at least LOG_TAIL_FLOOR:
    summed over those tokens (no 1 − Σ, which loses the small tail to rounding), logp [N, vocab] -> [N]."""
    rest = logp.scatter(-1, ids.long(), float("-inf")).scatter(-1, targets.long()[:, None], float("-inf"))
    return torch.logsumexp(rest, -1).clamp(min=LOG_TAIL_FLOOR)


def teacher_row(teacher: tuple, sample_id: int, model: str) -> dict:
    """A shard row's teacher columns from `Signals.teacher` (refusing non-finite values, as the other signals)."""
    ids, logp, tail = teacher
    if not (np.isfinite(logp).all() and np.isfinite(tail).all()):
        raise DataError(f"model '{model}': non-finite teacher log-probabilities for sample {sample_id} (its weights "
                        "may hold NaN or inf); nothing was written")
    return {"teacher_ids": ids.reshape(-1).tolist(), "teacher_logp": logp.reshape(-1).tolist(),
            "teacher_tail": tail.tolist()}
