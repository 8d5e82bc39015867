"""The learned scorer's training (`attribution.signals: learned`): its samples, annotated facts of other authors than
those it will score (the embedded world's annotations, `data/annotations.py`), both passes over them and the
logistic fit."""

from __future__ import annotations

import logging

import numpy as np

from pipeline.attribution.config import AttributionConfig
from pipeline.attribution.signals import AttributionInput, build_qa_inputs, corpus_input, score_batch
from pipeline.attribution.variants import LearnedScorer
from pipeline.common.errors import ParamError
from pipeline.data.config import DataConfig
from pipeline.data.templates import get_template
from pipeline.data.annotations import fact_spans, qa_annotations
from pipeline.data.tofu import load_passages, load_split

log = logging.getLogger(__name__)


def learned_training_inputs(cfg: AttributionConfig, data: DataConfig, records: list[dict], tokenizer, tagger,
                            mask_id: int) -> list[AttributionInput]:
    """The learned scorer's training samples, with their fact tokens: QA rows of `learned_split`, whose authors
    must differ from those of `records` (the rows it will score), or the corpus's passages of other authors than
    `split`'s."""
    where = "attribution.signals: learned"
    if cfg.mode == "qa":
        annotations = qa_annotations(data.source)
        if annotations is None:
            raise ParamError(f"{where} trains on annotated facts, and {data.source} has no annotations.json (only the "
                             "embedded world has them): drop `learned` from attribution.signals")
        rows = load_split(data.source, cfg.learned_split)[: cfg.learned_max_samples]
        authors = lambda split_rows: {annotations.get(r["question"], {}).get("author")  # noqa: E731
                                      for r in split_rows} - {None}
        shared = authors(rows) & authors(records)
        if shared:
            raise ParamError(f"attribution.learned_split={cfg.learned_split!r} shares {len(shared)} author(s) with "
                             f"split {cfg.split!r} (e.g. {sorted(shared)[0]!r}): the scorer must be trained on other "
                             "authors than it scores")
        inputs = build_qa_inputs(rows, tokenizer, get_template(data.template), tagger, mask_id, fact_spans(annotations))
    else:
        passages = load_passages(cfg.corpus, cfg.split, forget=False)
        if not all("forget_splits" in p for p in passages):  # without it, "other authors" cannot be told apart
            raise ParamError(f"{where} trains on passages of other authors than split {cfg.split!r}, and "
                             f"{cfg.corpus}'s passages do not say whose they are (no `forget_splits`): drop `learned` "
                             "from attribution.signals")
        passages = passages[: cfg.learned_max_samples]
        if not all("fact_spans" in p for p in passages):
            raise ParamError(f"{where} trains on annotated facts, and {cfg.corpus}'s passages have no `fact_spans`: "
                             "drop `learned` from attribution.signals")
        spans = tagger.noun_spans([p["text"] for p in passages])
        inputs = [corpus_input(i, tokenizer, p["text"], nouns, mask_id, [tuple(f) for f in p["fact_spans"]])
                  for i, (p, nouns) in enumerate(zip(passages, spans))]
    return [x for x in inputs if x.fact is not None and len(x.input_ids) <= data.max_length]


def fit_learned_scorer(cfg: AttributionConfig, data: DataConfig, records: list[dict], model, tokenizer, tagger,
                       mask_id: int) -> tuple[LearnedScorer, dict]:
    """Both passes over the training samples, then the logistic scorer on their fact tokens."""
    inputs = learned_training_inputs(cfg, data, records, tokenizer, tagger, mask_id)
    features, labels = [], []
    for s in range(0, len(inputs), cfg.batch_size):
        batch = inputs[s : s + cfg.batch_size]
        signals = score_batch(model, batch, tokenizer.pad_token_id, cfg.chunk_size, return_hidden=True)
        for x, sig in zip(batch, signals):
            features.append(LearnedScorer.features_of(sig, x.scored))
            labels.append(np.array(x.fact)[np.array(x.scored)])
    y = np.concatenate(labels) if labels else np.zeros(0, dtype=bool)
    scorer = LearnedScorer.fit(np.concatenate(features) if features else np.zeros((0, 1)), y)
    info = {"split": cfg.learned_split if cfg.mode == "qa" else f"{cfg.corpus} (other authors)",
            "samples": len(inputs), "tokens": int(y.size), "fact_tokens": int(y.sum())}
    log.info("learned scorer: trained on %d samples (%d tokens, %d facts)", info["samples"], info["tokens"],
             info["fact_tokens"])
    return scorer, info
