"""Stage one's sibling over the retain data: what the retain term needs from θ_o, computed once and cached, so that
stage two never holds a second model.

For each retain sample (exactly the samples stage two builds: `pipeline.data.config.retain_samples`), at every
position whose next token is labelled (a retain answer token and its EOS; every token of a retain passage), θ_o's
next-token distribution as its `top_k` token ids and log-probabilities and the log of the remaining mass (the KL
term: `pipeline.training.losses.topk_kl_from_logits`), and θ_o's hidden states at `layers` (RMU's activation
matching). Parquet shards and a manifest written last, as the attribution shards are; one row per sample:

    sample_id, input_ids           the sample (stage two refuses a cache whose ids differ from its retain data)
    positions                      the positions p whose next token p + 1 is labelled (P of them)
    topk_ids, topk_logp            P·k values, position-major
    tail_logp                      P values: log(1 − Σ top-k p)
    act_<L>                        P·d float16 values for each layer L of `layers`
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from pipeline import __version__
from pipeline.attribution.shards import MANIFEST, ShardInfo, ShardWriter, check_shard, read_manifest, write_manifest
from pipeline.common.atomic import atomic_dir, write_json
from pipeline.common.distributed import broadcast_from_main, init_distributed, is_main_process
from pipeline.common.errors import DataError, ParamError
from pipeline.common.modeling import check_vocab, decoder, lm_head_logits, load_model, load_tokenizer, model_hash, \
    tokenizer_hash
from pipeline.common.numerics import LOG_TAIL_FLOOR, log1mexp
from pipeline.common.params import Rule, at_least, check_rules, dataclass_from_params
from pipeline.common.progress import progress
from pipeline.data.batching import pad_batch
from pipeline.data.config import DataConfig, retain_samples

log = logging.getLogger(__name__)

KIND = "retain_reference"  # the manifest's metadata kind of a reference cache
LOGP_TOLERANCE = 1e-4      # a log-probability above this is no probability (rounding allows a little above 0)
RERUN = "rerun `tokenunlearn reference`"


def topk_reference(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the cache keeps of a next-token distribution: the top-k token ids, their log-probabilities, and the log
    of the mass of all other tokens (the tail); logits [N, vocab] -> [N, k], [N, k], [N]."""
    logp = torch.log_softmax(logits.float(), -1)
    top_logp, top_ids = logp.topk(min(k, logp.size(-1)), dim=-1)
    tail = log1mexp(torch.logsumexp(top_logp.double(), -1)).float().clamp(min=LOG_TAIL_FLOOR)
    return top_ids, top_logp, tail


def cache_schema(layers: list[int]) -> pa.Schema:
    i32, f32 = pa.list_(pa.int32()), pa.list_(pa.float32())
    return pa.schema([("sample_id", pa.int64()), ("input_ids", i32), ("positions", i32), ("topk_ids", i32),
                      ("topk_logp", f32), ("tail_logp", f32),
                      *((f"act_{L}", pa.list_(pa.float16())) for L in sorted(layers))])


@dataclass(frozen=True)
class ReferenceConfig:
    model: str = "artifacts/models/target"  # θ_o: the model stage two unlearns
    split: str = "retain90"                  # the retain split (stage two's unlearn.defaults.retain_split)
    corpus: str = ""                         # or retain passages (unlearn.defaults.retain_corpus), less forget_split's
    forget_split: str = "forget10"
    top_k: int = 32                          # tokens of θ_o's next-token distribution kept per position
    layers: list = field(default_factory=list)  # hidden_states indices kept (RMU's rmu_layer, for activation matching)
    batch_size: int = 16
    chunk_size: int = 1024                   # positions per LM-head chunk
    rows_per_shard: int = 1024
    trust_remote_code: bool = False

    @classmethod
    def from_params(cls, values: dict, where: str = "reference") -> "ReferenceConfig":
        cfg = dataclass_from_params(cls, values, where)
        rules = {"top_k": at_least(1), "batch_size": at_least(1), "chunk_size": at_least(1),
                 "rows_per_shard": at_least(1),
                 "layers": Rule(lambda v: all(isinstance(x, int) and x >= 0 for x in v), "a list of layer indices")}
        check_rules(cfg, rules, where)
        return cfg


