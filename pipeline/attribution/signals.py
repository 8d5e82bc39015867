"""Token attribution signals: mask the nouns of the prefix, run the original model on both inputs, and score
each token.

For every scored position i (i ≥ 1, counting from 0: the first token has no prefix):
    logp_orig = log p(s_i | s_<i),  logp_mask = log p(s_i | masked s_<i),  delta = |logp_orig − logp_mask|,
    entropy   = H of the original next-token distribution,  phi = α·minmax(Δ) + (1−α)·minmax(H) in the sample.

QA mode (TOFU): the question's nouns are masked; the answer tokens and EOS (the tokens the losses train on) are
scored. Corpus mode (passages with no question): the passage's nouns are masked and every token is scored.
Masking replaces token ids and keeps every position, so the two sequences align token for token.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from pipeline.attribution.teacher import teacher_topk
from pipeline.common.errors import ParamError
from pipeline.common.modeling import decoder, lm_head_logits
from pipeline.data.templates import IGNORE_INDEX, EncodedSample, PromptTemplate, encode_qa, encode_text

log = logging.getLogger(__name__)

Span = tuple[int, int]


@dataclass
class AttributionInput:
    """One sample ready for the two forward passes."""

    sample_id: int
    text: str
    input_ids: list[int]
    offsets: list[Span]
    scored: list[bool]
    masked: list[bool]
    mask_id: int
    fact: list[bool] | None = None
    noun_tokens: list[list[int]] = field(default_factory=list)  # each masked noun's token positions
    prompt: Span | None = None  # QA: the question's characters (what the answer may copy); corpus: None
    region: Span | None = None  # the scored text's characters: QA the answer, corpus the whole passage
    alternatives: dict = field(default_factory=dict)  # kind -> Alternative (attribution.alternatives; QA only)

    @property
    def masked_ids(self) -> list[int]:
        return [self.mask_id if m else t for t, m in zip(self.input_ids, self.masked)]

    @property
    def n_masked(self) -> int:
        return sum(self.masked)


def overlapping(offsets: list[Span], spans: list[Span], region: Span | None = None) -> list[bool]:
    """Which tokens overlap any span (a token partly covered counts), optionally only inside `region`.

    Tokens with an empty offset (special tokens such as BOS and EOS) never overlap."""
    out = []
    for start, end in offsets:
        inside = region is None or (start < region[1] and end > region[0])
        out.append(end > start and inside and any(start < e and end > s for s, e in spans))
    return out


def noun_token_groups(offsets: list[Span], nouns: list[Span], region: Span | None = None) -> list[list[int]]:
    """The token positions of each noun (nouns sharing a token are merged, as masking merges them)."""
    groups: list[list[int]] = []
    for noun in nouns:
        tokens = [i for i, hit in enumerate(overlapping(offsets, [noun], region)) if hit]
        if not tokens:
            continue
        if groups and set(tokens) & set(groups[-1]):
            groups[-1] = sorted(set(groups[-1]) | set(tokens))
        else:
            groups.append(tokens)
    return groups


def qa_input(sample_id: int, sample: EncodedSample, noun_spans_in_question: list[Span], mask_id: int,
             fact_spans_in_answer: list[Span] | None = None) -> AttributionInput:
    q0, a0 = sample.question_span[0], sample.answer_span[0]
    nouns = [(s + q0, e + q0) for s, e in noun_spans_in_question]
    masked = overlapping(sample.offsets, nouns, sample.question_span)
    groups = noun_token_groups(sample.offsets, nouns, sample.question_span)
    scored = [label != IGNORE_INDEX for label in sample.labels]
    scored[0] = False
    fact = None
    if fact_spans_in_answer is not None:
        fact = overlapping(sample.offsets, [(s + a0, e + a0) for s, e in fact_spans_in_answer], sample.answer_span)
    return AttributionInput(sample_id, sample.text, sample.input_ids, sample.offsets, scored, masked, mask_id, fact,
                            groups, sample.question_span, sample.answer_span)


def corpus_input(sample_id: int, tokenizer, text: str, noun_spans: list[Span], mask_id: int,
                 fact_spans: list[Span] | None = None) -> AttributionInput:
    sample = encode_text(tokenizer, text)  # every token after BOS is scored: the labelled ones
    masked = overlapping(sample.offsets, noun_spans)
    scored = [label != IGNORE_INDEX for label in sample.labels]
    fact = overlapping(sample.offsets, fact_spans) if fact_spans is not None else None
    return AttributionInput(sample_id, text, sample.input_ids, sample.offsets, scored, masked, mask_id, fact,
                            noun_token_groups(sample.offsets, noun_spans), None, (0, len(text)))


def build_qa_inputs(rows: list[dict], tokenizer, template: PromptTemplate, tagger, mask_id: int,
                    facts: dict[str, list[Span]] | None = None,
                    row_indices: list[int] | None = None) -> list[AttributionInput]:
    """Tag the questions (in one batch), encode, and mask; `row_indices`: each row's index in the split."""
    indices = row_indices if row_indices is not None else list(range(len(rows)))
    spans = tagger.noun_spans([r["question"] for r in rows])
    out = []
    for i, row, nouns in zip(indices, rows, spans):
        sample = encode_qa(tokenizer, template, row["question"], row["answer"])
        fact = facts.get(row["question"]) if facts is not None else None
        out.append(qa_input(i, sample, nouns, mask_id, fact))
    return out


