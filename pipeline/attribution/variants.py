"""Attribution variants beyond the paper's φ: named scores, and the extra signals stage one computes
for them.

A variant is a base score with optional modifiers, written `base[+nocopy][+span]`, e.g. `phi+nocopy+span`.
Every score is computed per sample over its scored tokens, as φ is, from columns of the shards, so stage two
and the quality measures recompute any of them from the shards with their own α.

Bases (the extra cost of computing them in stage one, beyond the paper's two passes):
  phi           α·minmax(Δ) + (1−α)·minmax(H), the paper's; the default                          (none)
  delta         minmax(Δ), entropy: minmax(H); the two parts of φ alone                          (none)
  signed        φ with Δ⁺ = max(0, log p − log p_masked): only where the context raises the token (none)
  noun_min      φ with Δ from masking each noun of the prompt on its own: the minimum of |Δ| over the nouns;
  noun_max      noun_max the maximum                          (signal per_noun: one forward pass per noun)
  grad_x_input  minmax(|e_i · ∂(Σ_answer log p)/∂e_i|), gradient × input at each answer token's embedding
                                                            (signal grad_x_input: one forward and backward)
  learned       a logistic scorer over θ_o's hidden states (the one predicting the token and the token's own)
                and the signals, trained on annotated facts of other authors (attribution.learned_split)
                                                     (signal learned: both passes over its training rows)
Controls, the bounds a variant sits between (never measured or chosen as a variant):
  random        i.i.d. uniform scores, drawn in stage two from the unlearning seed and the sample (`draw`): the
                same token budget as any score (r, τ), its tokens chosen blindly                  (none)
  oracle        1 on the world's fact tokens, 0 elsewhere: the ground truth       (data with fact annotations)
  etw           H itself (nats): ETW's entropy-guided weights, with the weighting `proportional` (none)
  answer_nouns  1 on the answer's noun and proper-noun tokens, 0 elsewhere       (signal nouns: one tagger call
                                                                                      per answer)
Modifiers, applied in this order:
  +nocopy       tokens of a word that occurs in the prompt (QA: the question; corpus: earlier in the passage)
                score 0: the subject the answer repeats is not the fact            (signal copy: text only)
  +span         every token takes the highest score of its span: a phrase of adjacent content words (the
                tagger's NOUN, PROPN, NUM, ADJ), else its word, so a multi-token fact is weighted whole. After
                +nocopy it pools the discounted scores: a copied word inside a phrase of other content words
                ("author Ann Lee") takes the phrase's score   (signal span: one tagger call per answer)
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from pipeline.attribution.shards import SIGNAL_COLUMNS
from pipeline.attribution.signals import AttributionInput, Span, attribution_score, minmax, pad_ids, scatter
from pipeline.common.errors import DataError, ParamError
from pipeline.common.modeling import decoder, lm_head_logits

CONTENT_UPOS = ("NOUN", "PROPN", "NUM", "ADJ")  # the words a fact phrase is made of (span pooling)
ANSWER_NOUN_UPOS = ("NOUN", "PROPN")             # what answer-noun weighting weighs

ScoreFn = Callable[[dict, float], np.ndarray]   # (the sample's scored-token columns, α) -> a score per token


def _phi_with(column: str) -> ScoreFn:
    return lambda c, alpha: attribution_score(c[column], c["entropy"], alpha)


def _signed(c: dict, alpha: float) -> np.ndarray:
    return attribution_score(np.maximum(0.0, c["logp_orig"] - c["logp_mask"]), c["entropy"], alpha)


# base name -> (the columns it reads, besides delta and entropy; the score)
BASES: dict[str, tuple[tuple[str, ...], ScoreFn]] = {
    "phi": ((), _phi_with("delta")),
    "delta": ((), lambda c, alpha: minmax(c["delta"])),
    "entropy": ((), lambda c, alpha: minmax(c["entropy"])),
    "signed": (("logp_orig", "logp_mask"), _signed),
    "noun_min": (("delta_noun_min",), _phi_with("delta_noun_min")),
    "noun_max": (("delta_noun_max",), _phi_with("delta_noun_max")),
    "grad_x_input": (("grad_x_input",), lambda c, alpha: minmax(c["grad_x_input"])),
    "learned": (("learned",), lambda c, alpha: np.asarray(c["learned"], dtype=np.float64)),
    # the ground truth itself (1 on the world's fact tokens): a diagnostic upper bound on attribution, for data
    # with fact annotations only; never among the variants measured or chosen (available_scores)
    "oracle": (("fact",), lambda c, alpha: np.asarray(c["fact"], dtype=np.float64)),
    # the control at the same token budget: i.i.d. uniform scores, drawn per unlearning seed and sample (`draw`)
    "random": (("random",), lambda c, alpha: np.asarray(c["random"], dtype=np.float64)),
    # ETW's (Koh et al., 2026): the entropy of θ_o's next-token distribution itself, in nats, with the weighting
    # `proportional` (ω ∝ H); its ranking is minmax(H)'s, so under hard weights it selects what `entropy` does
    "etw": ((), lambda c, alpha: np.asarray(c["entropy"], dtype=np.float64)),
    # answer-noun weighting: 1 on the tokens of the answer's nouns and proper nouns (stage one's tagger), 0 elsewhere
    "answer_nouns": (("answer_noun",), lambda c, alpha: np.asarray(c["answer_noun"], dtype=np.float64)),
}
# the bounds and the published baseline a variant is judged against, never a variant measured or chosen
CONTROL_BASES = ("oracle", "random", "etw", "answer_nouns")
DRAWN = ("random",)  # columns drawn at training time, not read from the shards
RANDOM_STREAM = 0x52414E44  # keeps the random control's draws apart from any other use of the unlearning seed
MODIFIERS: dict[str, str] = {"nocopy": "copied", "span": "span"}  # modifier -> the column it reads, in the
                                                                   # order they apply (and must be written)


def parse_score(name: str, where: str = "score") -> tuple[str, tuple[str, ...]]:
    """`base+mod+mod` -> (base, modifiers in the order given); a clear error for anything else."""
    base, *mods = str(name).split("+")
    if base not in BASES:
        raise ParamError(f"{where}={name!r}: unknown base score {base!r} (choose from {sorted(BASES)}, "
                         f"optionally with {['+' + m for m in MODIFIERS]}, e.g. 'phi+nocopy+span')")
    for m in mods:
        if m not in MODIFIERS:
            raise ParamError(f"{where}={name!r}: unknown modifier {m!r} (choose from {sorted(MODIFIERS)})")
    if len(set(mods)) != len(mods):
        raise ParamError(f"{where}={name!r}: a modifier is repeated")
    order = [m for m in MODIFIERS if m in mods]
    if mods != order:
        raise ParamError(f"{where}={name!r}: modifiers apply in the order {'+'.join(MODIFIERS)}; write "
                         f"{'+'.join([base, *order])!r}")
    return base, tuple(mods)


def score_columns(name: str) -> tuple[str, ...]:
    """The shard columns (besides delta, entropy and scored) that score `name` reads."""
    base, mods = parse_score(name)
    return tuple(c for c in dict.fromkeys([*BASES[base][0], *(MODIFIERS[m] for m in mods)]) if c not in DRAWN)


def draw(name: str, seed: int, sample_id: int, n: int) -> dict[str, np.ndarray]:
    """The drawn columns score `name` reads, for one sample's `n` scored tokens: the random control's uniform
    scores come from (the unlearning seed, the sample), so each unlearning seed selects its own tokens, the same ones
    on a rerun, in any process and batch order."""
    base, _ = parse_score(name)
    if "random" not in BASES[base][0]:
        return {}
    return {"random": np.random.default_rng([RANDOM_STREAM, int(seed), int(sample_id)]).random(n)}


def signals_for(name: str) -> list[str]:
    """The stage-one signals (attribution.signals) whose columns score `name` needs."""
    needed = set(score_columns(name))
    return [s for s, cols in SIGNAL_COLUMNS.items() if needed & set(cols)]


def require_columns(name: str, have, where) -> None:
    """Refuse score `name` where the shards (columns `have`) lack what it reads, naming the signal to compute."""
    missing = [c for c in score_columns(name) if c not in have]
    if missing:
        raise DataError(f"{where}: score {name!r} reads {missing}, which these shards lack; rerun `attribute` with "
                        f"attribution.signals including {signals_for(name)}")


def variant_score(name: str, columns: dict, alpha: float) -> np.ndarray:
    """Score `name` of one sample's scored tokens; `columns` holds each column restricted to them."""
    base, mods = parse_score(name)
    score = BASES[base][1](columns, alpha)
    for m in mods:
        score = MODIFY[m](score, np.asarray(columns[MODIFIERS[m]]))
    return score