@torch.no_grad()
def reference_rows(model, samples: list, sample_ids: list[int], pad_id: int, top_k: int, layers: list[int],
                   chunk_size: int = 1024) -> list[dict]:
    """The cache's rows for one batch of retain samples (see the module's docstring)."""
    device = next(model.parameters()).device
    batch = pad_batch(samples, pad_id)
    out = decoder(model)(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device),
                         output_hidden_states=bool(layers))
    rows, cols = (batch["labels"][:, 1:] != -100).nonzero(as_tuple=True)  # p: the token at p + 1 is labelled
    hidden = out.last_hidden_state[rows.to(device), cols.to(device)]
    pieces = [topk_reference(lm_head_logits(model, hidden[i: i + chunk_size]), top_k)
              for i in range(0, len(hidden), chunk_size)]
    ids, logp, tail = (torch.cat(p).cpu() for p in zip(*pieces)) if pieces else (torch.zeros(0),) * 3
    acts = {L: out.hidden_states[L][rows.to(device), cols.to(device)].half().cpu() for L in layers}
    result = []
    for b, (sample_id, sample) in enumerate(zip(sample_ids, samples)):
        mine = rows == b
        row = {"sample_id": sample_id, "input_ids": list(sample.input_ids), "positions": cols[mine].tolist(),
               "topk_ids": ids[mine].flatten().tolist(), "topk_logp": logp[mine].flatten().tolist(),
               "tail_logp": tail[mine].tolist()}
        row.update({f"act_{L}": acts[L][mine].flatten().numpy() for L in layers})
        result.append(row)
    return result


def run_reference(cfg: ReferenceConfig, data: DataConfig, out_dir: Path, metrics_file: Path | None) -> dict:
    """Write the reference cache into `out_dir` (atomically): every process takes every world_size-th sample."""
    import torch.distributed as dist

    rank, world_size = init_distributed()
    tokenizer = load_tokenizer(cfg.model, cfg.trust_remote_code)
    samples = retain_samples(data, tokenizer, cfg.split, cfg.corpus, cfg.forget_split)  # inputs first
    device = torch.device(f"cuda:{torch.cuda.current_device()}") if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else None
    model = load_model(cfg.model, dtype=dtype, trust_remote_code=cfg.trust_remote_code).to(device).eval()
    check_vocab(model, tokenizer, cfg.model, data.max_length)
    vocab_size = model.config.vocab_size
    if cfg.top_k > vocab_size:  # else the cache is written and the first unlearn run fails on it
        raise ParamError(f"reference.top_k={cfg.top_k}: more than the {vocab_size} tokens of {cfg.model}'s "
                         f"vocabulary; at most {vocab_size}")
    n_layers = model.config.num_hidden_layers
    bad = [L for L in cfg.layers if L > n_layers]
    if bad:
        raise DataError(f"reference.layers={cfg.layers}: {cfg.model} has hidden_states 0..{n_layers}")
    metadata = {"schema_version": 1, "kind": KIND, "model": cfg.model,
                "model_hash": model_hash(model, cfg.model), "tokenizer_hash": tokenizer_hash(tokenizer),
                "template": data.template, "split": cfg.split, "corpus": cfg.corpus, "forget_split": cfg.forget_split,
                "top_k": cfg.top_k, "layers": sorted(cfg.layers), "hidden_size": model.config.hidden_size,
                "vocab_size": vocab_size, "samples_fingerprint": samples_fingerprint(samples),
                "code_version": __version__}
    mine = list(range(rank, len(samples), world_size))
    with atomic_dir(out_dir) if is_main_process() else contextlib.nullcontext() as tmp:
        tmp = Path(broadcast_from_main(str(tmp) if tmp else None))
        writer = ShardWriter(tmp, f"part-r{rank:03d}", cfg.rows_per_shard, metadata, cache_schema(cfg.layers))
        order = sorted(mine, key=lambda i: len(samples[i]))  # similar lengths together: less padding
        positions = 0
        for s in progress(range(0, len(order), cfg.batch_size), desc="reference", leave=True):
            ids = order[s: s + cfg.batch_size]
            for row in reference_rows(model, [samples[i] for i in ids], ids, tokenizer.pad_token_id, cfg.top_k,
                                      cfg.layers, cfg.chunk_size):
                positions += len(row["positions"])
                writer.add(row)
        local = {"shards": [info.__dict__ for info in writer.close()], "samples": len(mine), "positions": positions}
        gathered: list = [None] * world_size
        dist.all_gather_object(gathered, local)
        summary = {"samples": sum(g["samples"] for g in gathered), "positions": sum(g["positions"] for g in gathered),
                   "top_k": cfg.top_k, "layers": sorted(cfg.layers)}
        if is_main_process():
            write_manifest(tmp, [ShardInfo(**s) for g in gathered for s in g["shards"]], metadata, summary)
        dist.barrier()
    if is_main_process() and metrics_file is not None:
        write_json(metrics_file, summary)
    dist.barrier()
    return {**summary, "metadata": metadata}


