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
from pipeline.attribution.shards import ShardInfo, ShardWriter, read_manifest, shard_files, write_manifest
from pipeline.common.atomic import atomic_dir, write_json
from pipeline.common.distributed import broadcast_from_main, init_distributed, is_main_process
from pipeline.common.errors import DataError
from pipeline.common.modeling import check_vocab, decoder, lm_head_logits, load_model, load_tokenizer, model_hash, \
    tokenizer_hash
from pipeline.common.numerics import LOG_TAIL_FLOOR, log1mexp
from pipeline.common.params import Rule, at_least, check_rules, dataclass_from_params
from pipeline.common.progress import progress
from pipeline.data.batching import pad_batch
from pipeline.data.config import DataConfig, retain_samples

log = logging.getLogger(__name__)


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
    check_vocab(model, tokenizer, cfg.model)
    n_layers = model.config.num_hidden_layers
    bad = [L for L in cfg.layers if L > n_layers]
    if bad:
        raise DataError(f"reference.layers={cfg.layers}: {cfg.model} has hidden_states 0..{n_layers}")
    metadata = {"schema_version": 1, "kind": "retain_reference", "model": cfg.model,
                "model_hash": model_hash(model, cfg.model), "tokenizer_hash": tokenizer_hash(tokenizer),
                "template": data.template, "split": cfg.split, "corpus": cfg.corpus, "forget_split": cfg.forget_split,
                "top_k": cfg.top_k, "layers": sorted(cfg.layers), "hidden_size": model.config.hidden_size,
                "samples_fingerprint": samples_fingerprint(samples), "code_version": __version__}
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
        manifest = read_manifest(cache_dir)  # checks every shard's sha256
        tables = [pq.read_table(f, memory_map=True) for f in shard_files(cache_dir, verify=False)]
        return cls(pa.concat_tables(tables), manifest["metadata"], str(cache_dir))

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
        meta = {"top_k": top_k, "layers": sorted(layers), "hidden_size": model.config.hidden_size}
        return cls(pa.Table.from_pylist(rows, schema=cache_schema(layers)), meta, "the run's own reference pass")

    def __len__(self) -> int:
        return len(self.index)

    def _values(self, name: str, row: int) -> np.ndarray:
        values, offsets = self.columns[name]
        return values[offsets[row]: offsets[row + 1]]

    def check(self, samples: list, where: str, model_hash_: str | None, layer: int | None) -> None:
        """Refuse a cache of other retain data or another model, or without the activations of `layer`."""
        if model_hash_ is not None and self.meta.get("model_hash") != model_hash_:
            raise DataError(f"{self.where}: the reference cache was made with another model (model_hash "
                            f"{self.meta.get('model_hash')}, here {model_hash_}): rerun `tokenunlearn reference`")
        if len(samples) != len(self) or samples_fingerprint(samples) != self.meta.get("samples_fingerprint"):
            first = next((i for i, s in enumerate(samples) if i not in self.index or
                          list(s.input_ids) != self._values("input_ids", self.index[i]).tolist()), len(self))
            raise DataError(f"{self.where}: the reference cache holds other retain data than {where} ({len(self)} "
                            f"samples of {self.meta.get('corpus') or self.meta.get('split')}, here {len(samples)}; "
                            f"first difference at sample {first}): rerun `tokenunlearn reference` with the same "
                            "split or corpus, template and tokenizer")
        if layer is not None and layer not in self.layers:
            raise DataError(f"{self.where}: activation matching at rmu_layer={layer} needs reference.layers to hold it "
                            f"(the cache has {self.layers}): add it and rerun `tokenunlearn reference`")

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


def _flat(column: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """A list column as (flat values, offsets)."""
    column = column.combine_chunks()
    return column.values.to_numpy(zero_copy_only=False), column.offsets.to_numpy()
