"""Stage one's params (`attribution`): which split or corpus, which signals, how φ mixes them, and the token that
replaces masked nouns."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.attribution.shards import ALTERNATIVES, SIGNAL_COLUMNS
from pipeline.attribution.tagging import DEFAULT_UPOS
from pipeline.common.errors import ParamError
from pipeline.common.params import Rule, at_least, between, check_rules, dataclass_from_params, one_of


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
    signals: list = field(default_factory=list)  # extra signals for the variants (pipeline/attribution/variants.py):
                                                 # copy, span, per_noun, grad_x_input, learned
    learned_split: str = "retain90"  # the learned scorer's training rows: QA a split of other authors; corpus:
                                     # the corpus's passages not of `split`'s authors (this value is not read)
    learned_max_samples: int = 500   # at most this many training rows (the first ones)
    alternatives: list = field(default_factory=list)  # alternative answers to add with θ_o's log-likelihood of
                                     # each, for IdkDPO, AltPO, IdkNLL (pipeline/attribution/alternatives.py): idk,
                                     # perturbed (QA mode); empty: none, the shards as without them
    alternatives_seed: int = 0       # which idk / perturbed answer each question gets (a fixed choice)
    teacher_top_k: int = 0           # > 0: θ_o's top-k next-token log-probabilities and tail mass at each scored
                                     # token, for UNDIAL (pipeline/attribution/teacher.py); 0: none, the shards as
                                     # without them

    @classmethod
    def from_params(cls, params: dict, where: str = "attribution") -> "AttributionConfig":
        cfg = dataclass_from_params(cls, params, where)
        rules = {"mode": one_of(["qa", "corpus"]), "tagger": one_of(["auto", "trankit", "spacy"]),
                 "alpha": between(0, 1), "batch_size": at_least(1), "chunk_size": at_least(1),
                 "rows_per_shard": at_least(1),
                 "upos": Rule(lambda v: bool(v) and all(isinstance(u, str) for u in v),
                              "a non-empty list of UPOS tags"),
                 "quality_r": Rule(lambda v: all(0 < r <= 1 for r in v), "a list of fractions in (0, 1]"),
                 "signals": Rule(lambda v: isinstance(v, list) and set(v) <= set(SIGNAL_COLUMNS)
                                 and len(set(v)) == len(v),
                                 f"a list of distinct signals from {sorted(SIGNAL_COLUMNS)}"),
                 "learned_max_samples": at_least(1), "teacher_top_k": at_least(0),
                 "alternatives": Rule(lambda v: isinstance(v, list) and set(v) <= set(ALTERNATIVES)
                                      and len(set(v)) == len(v),
                                      f"a list of distinct alternatives from {list(ALTERNATIVES)}")}
        check_rules(cfg, rules, where)
        if cfg.mode == "corpus" and not cfg.corpus:
            raise ParamError(f"{where}.corpus: corpus mode needs a file of passages (JSON Lines with `text`)")
        if cfg.mode == "corpus" and cfg.alternatives:
            raise ParamError(f"{where}.alternatives={cfg.alternatives!r}: alternative answers are answers to a "
                             "question; corpus mode has passages and no questions (set it to [])")
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