def samples_fingerprint(samples: list) -> str:
    """A hash of the samples' token ids: stage two checks that its retain data is the cache's."""
    return hashlib.sha256(json.dumps([list(s.input_ids) for s in samples]).encode()).hexdigest()[:16]


class ReferenceCache:
    """θ_o's top-k at the retain answer positions (and its activations), per retain sample, as the tensors of a padded
    batch: read back from `run_reference`'s directory (`load`), or built in memory from the model before it is
    trained (`build`)."""

    def __init__(self, table: pa.Table, meta: dict, where: str):
        self.where, self.meta = where, meta
        table = table.sort_by("sample_id")
        self.index = {sid: i for i, sid in enumerate(table.column("sample_id").to_pylist())}
        self.k, self.layers, self.hidden = meta["top_k"], meta["layers"], meta["hidden_size"]
        self.columns = {name: _flat(table.column(name)) for name in
                        ("input_ids", "positions", "topk_ids", "topk_logp", "tail_logp",
                         *(f"act_{L}" for L in self.layers))}

    @classmethod
    def load(cls, cache_dir: str | Path) -> "ReferenceCache":
        """The cache of `run_reference`'s directory, every shard validated before use (`check_cache_metadata`,
        `check_shard`, `check_cache_values`): the retain term trusts its values, so a foreign, truncated or edited
        cache must be refused here, not trained on."""
        cache_dir = Path(cache_dir)
        hint = f"; {RERUN}"
        manifest = read_manifest(cache_dir, hint=hint)  # shard names confined to cache_dir; every shard's sha256
        meta = check_cache_metadata(manifest, cache_dir)
        schema = cache_schema(meta["layers"])
        tables = []
        for shard in manifest["shards"]:
            file = cache_dir / shard["name"]
            check_shard(file, dict(zip(schema.names, schema.types)), shard["rows"], hint)
            table = pq.read_table(file, columns=schema.names, memory_map=True)
            check_cache_values(table, meta, file)
            tables.append(table)
        table = pa.concat_tables(tables) if tables else schema.empty_table()
        samples = (manifest.get("summary") or {}).get("samples", table.num_rows)
        if samples != table.num_rows:  # a shard dropped from the manifest (and its row counts rewritten)
            raise DataError(f"{cache_dir / MANIFEST}: its shards hold {table.num_rows} samples, its summary says "
                            f"{samples}: the cache is incomplete; {RERUN}")
        ids = table.column("sample_id").to_numpy()
        if len(np.unique(ids)) != len(ids):
            raise DataError(f"{cache_dir}: sample {_first_duplicate(ids)} is in the reference cache twice; {RERUN}")
        return cls(table, meta, str(cache_dir))

    @classmethod
    def build(cls, model, samples: list, sample_ids: list[int], pad_id: int, top_k: int, layers: list[int],
              batch_size: int = 16, chunk_size: int = 1024) -> "ReferenceCache":
        """The cache of `samples[i]` for i in `sample_ids`, from `model` as it is now (θ_o, before training)."""
        was_training = model.training
        model.eval()
        rows = [row for s in range(0, len(sample_ids), batch_size)
                for row in reference_rows(model, [samples[i] for i in sample_ids[s: s + batch_size]],
                                          sample_ids[s: s + batch_size], pad_id, top_k, layers, chunk_size)]
        model.train(was_training)
        top_k = min(top_k, model.config.vocab_size)  # what topk_reference keeps: the batches' width
        meta = {"top_k": top_k, "layers": sorted(layers), "hidden_size": model.config.hidden_size}
        return cls(pa.Table.from_pylist(rows, schema=cache_schema(layers)), meta, "the run's own reference pass")

    def __len__(self) -> int:
        return len(self.index)

    def _values(self, name: str, row: int) -> np.ndarray:
        values, offsets = self.columns[name]
        return values[offsets[row]: offsets[row + 1]]

    def check(self, samples: list, where: str, model_hash_: str | None, layer: int | None,
              vocab_size: int | None = None) -> None:
        """Refuse a cache of other retain data or another model, or without the activations of `layer`, or (with
        the model's `vocab_size`) with token ids outside its vocabulary."""
        if model_hash_ is not None and self.meta.get("model_hash") != model_hash_:
            raise DataError(f"{self.where}: the reference cache was made with another model (model_hash "
                            f"{self.meta.get('model_hash')}, here {model_hash_}): {RERUN}")
        # The rows themselves, not only the fingerprint the metadata records: an edited cache can keep that.
        first = next((i for i, s in enumerate(samples) if i not in self.index or
                      not np.array_equal(np.asarray(s.input_ids), self._values("input_ids", self.index[i]))),
                     None)
        if len(samples) != len(self) or first is not None or \
                samples_fingerprint(samples) != self.meta.get("samples_fingerprint"):
            first = first if first is not None else min(len(samples), len(self))
            raise DataError(f"{self.where}: the reference cache holds other retain data than {where} ({len(self)} "
                            f"samples of {self.meta.get('corpus') or self.meta.get('split')}, here {len(samples)}; "
                            f"first difference at sample {first}): {RERUN} with the same "
                            "split or corpus, template and tokenizer")
        if layer is not None and layer not in self.layers:
            raise DataError(f"{self.where}: activation matching at rmu_layer={layer} needs reference.layers to hold it "
                            f"(the cache has {self.layers}): add it and {RERUN}")
        top = max((int(self.columns[c][0].max()) for c in ("topk_ids", "input_ids") if self.columns[c][0].size),
                  default=-1)
        if vocab_size is not None and top >= vocab_size:
            raise DataError(f"{self.where}: the reference cache holds token id {top}, outside the model's vocabulary "
                            f"of {vocab_size}: it was made with another model; {RERUN}")

    def batch(self, sample_ids: list[int], layer: int | None = None) -> dict[str, torch.Tensor]:
        """The cached entries of a padded batch of these samples (in this order): `rows`, `cols` (the batch row and
        position of each cached position), `topk_ids` [P, k], `topk_logp` [P, k], `tail_logp` [P], and, with
        `layer`, `act` [P, d]."""
        rows = [self.index[i] for i in sample_ids]
        cols = [self._values("positions", r) for r in rows]
        out = {"rows": torch.from_numpy(np.repeat(np.arange(len(rows)), [len(c) for c in cols])),
               "cols": torch.from_numpy(np.concatenate(cols).astype(np.int64)),
               "topk_ids": torch.from_numpy(np.concatenate([self._values("topk_ids", r) for r in rows])
                                            .astype(np.int64)).view(-1, self.k),
               "topk_logp": torch.from_numpy(np.concatenate([self._values("topk_logp", r) for r in rows])
                                             .astype(np.float32)).view(-1, self.k),
               "tail_logp": torch.from_numpy(np.concatenate([self._values("tail_logp", r) for r in rows])
                                             .astype(np.float32))}
        if layer is not None:
            out["act"] = torch.from_numpy(np.concatenate([self._values(f"act_{layer}", r) for r in rows])
                                          .astype(np.float32)).view(-1, self.hidden)
        return out


