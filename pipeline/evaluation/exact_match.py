"""The exact-match check of finetuned models: how many questions of each split a model answers exactly (greedy)."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.common.modeling import load_model, load_tokenizer
from pipeline.common.params import Rule, at_least, check_rules, dataclass_from_params
from pipeline.data.config import DataConfig
from pipeline.data.templates import get_template
from pipeline.data.tofu import load_split
from pipeline.evaluation.generation import exact_match, greedy_answers


@dataclass(frozen=True)
class CheckConfig:
    splits: list
    max_new_tokens: int = 64
    batch_size: int = 64

    @classmethod
    def from_params(cls, values: dict, where: str = "check") -> "CheckConfig":
        cfg = dataclass_from_params(cls, values, where)
        splits = Rule(lambda v: isinstance(v, list) and v and all(isinstance(s, str) for s in v),
                      "a non-empty list of split names")
        check_rules(cfg, {"splits": splits, "max_new_tokens": at_least(1), "batch_size": at_least(1)}, where)
        return cfg


def exact_match_rates(model_dir: str, data: DataConfig, cfg: CheckConfig) -> dict[str, float]:
    """{split: the share of its questions whose greedy answer equals the gold answer up to whitespace}."""
    rows_by_split = {split: load_split(data.source, split) for split in cfg.splits}  # every input before the model
    model, tokenizer = load_model(model_dir), load_tokenizer(model_dir)
    template = get_template(data.template)
    rates = {}
    for split, rows in rows_by_split.items():
        answers = greedy_answers(model, tokenizer, template, [r["question"] for r in rows], cfg.max_new_tokens,
                                 cfg.batch_size)
        rates[split] = round(sum(exact_match(a, r["answer"]) for a, r in zip(answers, rows)) / len(rows), 4)
    return rates