def exclude_copied(score: np.ndarray, copied: np.ndarray) -> np.ndarray:
    """Copied tokens score 0, below every other (scores are in [0, 1])."""
    return np.where(copied.astype(bool), 0.0, score)


def pool_spans(score: np.ndarray, span: np.ndarray) -> np.ndarray:
    """Each token takes the maximum score of the tokens with its span id (-1: a token of its own)."""
    out = score.copy()
    for group in np.unique(span[span >= 0]):
        inside = span == group
        out[inside] = score[inside].max()
    return out


MODIFY = {"nocopy": exclude_copied, "span": pool_spans}


def available_scores(columns: set[str]) -> list[str]:
    """Every variant the shards' columns allow: each base, alone and with each set of the modifiers whose
    columns exist (in their order)."""
    mods = [m for m, col in MODIFIERS.items() if col in columns]
    combos = [c for k in range(len(mods) + 1) for c in itertools.combinations(mods, k)]
    return ["+".join([base, *combo]) for base, (cols, _) in BASES.items()
            if set(cols) <= columns and base not in CONTROL_BASES for combo in combos]


# --- signals from the text: copied tokens and spans ---------------------------------------------------------

WORD_RE = re.compile(r"\w+")


def _words(text: str) -> list[tuple[int, int, str]]:
    return [(m.start(), m.end(), m.group().lower()) for m in WORD_RE.finditer(text)]