def _first_duplicate(values: np.ndarray):
    unique, counts = np.unique(values, return_counts=True)
    return unique[counts > 1][0]


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_cache_metadata(manifest: dict, cache_dir: Path) -> dict:
    """The metadata a cache is read with, checked: that it is a reference cache at all (not the attribution shards,
    whose manifest looks alike), and the top_k, layers and hidden_size its shards' widths follow."""
    path, meta = cache_dir / MANIFEST, manifest.get("metadata") or {}
    if meta.get("kind") != KIND:
        what = "attribution shards" if "alpha" in meta or "tagger" in meta else f"metadata kind {meta.get('kind')!r}"
        raise DataError(f"{cache_dir}: not a reference cache ({what}); point it at `tokenunlearn reference`'s output, "
                        "e.g. artifacts/reference")
    for name in ("top_k", "hidden_size"):
        if not _positive_int(meta.get(name)):
            raise DataError(f"{path}: metadata {name} is {json.dumps(meta.get(name))}, not a positive integer; "
                            f"{RERUN}")
    layers = meta.get("layers")
    if not isinstance(layers, list) or not all(isinstance(L, int) and not isinstance(L, bool) and L >= 0
                                               for L in layers):
        raise DataError(f"{path}: metadata layers is {json.dumps(layers)}, not a list of layer indices; {RERUN}")
    vocab = meta.get("vocab_size")  # caches before it was recorded have none
    if vocab is not None and not (_positive_int(vocab) and meta["top_k"] <= vocab):
        raise DataError(f"{path}: metadata vocab_size is {json.dumps(vocab)}, not an integer of at least top_k "
                        f"{meta['top_k']}; {RERUN}")
    return meta


