"""Stage one as a job: tag, mask, score with the original model, write Parquet shards and quality metrics.

Several processes (a `torchrun` or `deepspeed` launch) each take every world_size-th sample and write their own
shards; the main process writes the manifest last. Read back sorted by sample id, the result equals a
one-process run.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from pipeline import __version__
from pipeline.attribution.alternatives import alternative_answers, encode_alternative, score_alternatives
from pipeline.attribution.config import AttributionConfig, mask_token_id
from pipeline.attribution.learned import fit_learned_scorer
from pipeline.data.annotations import qa_facts
from pipeline.attribution.quality import attribution_quality
from pipeline.attribution.shards import MANIFEST, ShardInfo, ShardWriter, shard_schema, write_manifest
from pipeline.attribution.signals import (AttributionInput, add_phi, build_qa_inputs, corpus_input, scatter,
                                          score_batch)
from pipeline.attribution.tagging import CachedTagger, make_tagger, tag_cache_file, with_upos
from pipeline.attribution.teacher import teacher_row
from pipeline.attribution.variants import (ANSWER_NOUN_UPOS, CONTENT_UPOS, LearnedScorer, copied_tokens,
                                           gradient_x_input, per_noun_deltas, phrase_spans, span_ids, tokens_in)
from pipeline.common.atomic import atomic_dir, write_json
from pipeline.common.distributed import broadcast_from_main, init_distributed, is_main_process
from pipeline.common.errors import DataError
from pipeline.common.modeling import check_vocab, load_model, load_tokenizer, model_hash, tokenizer_hash
from pipeline.common.paths import cache_dir
from pipeline.common.progress import progress
from pipeline.data.config import DataConfig
from pipeline.data.templates import get_template
from pipeline.data.tofu import count_duplicates, load_passages, load_split

log = logging.getLogger(__name__)


def load_records(cfg: AttributionConfig, data: DataConfig) -> tuple[list[dict], str]:
    """The samples' records (QA rows or passages) and a fingerprint of them."""
    if cfg.mode == "qa":
        records = load_split(data.source, cfg.split)
    else:
        records = load_passages(cfg.corpus, cfg.split)  # the embedded world's biographies: the split's authors
    return records, hashlib.sha256(json.dumps(records, sort_keys=True).encode()).hexdigest()[:16]


def iter_input_windows(cfg: AttributionConfig, data: DataConfig, records: list[dict], tokenizer, tagger,
                       mask_id: int, rank: int, world_size: int, window: int,
                       skipped: list[int], answers: list[dict] | None = None) -> Iterator[list[AttributionInput]]:
    """This process's share of the samples (every world_size-th), tagged and encoded `window` at a time, so
    memory does not grow with the dataset. A sample longer than `data.max_length` (or one of its alternative
    answers, `answers[i]`: kind -> text) is an error naming it, or, with `data.skip_too_long`, left out and its
    index added to `skipped`."""
    mine = list(range(rank, len(records), world_size))
    facts = qa_facts(data.source) if cfg.mode == "qa" else None
    template = get_template(data.template)
    where, what = (f"{data.source}/{cfg.split}", "row") if cfg.mode == "qa" else (cfg.corpus, "passage")
    for start in range(0, len(mine), window):
        ids = mine[start : start + window]
        recs = [records[i] for i in ids]
        if cfg.mode == "qa":
            inputs = build_qa_inputs(recs, tokenizer, template, tagger, mask_id, facts, row_indices=ids)
            for x in inputs if answers is not None else ():
                x.alternatives = {kind: encode_alternative(tokenizer, template, records[x.sample_id]["question"],
                                                           text) for kind, text in answers[x.sample_id].items()}
        else:
            spans = tagger.noun_spans([r["text"] for r in recs])
            inputs = [corpus_input(i, tokenizer, rec["text"], nouns, mask_id, rec.get("fact_spans"))
                      for i, rec, nouns in zip(ids, recs, spans)]
        kept = []
        for x in inputs:
            lengths = {"": len(x.input_ids), **{f" (its {k} answer)": len(a.input_ids)
                                                  for k, a in x.alternatives.items()}}
            too_long = [(name, n) for name, n in lengths.items() if n > data.max_length]
            if not too_long:
                kept.append(x)
            elif data.skip_too_long:
                skipped.append(x.sample_id)
            else:
                name, n = too_long[0]
                raise DataError(f"{where}: {what} {x.sample_id + 1}{name}: {n} tokens exceed "
                                f"data.max_length={data.max_length} (raise max_length, or set data.skip_too_long: "
                                "true to skip and count such rows)")
        yield kept