def token_words(offsets: list[Span], words: list[tuple[int, int, str]]) -> list[list[int]]:
    """The indices of the words each token overlaps (tokens and words both in text order)."""
    out, first = [], 0
    for start, end in offsets:
        if end <= start:  # a special token (empty offsets, possibly (len, len) mid-text): no words, pointer kept
            out.append([])
            continue
        while first < len(words) and words[first][1] <= start:
            first += 1
        mine, j = [], first
        while j < len(words) and words[j][0] < end:
            mine.append(j)
            j += 1
        out.append(mine)
    return out


def copied_tokens(x: AttributionInput) -> list[bool]:
    """Tokens of a word seen in the prompt: in QA mode the question (`x.prompt`), in corpus mode (None) the
    passage before the word. Special tokens and punctuation are never copied."""
    words = _words(x.text)
    if x.prompt is not None:
        seen = {w for s, e, w in words if s >= x.prompt[0] and e <= x.prompt[1]}
        return [any(words[j][2] in seen for j in mine) for mine in token_words(x.offsets, words)]
    first: dict[str, int] = {}
    for j, (_, _, w) in enumerate(words):
        first.setdefault(w, j)
    return [any(first[words[j][2]] < j for j in mine) for mine in token_words(x.offsets, words)]


def phrase_spans(content_spans: list[Span], text: str) -> list[Span]:
    """Adjacent content words (separated by spaces only) joined into phrases."""
    out: list[list[int]] = []
    for s, e in sorted(content_spans):
        if out and s >= out[-1][1] and text[out[-1][1] : s].strip(" ") == "":
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def tokens_in(x: AttributionInput, spans: list[Span]) -> list[bool]:
    """Whether each token overlaps one of `spans` (character spans of `x.text`)."""
    return [bool(hit) for hit in token_words(x.offsets, [(s, e, "") for s, e in sorted(spans)])]


