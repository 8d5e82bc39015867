"""Stage one as a job: tag, mask, score with the original model, write Parquet shards and quality metrics.

Several processes (a `torchrun` or `deepspeed` launch) each take every world_size-th sample and write their own
shards; the main process writes the manifest last. Read back sorted by sample id, the result equals a
one-process run.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from pipeline import __version__
from pipeline.attribution.quality import attribution_quality
from pipeline.attribution.shards import MANIFEST, ShardInfo, ShardWriter, write_manifest
from pipeline.attribution.signals import AttributionInput, add_phi, build_qa_inputs, corpus_input, score_batch
from pipeline.attribution.tagging import DEFAULT_UPOS, CachedTagger, make_tagger, tag_cache_file
from pipeline.common.atomic import write_json
from pipeline.common.distributed import init_distributed, is_main_process
from pipeline.common.errors import DataError, ParamError
from pipeline.common.modeling import check_vocab, load_model, load_tokenizer, model_hash, tokenizer_hash
from pipeline.common.params import dataclass_from_params
from pipeline.common.paths import cache_dir
from pipeline.data.config import DataConfig
from pipeline.data.templates import get_template
from pipeline.data.tofu import load_passages, load_split, read_json_records

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AttributionConfig:
    model: str = "artifacts/models/target"
    split: str = "forget10"
    mode: str = "qa"                 # qa: mask the question's nouns, score the answer; corpus: passages
    corpus: str = ""                 # corpus mode: JSON Lines with `text` (optional `fact_spans`, `forget_splits`)
    tagger: str = "auto"             # auto | trankit | spacy
    upos: list = field(default_factory=lambda: list(DEFAULT_UPOS))
    mask_token: str = ""             # empty: the tokenizer's mask, else unk, else pad, else eos token
    alpha: float = 0.7
    batch_size: int = 16
    chunk_size: int = 1024           # scored positions per lm-head chunk
    rows_per_shard: int = 256
    quality_r: list = field(default_factory=lambda: [0.2])
    trankit_cache: str = ""          # empty: ~/.cache/tokenunlearn/trankit
    trust_remote_code: bool = False

    @classmethod
    def from_params(cls, params: dict) -> "AttributionConfig":
        cfg = dataclass_from_params(cls, params, "attribution")
        checks = [("mode", cfg.mode in ("qa", "corpus")), ("alpha", 0 <= cfg.alpha <= 1),
                  ("batch_size", cfg.batch_size >= 1), ("chunk_size", cfg.chunk_size >= 1),
                  ("rows_per_shard", cfg.rows_per_shard >= 1), ("upos", bool(cfg.upos)),
                  ("quality_r", all(0 < r <= 1 for r in cfg.quality_r)),
                  ("corpus", cfg.mode == "qa" or bool(cfg.corpus))]
        for name, ok in checks:
            if not ok:
                raise ParamError(f"attribution.{name}={getattr(cfg, name)!r}: out of range")
        return cfg


def mask_token_id(tokenizer, mask_token: str) -> tuple[str, int]:
    """The token that replaces masked nouns: the param, else the tokenizer's mask, unk, pad or eos token."""
    if mask_token:
        ids = tokenizer.convert_tokens_to_ids([mask_token])
        if ids[0] is None or ids[0] == tokenizer.unk_token_id and mask_token != tokenizer.unk_token:
            raise ParamError(f"attribution.mask_token={mask_token!r}: not a token of this tokenizer")
        return mask_token, ids[0]
    for name in ("mask_token", "unk_token", "pad_token", "eos_token"):
        token = getattr(tokenizer, name, None)
        if token is not None:
            return token, tokenizer.convert_tokens_to_ids(token)
    raise ParamError("attribution.mask_token: the tokenizer has no mask, unk, pad or eos token; set one")


def _qa_facts(source: str) -> dict[str, list] | None:
    """Ground-truth fact spans by question, where the data has them (the embedded world's annotations.json)."""
    path = Path(source) / "annotations.json"
    if not path.is_file():
        return None
    return {a["question"]: [tuple(s) for s in a["answer_fact_spans"]] for a in read_json_records(path)}


def load_records(cfg: AttributionConfig, data: DataConfig) -> tuple[list[dict], str]:
    """The samples' records (QA rows or passages) and a fingerprint of them."""
    if cfg.mode == "qa":
        records = load_split(data.source, cfg.split)
    else:
        records = load_passages(cfg.corpus, cfg.split)  # the embedded world's biographies: the split's authors
    return records, hashlib.sha256(json.dumps(records, sort_keys=True).encode()).hexdigest()[:16]


def iter_input_windows(cfg: AttributionConfig, data: DataConfig, records: list[dict], tokenizer, tagger,
                       mask_id: int, rank: int, world_size: int, window: int) -> Iterator[list[AttributionInput]]:
    """This process's share of the samples (every world_size-th), tagged and encoded `window` at a time, so
    memory does not grow with the dataset."""
    mine = list(range(rank, len(records), world_size))
    facts = _qa_facts(data.source) if cfg.mode == "qa" else None
    template = get_template(data.template)
    for start in range(0, len(mine), window):
        ids = mine[start : start + window]
        recs = [records[i] for i in ids]
        if cfg.mode == "qa":
            inputs = build_qa_inputs(recs, tokenizer, template, tagger, mask_id, data.max_length,
                                     f"{data.source}/{cfg.split}", facts, row_indices=ids)
        else:
            spans = tagger.noun_spans([r["text"] for r in recs])
            inputs = []
            for i, rec, nouns in zip(ids, recs, spans):
                x = corpus_input(i, tokenizer, rec["text"], nouns, mask_id, rec.get("fact_spans"))
                if len(x.input_ids) > data.max_length:
                    raise DataError(f"{cfg.corpus}: passage {i + 1}: {len(x.input_ids)} tokens exceed "
                                    f"data.max_length={data.max_length}")
                inputs.append(x)
        yield inputs