class ExtraSignals:
    """The columns of `attribution.signals` for a batch, beside the paper's (see pipeline/attribution/variants.py
    for what each costs)."""

    def __init__(self, cfg: AttributionConfig, model, pad_id: int, content_tagger=None,
                 scorer: LearnedScorer | None = None, noun_tagger=None):
        self.cfg, self.model, self.pad_id = cfg, model, pad_id
        self.content_tagger, self.scorer, self.noun_tagger = content_tagger, scorer, noun_tagger

    def __call__(self, batch: list[AttributionInput], sigs: list) -> list[dict]:
        """`sigs`: the batch's Signals from score_batch (with hidden states where `learned` is asked for)."""
        names, cfg = set(self.cfg.signals), self.cfg
        out: list[dict] = [{} for _ in batch]
        if "copy" in names:
            for row, x in zip(out, batch):
                row["copied"] = copied_tokens(x)
        if "span" in names:
            regions = [x.region or (0, len(x.text)) for x in batch]
            tags = self.content_tagger.noun_spans([x.text[a:b] for x, (a, b) in zip(batch, regions)])
            for row, x, (a, _), spans in zip(out, batch, regions, tags):
                row["span"] = span_ids(x, phrase_spans([(s + a, e + a) for s, e in spans], x.text))
        if "nouns" in names:  # the answer's (QA) or the passage's (corpus) nouns and proper nouns
            regions = [x.region or (0, len(x.text)) for x in batch]
            tags = self.noun_tagger.noun_spans([x.text[a:b] for x, (a, b) in zip(batch, regions)])
            for row, x, (a, _), spans in zip(out, batch, regions, tags):
                row["answer_noun"] = tokens_in(x, [(s + a, e + a) for s, e in spans])
        if "per_noun" in names:
            deltas = per_noun_deltas(self.model, batch, [s.logp_orig for s in sigs], self.pad_id, cfg.batch_size,
                                     cfg.chunk_size)
            for row, (lo, hi) in zip(out, deltas):
                row["delta_noun_min"], row["delta_noun_max"] = lo.tolist(), hi.tolist()
        if "grad_x_input" in names:
            for row, gx in zip(out, gradient_x_input(self.model, batch, self.pad_id, cfg.chunk_size)):
                row["grad_x_input"] = gx.tolist()
        if "learned" in names:
            for row, x, sig in zip(out, batch, sigs):
                probability = self.scorer.predict(LearnedScorer.features_of(sig, x.scored))
                row["learned"] = scatter(len(x.scored), np.flatnonzero(x.scored), probability).tolist()
        return out


def check_finite(signals, x: AttributionInput, model: str, extra: dict | None = None) -> None:
    """A model whose weights (or inputs) hold NaN or inf gives non-finite signals: refuse them, as stage two would
    (the extra signals' float columns too)."""
    values = {name: getattr(signals, name) for name in ("logp_orig", "logp_mask", "entropy")}
    values.update({k: np.asarray(v, dtype=np.float64) for k, v in (extra or {}).items() if k not in ("copied", "span", "answer_noun")})
    for name, v in values.items():
        if not np.isfinite(v[x.scored]).all():
            raise DataError(f"model '{model}': non-finite {name} for sample {x.sample_id} (its weights may hold NaN "
                            "or inf); nothing was written")


def _row(x: AttributionInput, split: str, s, extra: dict) -> dict:
    return {**extra,
        "sample_id": x.sample_id, "split": split, "text": x.text, "input_ids": x.input_ids,
        "positions": list(range(len(x.input_ids))),
        "token_start": [a for a, _ in x.offsets], "token_end": [b for _, b in x.offsets],
        "scored": x.scored, "masked": x.masked,
        "logp_orig": s.logp_orig.tolist(), "logp_mask": s.logp_mask.tolist(), "delta": s.delta.tolist(),
        "entropy": s.entropy.tolist(), "phi": s.phi.tolist(), "fact": x.fact,
    }


