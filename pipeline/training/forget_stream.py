"""The forget set for stage two, streamed from the attribution shards, with this run's token weights.

The weights ω come from the shards' columns here (φ, or the attribution variant of `score`, is recomputed with
this run's α), so r, τ, mix, α and the score are stage two's params. Memory holds at most a few decoded shards,
whatever the number of shards: each epoch
visits the shards in a seeded order, in windows of `window_shards` shards, and shuffles the samples within
a window (the usual shard-then-buffer shuffle of streaming loaders). The order is a pure function of the
seed, the epoch and the manifest's row counts, so a resumed run, or N processes, see the same batches.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from pipeline.attribution.shards import alternative_columns, check_shards, column_types, read_manifest
from pipeline.attribution.teacher import LOGP_TOLERANCE as TEACHER_TOLERANCE, TEACHER_COLUMNS
from pipeline.attribution.variants import draw, parse_score, require_columns, score_columns, variant_score
from pipeline.attribution.weights import check_focus, check_mix, token_weights
from pipeline.common.errors import DataError, ParamError
from pipeline.common.modeling import model_hash, tokenizer_hash

COLUMNS = ["sample_id", "input_ids", "scored", "delta", "entropy", "logp_orig"]
LOGP_TOLERANCE = 1e-4  # a log-probability above this is no probability (rounding allows a little above 0)


@dataclass
class ForgetSample:
    sample_id: int
    input_ids: np.ndarray   # int64
    scored: np.ndarray      # bool, the answer tokens (and EOS) that attribution scored
    weights: np.ndarray     # ω, full length, 0 where not scored
    ref_logp: np.ndarray    # log p_θo(s_i | s_<i) from the shards, 0 where not scored
    phi: np.ndarray         # φ, NaN where not scored
    alternative: "AlternativeSample | None" = None  # the answer a preference method prefers (or IdkNLL trains on)
    teacher: tuple | None = None  # θ_o's top-k at the scored tokens (UNDIAL): ids [n, k], log-probs [n, k], tail [n]


@dataclass
class AlternativeSample:
    """One alternative answer of a forget sample (the stream's `alternative` kind), from the shards."""

    input_ids: np.ndarray   # int64: the prompt, this answer and its end
    scored: np.ndarray      # bool, its answer tokens (and EOS)
    ref_logp: float         # θ_o's Σ log p over its scored tokens (stage one's)


USES = {"uniform": (), "hard": ("r", "alpha", "score"), "soft": ("tau", "alpha", "score"),  # what each reads
        "proportional": ("alpha", "score")}


@dataclass(frozen=True)
class Weighting:
    strategy: str = "uniform"   # uniform | hard | soft
    r: float = 0.2
    tau: float = 0.5
    alpha: float = 0.7
    score: str = "phi"          # the attribution variant (pipeline/attribution/variants.py): phi is the paper's
    mix: float = 0.0            # hard, soft: the share of each sample's push spread evenly over its scored tokens
    focus: str = "all"          # hard, soft: all | first (each selected stretch's weight on its first token)

    def __post_init__(self):
        parse_score(self.score)
        if check_mix(self.mix) != 0.0 and self.strategy == "uniform":
            raise ParamError(f"mix={self.mix!r}: the uniform weighting spreads the push evenly already; mix is for "
                             f"hard and soft weights")
        if check_focus(self.focus) != "all" and self.strategy == "uniform":
            raise ParamError(f"focus={self.focus!r}: uniform weights select no stretch of the answer; focus is for "
                             f"hard and soft weights")

    def used(self) -> dict:
        """The parameters these weights depend on (uniform ones depend on none of r, τ, α, the score). mix is named
        only where it is not 0: weights without it are named (in the weights' file, in a run's fingerprint) as
        before mix existed, so such a run's outputs stay byte-identical."""
        used = {"weighting": self.strategy, **{name: getattr(self, name) for name in USES[self.strategy]}}
        if self.mix != 0.0:
            used["mix"] = self.mix
        if self.focus != "all":  # likewise
            used["focus"] = self.focus
        return used

    @property
    def columns(self) -> tuple[str, ...]:
        """The shard columns the score reads besides delta and entropy (none for uniform weights)."""
        return score_columns(self.score) if self.strategy != "uniform" else ()

    def sample(self, sample_id, input_ids, scored, columns: dict, logp_orig, seed: int = 0) -> ForgetSample:
        """`columns`: delta, entropy and the score's columns, full length; `seed`: the unlearning seed, which a drawn
        score (the random control) draws from. Uniform weights read no score: their recorded φ is the paper's."""
        score = self.score if self.strategy != "uniform" else "phi"
        restricted = {k: v[scored] for k, v in columns.items()}
        restricted.update(draw(score, seed, sample_id, int(np.count_nonzero(scored))))
        phi_scored = variant_score(score, restricted, self.alpha)
        weights = np.zeros(len(scored))
        weights[scored] = token_weights(self.strategy, phi_scored, r=self.r, tau=self.tau, mix=self.mix,
                                        focus=self.focus)
        phi = np.full(len(scored), np.nan)
        phi[scored] = phi_scored
        return ForgetSample(sample_id, input_ids, scored, weights, np.nan_to_num(logp_orig, nan=0.0), phi)


def _list_column(table: pa.Table, name: str, dtype) -> tuple[np.ndarray, np.ndarray]:
    """A list column as (flat values, offsets): rows are slices, without a Python object per token."""
    column = table.column(name).combine_chunks()
    return column.values.to_numpy(zero_copy_only=False).astype(dtype, copy=False), column.offsets.to_numpy()


class ForgetStream:
    """Forget samples by global row id (shard order), decoded shard by shard into a small LRU cache."""

    def __init__(self, shard_dir: str | Path, weighting: Weighting, seed: int = 0, window_shards: int = 4,
                 alternative: str | None = None, method: str = "", teacher: bool = False):
        """`alternative`: also read each sample's alternative answer of this kind (`attribution.alternatives`),
        for `method`, which trains on it. `teacher`: also read θ_o's top-k at each scored token
        (`attribution.teacher_top_k`), which `method` distils from."""
        if window_shards < 1:
            raise ParamError(f"window_shards={window_shards}: must be at least 1")
        self.shard_dir, self.weighting, self.seed, self.window = Path(shard_dir), weighting, seed, window_shards
        self.alternative = alternative
        self.teacher_k: int | None = None  # the teacher's k, where it is read
        self.manifest = read_manifest(self.shard_dir)  # checks every shard's sha256 once
        shards = self.manifest["shards"]
        self.files = [self.shard_dir / s["name"] for s in shards]
        self.starts = np.concatenate([[0], np.cumsum([s["rows"] for s in shards])]).astype(np.int64)
        self.n_samples = int(self.starts[-1])
        if self.n_samples == 0:
            raise DataError(f"{self.shard_dir}: the attribution shards hold no sample")
        self._cache: OrderedDict[int, list[ForgetSample]] = OrderedDict()
        self.cache_size = 2 * window_shards  # a batch may straddle two windows
        self.decoded_shards = 0               # counts decodes (tests and the benchmark read it)
        self.vocab_size: int | None = None    # the model's, once `check_source` has seen it: token ids are below it
        self.check_shards(COLUMNS)  # readable, the manifest's row counts, the columns every weighting reads
        self.check_columns()        # the score's own: a missing one names the signal that computes it
        self.check_shards([c for c in self.weighting.columns if c not in COLUMNS])
        if alternative is not None:
            self.check_alternative(method)
            self.check_shards(list(alternative_columns(alternative)))
        if teacher:
            self.check_teacher(method)
            self.check_shards(list(TEACHER_COLUMNS))

    def __len__(self) -> int:
        return self.n_samples

    def check_source(self, model, model_path: str, tokenizer) -> None:
        """Refuse shards made by another model or tokenizer, naming the field that differs."""
        meta = self.manifest["metadata"]
        for name, ours in (("model_hash", model_hash(model, model_path)),
                           ("tokenizer_hash", tokenizer_hash(tokenizer))):
            if meta.get(name) != ours:
                raise DataError(
                    f"{self.shard_dir}: shards were made with {name}={meta.get(name)} (model {meta.get('model')!r}), "
                    f"but {model_path!r} has {name}={ours}; rerun `attribute` with this model"
                )
        weight = model.get_input_embeddings().weight
        self.vocab_size = int(getattr(weight, "ds_shape", weight.shape)[0])  # under ZeRO-3 a partition is loaded

    def check_columns(self) -> None:
        """Refuse a score whose columns the shards lack, naming the signal stage one must compute."""
        if self.weighting.columns:  # uniform weights read no score
            require_columns(self.weighting.score, set(pq.ParquetFile(self.files[0]).schema_arrow.names),
                            self.shard_dir)

    def check_alternative(self, method: str) -> None:
        """Refuse shards that stage one wrote without the alternative answers `method` trains on, naming the
        param that adds them."""
        have = self.manifest["metadata"].get("alternatives", [])
        if self.alternative not in have:
            raise ParamError(
                f"{self.shard_dir}: method {method or '?'} trains on each forget sample's {self.alternative} answer, "
                f"with θ_o's log-likelihood of it from stage one, and these shards hold "
                f"{'only ' + ', '.join(have) if have else 'no alternative answers'}: add {self.alternative} to "
                f"attribution.alternatives (e.g. attribution.alternatives: [idk, perturbed]) and rerun `attribute`")

    def check_teacher(self, method: str) -> None:
        """Refuse shards that stage one wrote without θ_o's top-k (the teacher `method` distils from), naming the
        param that adds it."""
        k = self.manifest["metadata"].get("teacher_top_k")
        if not (isinstance(k, int) and not isinstance(k, bool) and k > 0):
            raise ParamError(
                f"{self.shard_dir}: method {method or '?'} distils from θ_o's next-token distribution at each forget "
                f"answer token, kept by stage one, and these shards hold none: set attribution.teacher_top_k (e.g. "
                f"attribution.teacher_top_k: 32) and rerun `attribute`")
        self.teacher_k = k

    def check_shards(self, columns: list[str]) -> None:
        """Every shard, before any is used: readable, the manifest's row count, and `columns` with their types (a
        hand-made or foreign shard would otherwise fail mid-training with a traceback, or train on garbage)."""
        hint = "; rerun `attribute`"
        if self.manifest["metadata"].get("kind") == "retain_reference":  # the other stage's directory
            hint = (f" ({self.shard_dir} is a reference cache, not attribution shards: pass `tokenunlearn "
                    "attribute`'s output, e.g. artifacts/attribution)")
        check_shards(self.shard_dir, self.manifest, column_types(columns), hint)

    def _decode(self, shard: int) -> list[ForgetSample]:
        file = self.files[shard]
        extra = [c for c in self.weighting.columns if c not in COLUMNS]
        alt_columns = list(alternative_columns(self.alternative)) if self.alternative else []
        teacher_columns = list(TEACHER_COLUMNS) if self.teacher_k else []
        table = pq.read_table(file, columns=COLUMNS + extra + alt_columns + teacher_columns)
        if table.num_rows != self.starts[shard + 1] - self.starts[shard]:
            expected = self.starts[shard + 1] - self.starts[shard]
            raise DataError(f"{file}: {table.num_rows} rows, the manifest says {expected}")
        ids, off = _list_column(table, "input_ids", np.int64)
        scored, _ = _list_column(table, "scored", bool)
        delta, _ = _list_column(table, "delta", np.float64)
        entropy, _ = _list_column(table, "entropy", np.float64)
        logp, _ = _list_column(table, "logp_orig", np.float64)
        columns = {"delta": delta, "entropy": entropy, "logp_orig": logp,
                   **{c: _list_column(table, c, np.float64)[0] for c in extra}}
        sample_ids = table.column("sample_id").to_pylist()
        self.check_values(file, sample_ids, ids, off, scored, columns, table)
        alternatives = self._alternatives(file, table, sample_ids) if self.alternative else None
        teachers = self._teachers(file, table, sample_ids, scored, off) if self.teacher_k else None
        out = []
        for row, sample_id in enumerate(sample_ids):
            s = slice(off[row], off[row + 1])
            if not scored[s].any():
                raise DataError(f"{file}: sample {sample_id} has no scored token")
            out.append(self.weighting.sample(sample_id, ids[s], scored[s], {k: v[s] for k, v in columns.items()},
                                             logp[s], self.seed))
            if alternatives is not None:
                out[-1].alternative = alternatives[row]
            if teachers is not None:
                out[-1].teacher = teachers[row]
        self.decoded_shards += 1
        return out

    def check_values(self, file: Path, sample_ids: list, ids: np.ndarray, off: np.ndarray, scored: np.ndarray,
                     columns: dict, table: pa.Table) -> None:
        """A decoded shard's values, before they are trained on: every list as long as the sample, token ids in
        the vocabulary, finite scores and log-probabilities at scored tokens (NaN is expected only elsewhere),
        no log-probability above 0."""
        for name in ["scored", *columns]:
            lengths = np.diff(table.column(name).combine_chunks().offsets.to_numpy())
            bad = np.flatnonzero(lengths != np.diff(off))
            if bad.size:
                row = int(bad[0])
                raise DataError(f"{file}: column '{name}' of sample {sample_ids[row]} has {lengths[row]} values for "
                                f"{off[row + 1] - off[row]} tokens: rerun `attribute`")

        def where(bad: np.ndarray) -> str:
            row = int(np.searchsorted(off, bad[0], side="right")) - 1
            return f"sample {sample_ids[row]}, position {bad[0] - off[row]}; {bad.size} such values"

        high = self.id_limit
        bad = np.flatnonzero((ids < 0) | (ids >= high))
        if bad.size:
            limit = f"the model's vocabulary (0..{high - 1})" if self.vocab_size is not None else "0 or more"
            raise DataError(f"{file}: token id {ids[bad[0]]} is not in {limit} ({where(bad)}): the shards were made "
                            "with another tokenizer, or are corrupt; rerun `attribute`")
        for name, values in columns.items():
            bad = np.flatnonzero(scored & ~np.isfinite(values))
            if bad.size:
                kind = "NaN" if np.isnan(values[bad[0]]) else "inf"
                raise DataError(f"{file}: column '{name}' holds {kind} at a scored token ({where(bad)}): "
                                "rerun `attribute`")
        bad = np.flatnonzero(scored & (columns["logp_orig"] > LOGP_TOLERANCE))
        if bad.size:
            raise DataError(f"{file}: column 'logp_orig' holds {columns['logp_orig'][bad[0]]:g}, a log-probability "
                            f"above 0 ({where(bad)}): rerun `attribute`")

    @property
    def id_limit(self) -> int:
        """Token ids must be below this: the model's vocabulary size once `check_source` has seen it."""
        return self.vocab_size if self.vocab_size is not None else np.iinfo(np.int64).max

    def check_ids(self, what: str, ids: np.ndarray) -> None:
        """The token ids of one alternative answer or teacher are in the model's vocabulary."""
        if ((ids < 0) | (ids >= self.id_limit)).any():
            raise DataError(f"{what} holds a token id outside the model's vocabulary: the shards were made with "
                            "another tokenizer, or are corrupt; rerun `attribute`")

    def _alternatives(self, file: Path, table: pa.Table, sample_ids: list) -> list[AlternativeSample]:
        """Each row's alternative answer, checked as the forget answers are: lists as long as the sample, token
        ids in the vocabulary, a scored token, a finite log-likelihood not above 0."""
        kind = self.alternative
        ids, off = _list_column(table, f"{kind}_ids", np.int64)
        scored, scored_off = _list_column(table, f"{kind}_scored", bool)
        logp = table.column(f"{kind}_logp").to_numpy(zero_copy_only=False).astype(np.float64)
        out = []
        for row, sample_id in enumerate(sample_ids):
            s = slice(off[row], off[row + 1])
            what = f"{file}: the {kind} answer of sample {sample_id}"
            if not np.array_equal(np.diff(off[row:row + 2]), np.diff(scored_off[row:row + 2])):
                raise DataError(f"{what}: {kind}_scored and {kind}_ids differ in length; rerun `attribute`")
            if not scored[s].any():
                raise DataError(f"{what} has no scored token; rerun `attribute`")
            self.check_ids(what, ids[s])
            if not np.isfinite(logp[row]) or logp[row] > LOGP_TOLERANCE * scored[s].sum():
                raise DataError(f"{what}: {kind}_logp is {logp[row]:g}, not a log-likelihood; rerun `attribute`")
            out.append(AlternativeSample(ids[s], scored[s], float(logp[row])))
        return out

    def _teachers(self, file: Path, table: pa.Table, sample_ids: list, scored: np.ndarray,
                  off: np.ndarray) -> list[tuple]:
        """Each row's teacher (ids [n, k], log-probs [n, k], tail [n] over its n scored tokens), checked: k values
        per scored token, ids in the vocabulary, finite log-probabilities not above 0."""
        k = self.teacher_k
        ids, ids_off = _list_column(table, "teacher_ids", np.int64)
        logp, logp_off = _list_column(table, "teacher_logp", np.float64)
        tail, tail_off = _list_column(table, "teacher_tail", np.float64)
        out = []
        for row, sample_id in enumerate(sample_ids):
            n = int(scored[off[row]:off[row + 1]].sum())
            what = f"{file}: the teacher of sample {sample_id}"
            sizes = tuple(int(o[row + 1] - o[row]) for o in (ids_off, logp_off, tail_off))
            if sizes != (n * k, n * k, n):
                raise DataError(f"{what}: {sizes[0]} ids, {sizes[1]} log-probabilities and {sizes[2]} tails for {n} "
                                f"scored tokens with teacher_top_k {k}; rerun `attribute`")
            i = ids[ids_off[row]:ids_off[row + 1]].reshape(n, k)
            lp = logp[logp_off[row]:logp_off[row + 1]].reshape(n, k)
            t = tail[tail_off[row]:tail_off[row + 1]]
            self.check_ids(what, i)
            if not (np.isfinite(lp).all() and np.isfinite(t).all()) or (lp > TEACHER_TOLERANCE).any() or \
                    (t > TEACHER_TOLERANCE).any():
                raise DataError(f"{what} holds a log-probability that is not finite or above 0; rerun `attribute`")
            out.append((i, lp, t))
        return out

    def _shard(self, shard: int) -> list[ForgetSample]:
        if shard in self._cache:
            self._cache.move_to_end(shard)
        else:
            self._cache[shard] = self._decode(shard)
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return self._cache[shard]

    def get(self, row_ids) -> list[ForgetSample]:
        out = []
        for i in row_ids:
            shard = int(np.searchsorted(self.starts, i, side="right")) - 1
            out.append(self._shard(shard)[i - self.starts[shard]])
        return out

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """Global row ids in this epoch's order: shards permuted, samples shuffled within windows of shards."""
        rng = np.random.default_rng([self.seed, epoch])
        shards = rng.permutation(len(self.files))
        order = []
        for w in range(0, len(shards), self.window):
            rows = np.concatenate([np.arange(self.starts[s], self.starts[s + 1]) for s in shards[w:w + self.window]])
            order.append(rng.permutation(rows))
        return torch.from_numpy(np.concatenate(order))

    def __iter__(self) -> Iterator[ForgetSample]:
        """Every sample in shard order, one shard in memory at a time (bypasses the cache)."""
        for shard in range(len(self.files)):
            yield from self._decode(shard)