def _row(x: AttributionInput, split: str, s) -> dict:
    return {
        "sample_id": x.sample_id, "split": split, "text": x.text, "input_ids": x.input_ids,
        "positions": list(range(len(x.input_ids))),
        "token_start": [a for a, _ in x.offsets], "token_end": [b for _, b in x.offsets],
        "scored": x.scored, "masked": x.masked,
        "logp_orig": s.logp_orig.tolist(), "logp_mask": s.logp_mask.tolist(), "delta": s.delta.tolist(),
        "entropy": s.entropy.tolist(), "phi": s.phi.tolist(), "fact": x.fact,
    }


def run_attribution(cfg: AttributionConfig, data: DataConfig, out_dir: Path, metrics_file: Path | None) -> dict:
    from tqdm import tqdm
    import torch.distributed as dist

    rank, world_size = init_distributed()
    device = torch.device(f"cuda:{torch.cuda.current_device()}") if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else None
    tokenizer = load_tokenizer(cfg.model, cfg.trust_remote_code)
    model = load_model(cfg.model, dtype=dtype, trust_remote_code=cfg.trust_remote_code).to(device).eval()
    check_vocab(model, tokenizer, cfg.model)
    mask_token, mask_id = mask_token_id(tokenizer, cfg.mask_token)
    base_tagger = make_tagger(cfg.tagger, cfg.upos, cfg.trankit_cache or None)
    tagger = CachedTagger(base_tagger, tag_cache_file(base_tagger, cfg.upos, cache_dir(), rank))
    records, fingerprint = load_records(cfg, data)

    metadata = {
        "schema_version": 1, "mode": cfg.mode, "split": cfg.split, "model": cfg.model,
        "model_hash": model_hash(model, cfg.model), "tokenizer_hash": tokenizer_hash(tokenizer),
        "template": data.template if cfg.mode == "qa" else None, "tagger": tagger.name,
        "tagger_version": tagger.version, "upos": sorted(cfg.upos), "mask_token": mask_token,
        "mask_token_id": mask_id, "alpha": cfg.alpha, "dataset_fingerprint": fingerprint,
        "code_version": __version__,
    }
    partial = out_dir.with_name(f".{out_dir.name}.partial")
    if is_main_process():
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    dist.barrier()

    writer = ShardWriter(partial, f"part-r{rank:03d}", cfg.rows_per_shard, metadata)
    local = {"samples": 0, "no_noun": 0, "scored_tokens": 0}
    bar = tqdm(total=len(range(rank, len(records), world_size)), desc=f"attribute {cfg.split}",
               disable=not is_main_process(), mininterval=1.0)
    window = cfg.batch_size * 16
    for inputs in iter_input_windows(cfg, data, records, tokenizer, tagger, mask_id, rank, world_size, window):
        inputs.sort(key=lambda x: len(x.input_ids))  # similar lengths together: less padding per batch
        for s in range(0, len(inputs), cfg.batch_size):
            batch = inputs[s : s + cfg.batch_size]
            for x, signals in zip(batch, score_batch(model, batch, tokenizer.pad_token_id, cfg.chunk_size)):
                writer.add(_row(x, cfg.split, add_phi(signals, cfg.alpha)))
            bar.update(len(batch))
        local["samples"] += len(inputs)
        local["no_noun"] += sum(1 for x in inputs if x.n_masked == 0)
        local["scored_tokens"] += sum(sum(x.scored) for x in inputs)
    bar.close()
    local.update(shards=[s.__dict__ for s in writer.close()], tag_cache_hits=tagger.hits)
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, local)
    summary = {"samples": sum(g["samples"] for g in gathered), "no_noun": sum(g["no_noun"] for g in gathered),
               "scored_tokens": sum(g["scored_tokens"] for g in gathered), "tagger": tagger.name,
               "tagger_version": tagger.version, "mask_token": mask_token}
    if summary["no_noun"]:
        log.warning("%d of %d samples have no noun to mask: their Δ is 0 and φ comes from entropy alone",
                    summary["no_noun"], summary["samples"])
    if is_main_process():
        shards = [ShardInfo(**s) for g in gathered for s in g["shards"]]
        write_manifest(partial, shards, metadata, summary)
        quality = attribution_quality(partial, cfg.quality_r)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        partial.rename(out_dir)
        if metrics_file is not None:
            metrics_file.parent.mkdir(parents=True, exist_ok=True)
            write_json(metrics_file, {**summary, "quality": quality, "config": asdict(cfg)})
        log.info("wrote %s: %d samples in %d shards (%s)", out_dir, summary["samples"], len(shards),
                 f"{MANIFEST} last")
    dist.barrier()
    return {**summary, "metadata": metadata}