def recorded_config(cfg: AttributionConfig) -> dict:
    """The config the metrics record: the alternatives' and the teacher's keys only where they are asked for, so a
    pipeline without them records what it recorded before they existed."""
    config = asdict(cfg)
    if not cfg.alternatives:
        del config["alternatives"], config["alternatives_seed"]
    if not cfg.teacher_top_k:
        del config["teacher_top_k"]
    return config


def run_attribution(cfg: AttributionConfig, data: DataConfig, out_dir: Path, metrics_file: Path | None) -> dict:
    """Stage one: write `out_dir` (shards and manifest, atomically) and the counts and quality to `metrics_file`."""
    import torch.distributed as dist

    rank, world_size = init_distributed()
    records, fingerprint = load_records(cfg, data)  # the inputs first: a bad row fails before the model loads
    # (QA splits: `load_split` has logged their duplicates already)
    duplicates = count_duplicates(records, "text", cfg.corpus) if cfg.mode == "corpus" else \
        count_duplicates(records, ("question", "answer"))
    tokenizer = load_tokenizer(cfg.model, cfg.trust_remote_code)
    mask_token, mask_id = mask_token_id(tokenizer, cfg.mask_token)
    base_tagger = make_tagger(cfg.tagger, cfg.upos, cfg.trankit_cache or None)
    tagger = CachedTagger(base_tagger, tag_cache_file(base_tagger, cfg.upos, cache_dir(), rank))
    device = torch.device(f"cuda:{torch.cuda.current_device()}") if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else None
    model = load_model(cfg.model, dtype=dtype, trust_remote_code=cfg.trust_remote_code).to(device).eval()
    check_vocab(model, tokenizer, cfg.model, data.max_length)
    content_tagger = scorer = learned_info = None
    if "span" in cfg.signals:
        content_tagger = CachedTagger(with_upos(base_tagger, CONTENT_UPOS),
                                      tag_cache_file(base_tagger, CONTENT_UPOS, cache_dir(), rank))
    noun_tagger = None
    if "nouns" in cfg.signals:
        noun_tagger = CachedTagger(with_upos(base_tagger, ANSWER_NOUN_UPOS),
                                   tag_cache_file(base_tagger, ANSWER_NOUN_UPOS, cache_dir(), rank))
    if "learned" in cfg.signals:  # every process fits the same scorer on the same rows (L-BFGS from zeros is
        # deterministic), so none waits for another; the main process saves it beside the shards
        scorer, learned_info = fit_learned_scorer(cfg, data, records, model, tokenizer, tagger, mask_id)
    extra_signals = ExtraSignals(cfg, model, tokenizer.pad_token_id, content_tagger, scorer, noun_tagger)

    metadata = {
        "schema_version": 1, "mode": cfg.mode, "split": cfg.split, "model": cfg.model,
        "model_hash": model_hash(model, cfg.model), "tokenizer_hash": tokenizer_hash(tokenizer),
        "template": data.template if cfg.mode == "qa" else None, "tagger": tagger.name,
        "tagger_version": tagger.version, "upos": sorted(cfg.upos), "mask_token": mask_token,
        "mask_token_id": mask_id, "alpha": cfg.alpha, "dataset_fingerprint": fingerprint,
        "code_version": __version__, "signals": sorted(cfg.signals),
    }
    if learned_info is not None:
        metadata["learned"] = learned_info
    answers = None
    if cfg.alternatives:  # named only where asked for: shards without them are written as they always were
        metadata |= {"alternatives": sorted(cfg.alternatives), "alternatives_seed": cfg.alternatives_seed}
        answers = alternative_answers(cfg.alternatives, records, data.source, cfg.split, cfg.alternatives_seed)
    teacher_k = min(cfg.teacher_top_k, model.get_input_embeddings().num_embeddings)
    if teacher_k:  # likewise: the k kept (at most the vocabulary), where asked for
        metadata["teacher_top_k"] = teacher_k
    # Every process writes its shards into one temporary directory beside `out_dir`, which the main process
    # renames into place once the manifest is written, or removes if anything fails.
    with atomic_dir(out_dir) if is_main_process() else contextlib.nullcontext() as tmp:
        tmp = Path(broadcast_from_main(str(tmp) if tmp else None))
        writer = ShardWriter(tmp, f"part-r{rank:03d}", cfg.rows_per_shard, metadata,
                             shard_schema(cfg.signals, cfg.alternatives, teacher=bool(teacher_k)))
        if scorer is not None and is_main_process():
            from safetensors.torch import save_file
            save_file(scorer.state_dict(), str(tmp / "learned_scorer.safetensors"))
        local = {"samples": 0, "no_noun": 0, "scored_tokens": 0, "skipped": []}
        bar = progress(total=len(range(rank, len(records), world_size)), desc=f"attribute {cfg.split}",
                       unit="sample", leave=True)
        window, skipped_seen = cfg.batch_size * 16, 0
        for inputs in iter_input_windows(cfg, data, records, tokenizer, tagger, mask_id, rank, world_size, window,
                                         local["skipped"], answers):
            inputs.sort(key=lambda x: len(x.input_ids))  # similar lengths together: less padding per batch
            for s in range(0, len(inputs), cfg.batch_size):
                batch = inputs[s : s + cfg.batch_size]
                signals = score_batch(model, batch, tokenizer.pad_token_id, cfg.chunk_size,
                                      return_hidden=scorer is not None, teacher_top_k=teacher_k)
                alternatives = score_alternatives(model, batch, tokenizer.pad_token_id, cfg.chunk_size, cfg.model)
                for x, sig, extra, alt in zip(batch, signals, extra_signals(batch, signals), alternatives):
                    check_finite(sig, x, cfg.model, extra)
                    tea = teacher_row(sig.teacher, x.sample_id, cfg.model) if teacher_k else {}
                    writer.add(_row(x, cfg.split, add_phi(sig, cfg.alpha), {**extra, **alt, **tea}))
            bar.update(len(inputs) + len(local["skipped"]) - skipped_seen)
            skipped_seen = len(local["skipped"])
            local["samples"] += len(inputs)
            local["no_noun"] += sum(1 for x in inputs if x.n_masked == 0)
            local["scored_tokens"] += sum(sum(x.scored) for x in inputs)
        bar.close()
        local.update(shards=[s.__dict__ for s in writer.close()], tag_cache_hits=tagger.hits)
        gathered: list = [None] * world_size
        dist.all_gather_object(gathered, local)
        skipped = sorted(i for g in gathered for i in g["skipped"])
        summary = {"samples": sum(g["samples"] for g in gathered), "no_noun": sum(g["no_noun"] for g in gathered),
                   "scored_tokens": sum(g["scored_tokens"] for g in gathered), "tagger": tagger.name,
                   "tagger_version": tagger.version, "mask_token": mask_token}
        if skipped:  # counted only where rows were skipped, so a run without them writes what it always wrote
            summary["skipped_too_long"] = len(skipped)
            log.warning("skipped %d of %d %s longer than data.max_length=%d (first: %d)", len(skipped),
                        len(records), "rows" if cfg.mode == "qa" else "passages", data.max_length, skipped[0] + 1)
        if duplicates:
            summary["duplicates"] = duplicates
        if summary["samples"] == 0:
            raise DataError(f"{cfg.split if cfg.mode == 'qa' else cfg.corpus}: no sample left to attribute (every "
                            f"one of the {len(records)} is longer than data.max_length={data.max_length})")
        if summary["no_noun"]:
            log.warning("%d of %d samples have no noun to mask: their Δ is 0 and φ comes from entropy alone",
                        summary["no_noun"], summary["samples"])
        if is_main_process():
            shards = [ShardInfo(**s) for g in gathered for s in g["shards"]]
            write_manifest(tmp, shards, metadata, summary)
            quality = attribution_quality(tmp, cfg.quality_r, cfg.alpha)
        dist.barrier()  # every process is done with the temporary directory before it is renamed
    if is_main_process():
        if metrics_file is not None:
            write_json(metrics_file, {**summary, "quality": quality, "config": recorded_config(cfg)})
        log.info("wrote %s: %d samples in %d shards (%s last)", out_dir, summary["samples"], len(shards), MANIFEST)
    dist.barrier()
    return {**summary, "metadata": metadata}