def check_cache_values(table: pa.Table, meta: dict, file: Path) -> None:
    """One shard's values, before use: no nulls, every row's lists as long as its positions say (k per position,
    hidden_size per activation), positions inside the sample, token ids in the vocabulary, and log-probabilities
    that are probabilities (finite, at most 0); activations finite. An edited or corrupt cache otherwise trains on
    (a retain loss of ~1e6) or fails mid-run."""
    k, hidden = meta["top_k"], meta["hidden_size"]
    sample_ids = table.column("sample_id").to_numpy(zero_copy_only=False)

    def fail(row: int, what: str):
        raise DataError(f"{file}: sample {sample_ids[row]}: {what}; {RERUN}")

    for name in table.column_names:
        column = table.column(name).combine_chunks()
        nulls = column.null_count + (column.values.null_count if hasattr(column, "values") else 0)
        if nulls:
            raise DataError(f"{file}: column {name} holds {nulls} nulls; {RERUN}")
    if (sample_ids < 0).any():
        fail(int(np.flatnonzero(sample_ids < 0)[0]), "a negative sample id")
    flat = {name: _flat(table.column(name)) for name in table.column_names if name != "sample_id"}
    n_pos = np.diff(flat["positions"][1])
    n_ids = np.diff(flat["input_ids"][1])
    for name, per in (("topk_ids", k), ("topk_logp", k), ("tail_logp", 1),
                      *((f"act_{L}", hidden) for L in meta["layers"])):
        bad = np.flatnonzero(np.diff(flat[name][1]) != n_pos * per)
        if bad.size:
            row = int(bad[0])
            fail(row, f"{name} has {np.diff(flat[name][1])[row]} values for {n_pos[row]} positions"
                      + (f" × {per}" if per != 1 else "") + " (truncated or edited)")
    positions = flat["positions"][0].astype(np.int64)
    owner = np.repeat(np.arange(len(n_pos)), n_pos)  # the row of each position
    bad = np.flatnonzero((positions < 0) | (positions >= n_ids[owner] - 1))  # the token at p + 1 is labelled
    if bad.size:
        row = int(owner[bad[0]])
        fail(row, f"position {positions[bad[0]]} is outside its {n_ids[row]} tokens (0..{n_ids[row] - 2})")
    vocab = meta.get("vocab_size")
    for name in ("input_ids", "topk_ids"):
        values, offsets = flat[name]
        bad = np.flatnonzero((values < 0) | (values >= vocab if vocab is not None else False))
        if bad.size:
            row = int(np.searchsorted(offsets, bad[0], side="right")) - 1
            fail(row, f"{name} holds token id {values[bad[0]]}, outside the vocabulary "
                      f"(0..{vocab - 1 if vocab is not None else '∞'})")
    for name in ("topk_logp", "tail_logp", *(f"act_{L}" for L in meta["layers"])):
        values, offsets = flat[name]
        logp = not name.startswith("act_")
        bad = np.flatnonzero(~np.isfinite(values) | ((values > LOGP_TOLERANCE) if logp else False))
        if bad.size:
            row = int(np.searchsorted(offsets, bad[0], side="right")) - 1
            fail(row, f"{name} holds {values[bad[0]]:g}" + (", not a log-probability (finite, at most 0)" if logp
                                                             else ", not a finite activation"))


def _flat(column: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """A list column as (flat values, offsets)."""
    column = column.combine_chunks()
    return column.values.to_numpy(zero_copy_only=False), column.offsets.to_numpy()