def span_ids(x: AttributionInput, phrases: list[Span]) -> list[int]:
    """Each token's span id: the phrase it overlaps, else its first word (ids after the phrases'), else -1."""
    words = _words(x.text)
    as_words = [(s, e, "") for s, e in phrases]
    in_phrase = token_words(x.offsets, as_words)
    return [p[0] if p else (len(phrases) + w[0] if w else -1)
            for p, w in zip(in_phrase, token_words(x.offsets, words))]


# --- signals from extra passes ------------------------------------------------------------------------------

@torch.no_grad()
def scored_logp(model, id_lists: list[list[int]], targets: list[list[int]], scored: list[list[bool]], pad_id: int,
                chunk_size: int = 1024) -> list[np.ndarray]:
    """log p(targets[b][i] | id_lists[b][<i]) at each scored position i of each row (one forward pass)."""
    device = next(model.parameters()).device
    ids, attention = pad_ids(id_lists, pad_id)
    hidden = decoder(model)(input_ids=ids.to(device), attention_mask=attention.to(device)).last_hidden_state
    out = []
    for b, (tgt, sc) in enumerate(zip(targets, scored)):
        cols = torch.tensor([i for i, s in enumerate(sc) if s], dtype=torch.long, device=device)
        t = torch.tensor(tgt, device=device)[cols]
        values = []
        for start in range(0, len(cols), chunk_size):
            c = cols[start : start + chunk_size]
            logits = lm_head_logits(model, hidden[b, c - 1])
            values.append(logits.gather(-1, t[start : start + chunk_size, None])[:, 0] - torch.logsumexp(logits, -1))
        out.append(torch.cat(values).double().cpu().numpy() if values else np.zeros(0))
    return out


def per_noun_deltas(model, inputs: list[AttributionInput], logp_orig: list[np.ndarray], pad_id: int,
                    batch_size: int, chunk_size: int = 1024) -> list[tuple[np.ndarray, np.ndarray]]:
    """(min, max) over the prompt's nouns of |log p − log p with only that noun masked|, at the scored tokens
    (full length, NaN elsewhere); a sample without nouns gets 0 (its Δ is 0 too). One pass per noun."""
    jobs = [(b, noun) for b, x in enumerate(inputs) for noun in x.noun_tokens]
    deltas: list[list[np.ndarray]] = [[] for _ in inputs]
    for start in range(0, len(jobs), batch_size):
        part = jobs[start : start + batch_size]
        ids = []
        for b, noun in part:
            row = list(inputs[b].input_ids)
            for i in noun:
                row[i] = inputs[b].mask_id
            ids.append(row)
        logps = scored_logp(model, ids, [inputs[b].input_ids for b, _ in part], [inputs[b].scored for b, _ in part],
                            pad_id, chunk_size)
        for (b, _), lp in zip(part, logps):
            deltas[b].append(np.abs(logp_orig[b][np.flatnonzero(inputs[b].scored)] - lp))
    out = []
    for x, ds in zip(inputs, deltas):
        where = np.flatnonzero(x.scored)
        stacked = np.stack(ds) if ds else np.zeros((1, len(where)))
        out.append((scatter(len(x.input_ids), where, stacked.min(0)), scatter(len(x.input_ids), where, stacked.max(0))))
    return out