@dataclass
class Signals:
    """Per-token signals of one sample, full length; NaN where a position is not scored."""

    logp_orig: np.ndarray
    logp_mask: np.ndarray
    delta: np.ndarray
    entropy: np.ndarray
    phi: np.ndarray = field(default=None)
    hidden_prev: np.ndarray | None = None  # [scored, hidden]: the last hidden state that predicts each scored
    hidden_at: np.ndarray | None = None    # token, and the one at it (return_hidden; the learned scorer's input)
    teacher: tuple | None = None           # θ_o's top-k at each scored token (teacher_top_k): ids [scored, k],
    #                                        log-probs [scored, k], log tail mass [scored] (attribution/teacher.py)


def logp_and_entropy(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(target) and the entropy H = −Σ p log p = lse − Σ p·logit of softmax(logits), [N, vocab] -> [N], [N],
    from one exponentiation of the logits (the vocabulary-wide passes are most of attribution's extra time)."""
    top = logits.max(-1, keepdim=True).values
    e = (logits - top).exp()
    total = e.sum(-1)
    lse = top[:, 0] + total.log()
    return logits.gather(-1, targets[:, None])[:, 0] - lse, lse - (e * logits).sum(-1) / total


@torch.no_grad()
def score_batch(model, inputs: list[AttributionInput], pad_id: int, chunk_size: int = 1024,
                return_hidden: bool = False, teacher_top_k: int = 0) -> list[Signals]:
    """Both passes in one batch, without gradients; log-probabilities and entropy only at scored positions,
    `chunk_size` positions at a time, so memory stays bounded for large vocabularies. With `return_hidden`, the
    original pass's last hidden states at (and before) each scored token too. With `teacher_top_k` > 0, θ_o's
    top-k next-token distribution at each scored token from the same logits (`pipeline.attribution.teacher`)."""

    device = next(model.parameters()).device
    n = len(inputs)
    ids, attention = pad_ids([x.input_ids for x in inputs] + [x.masked_ids for x in inputs], pad_id)
    scored = torch.zeros((n, ids.shape[1]), dtype=torch.bool)
    for b, x in enumerate(inputs):
        scored[b, : len(x.scored)] = torch.tensor(x.scored)
    ids, attention = ids.to(device), attention.to(device)
    hidden = decoder(model)(input_ids=ids, attention_mask=attention).last_hidden_state
    rows, cols = scored.nonzero(as_tuple=True)
    rows, cols = rows.to(device), cols.to(device)
    targets = ids[rows, cols]
    lp_o, lp_m, ent, tea = [], [], [], []
    for start in range(0, len(rows), chunk_size):
        r, c, t = rows[start : start + chunk_size], cols[start : start + chunk_size], targets[start : start + chunk_size]
        logits = lm_head_logits(model, hidden[r, c - 1])
        logp, entropy = logp_and_entropy(logits, t)
        if teacher_top_k:
            tea.append(teacher_topk(logits, t, teacher_top_k))
        masked = lm_head_logits(model, hidden[r + n, c - 1])
        lp_o.append(logp)
        lp_m.append(masked.gather(-1, t[:, None])[:, 0] - torch.logsumexp(masked, -1))
        ent.append(entropy)
    lp_o_all, lp_m_all, ent_all = (torch.cat(v).double().cpu().numpy() if v else np.zeros(0) for v in (lp_o, lp_m, ent))
    out, pos = [], 0
    teacher = [torch.cat(v).cpu().numpy() for v in zip(*tea)] if tea else None
    rows_cpu = rows.cpu().numpy()
    cols_cpu = cols.cpu().numpy()
    for b, x in enumerate(inputs):
        k = int((rows_cpu == b).sum())
        where = cols_cpu[pos : pos + k]
        full = lambda v: scatter(len(x.input_ids), where, v[pos : pos + k])  # noqa: E731
        lo, lm, h = full(lp_o_all), full(lp_m_all), full(ent_all)
        signals = Signals(lo, lm, np.abs(lo - lm), h)
        if teacher is not None:
            signals.teacher = tuple(v[pos : pos + k] for v in teacher)
        if return_hidden:
            at = torch.as_tensor(where, device=device)
            signals.hidden_prev = hidden[b, at - 1].float().cpu().numpy()
            signals.hidden_at = hidden[b, at].float().cpu().numpy()
        out.append(signals)
        pos += k
    return out


def pad_ids(id_lists: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded input ids and their attention mask, [rows, longest]."""
    width = max(len(ids) for ids in id_lists)
    ids = torch.full((len(id_lists), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(id_lists), width), dtype=torch.long)
    for b, row in enumerate(id_lists):
        ids[b, : len(row)] = torch.tensor(row)
        attention[b, : len(row)] = 1
    return ids, attention


def scatter(length: int, positions, values) -> np.ndarray:
    """A full-length vector holding `values` at `positions` and NaN elsewhere (where a token is not scored)."""
    out = np.full(length, np.nan)
    out[positions] = values
    return out


def minmax(x: np.ndarray) -> np.ndarray:
    """Scale to [0, 1] within the vector; a constant vector (or a single value) maps to 0."""
    x = np.asarray(x, dtype=np.float64)
    if x.size == 0:
        return x
    lo, hi = x.min(), x.max()
    return (x - lo) / (hi - lo) if hi > lo else np.zeros_like(x)


def attribution_score(delta: np.ndarray, entropy: np.ndarray, alpha: float) -> np.ndarray:
    """φ = α·minmax(Δ) + (1−α)·minmax(H)."""
    if not 0.0 <= alpha <= 1.0:
        raise ParamError(f"alpha={alpha}: must be in [0, 1]")
    return alpha * minmax(delta) + (1.0 - alpha) * minmax(entropy)


def add_phi(signals: Signals, alpha: float) -> Signals:
    scored = ~np.isnan(signals.delta)
    phi = np.full(len(signals.delta), np.nan)
    phi[scored] = attribution_score(signals.delta[scored], signals.entropy[scored], alpha)
    signals.phi = phi
    return signals