def gradient_x_input(model, inputs: list[AttributionInput], pad_id: int, chunk_size: int = 1024) -> list[np.ndarray]:
    """|e_i · ∂(Σ_scored log p)/∂e_i| at each scored token i, e_i its input embedding (one forward and backward)."""
    device = next(model.parameters()).device
    ids, attention = pad_ids([x.input_ids for x in inputs], pad_id)
    ids, attention = ids.to(device), attention.to(device)
    scored = torch.zeros_like(ids, dtype=torch.bool)
    for b, x in enumerate(inputs):
        scored[b, : len(x.scored)] = torch.tensor(x.scored, device=device)
    rows, cols = scored.nonzero(as_tuple=True)
    with torch.enable_grad():
        embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
        hidden = decoder(model)(inputs_embeds=embeds, attention_mask=attention).last_hidden_state
        total = hidden.new_zeros((), dtype=torch.float32)
        for start in range(0, len(rows), chunk_size):
            r, c = rows[start : start + chunk_size], cols[start : start + chunk_size]
            logits = lm_head_logits(model, hidden[r, c - 1])
            total = total + (logits.gather(-1, ids[r, c][:, None])[:, 0] - torch.logsumexp(logits, -1)).sum()
        (grad,) = torch.autograd.grad(total, embeds)
    gx = (grad.float() * embeds.detach().float()).sum(-1).abs().cpu().numpy()
    return [scatter(len(x.input_ids), np.flatnonzero(x.scored), gx[b, np.flatnonzero(x.scored)])
            for b, x in enumerate(inputs)]


# --- the learned scorer -------------------------------------------------------------------------------------

@dataclass
class LearnedScorer:
    """Logistic regression over standardized features: θ_o's last hidden state before the token (the one that
    predicts it) and at the token, Δ, H and log p. Trained with L-BFGS (deterministic) and an L2 penalty."""

    mean: torch.Tensor
    std: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor

    @staticmethod
    def features(hidden_prev: np.ndarray, hidden_at: np.ndarray, delta: np.ndarray, entropy: np.ndarray,
                 logp_orig: np.ndarray) -> np.ndarray:
        return np.concatenate([hidden_prev, hidden_at, np.stack([delta, entropy, logp_orig], 1)], 1)

    @classmethod
    def features_of(cls, signals, scored) -> np.ndarray:
        """The features of one sample's scored tokens, from its Signals (score_batch with return_hidden)."""
        sc = np.asarray(scored, dtype=bool)
        return cls.features(signals.hidden_prev, signals.hidden_at, signals.delta[sc], signals.entropy[sc],
                            signals.logp_orig[sc])

    @classmethod
    def fit(cls, features: np.ndarray, labels: np.ndarray, l2: float = 1e-2, steps: int = 200) -> "LearnedScorer":
        if labels.size == 0 or labels.all() or not labels.any():
            raise DataError("learned scorer: its training tokens need both fact and non-fact tokens "
                            f"({int(labels.sum())} of {labels.size} are facts)")
        x = torch.tensor(features, dtype=torch.float64)
        y = torch.tensor(labels, dtype=torch.float64)
        mean, std = x.mean(0), x.std(0).clamp_min(1e-6)
        x = (x - mean) / std
        w = torch.zeros(x.shape[1], dtype=torch.float64, requires_grad=True)
        b = torch.zeros((), dtype=torch.float64, requires_grad=True)
        opt = torch.optim.LBFGS([w, b], lr=1.0, max_iter=steps, line_search_fn="strong_wolfe")

        def closure():
            opt.zero_grad()
            loss = torch.nn.functional.binary_cross_entropy_with_logits(x @ w + b, y) + l2 * (w * w).sum()
            loss.backward()
            return loss

        opt.step(closure)
        return cls(mean, std, w.detach(), b.detach())

    def predict(self, features: np.ndarray) -> np.ndarray:
        x = (torch.tensor(features, dtype=torch.float64) - self.mean) / self.std
        return torch.sigmoid(x @ self.weight + self.bias).numpy()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"mean": self.mean, "std": self.std, "weight": self.weight, "bias": self.bias.reshape(1)}
