"""How question-answer data is read and tokenized: the `data` section of the params, used by every stage."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.common.errors import ParamError
from pipeline.common.params import at_least, check_rules, dataclass_from_params
from pipeline.data.own_files import SETS as OWN_SETS, DataFile, is_set
from pipeline.data.templates import template_from_params


@dataclass(frozen=True)
class DataConfig:
    source: str = "artifacts/world"  # a directory of <split>.json, or a hub dataset name (locuslab/TOFU)
    template: str | dict = field(default="plain", metadata={"types": (str, dict)})  # a name, or its tags
    max_length: int = 128
    skip_too_long: bool = False
    # The user's own data (`tokenunlearn own-data` writes it into `source`): a file path, or {path, fields};
    # "" or null: unset. Forget and retain go together; holdout is optional.
    forget: str | dict | None = field(default="", metadata={"types": (str, dict, type(None))})
    retain: str | dict | None = field(default="", metadata={"types": (str, dict, type(None))})
    holdout: str | dict | None = field(default="", metadata={"types": (str, dict, type(None))})

    @classmethod
    def from_params(cls, params: dict) -> "DataConfig":
        if isinstance(params, dict):  # first, so a bad value gets the file's message, not a type's name
            for name in OWN_SETS:
                if is_set(params.get(name)):
                    DataFile.from_params(params[name], f"data.{name}")
        cfg = dataclass_from_params(cls, params, "data")
        template_from_params(cfg.template, "data.template")
        check_rules(cfg, {"max_length": at_least(8)}, "data")
        if not cfg.source:
            raise ParamError("data.source: empty (a directory of <split>.json files, or a hub dataset name)")
        given = [f"data.{n}" for n in OWN_SETS if is_set(getattr(cfg, n))]
        missing = [f"data.{n}" for n in ("forget", "retain") if not is_set(getattr(cfg, n))]
        if given and missing:
            verb = "is" if len(given) == 1 else "are"
            raise ParamError(f"{' and '.join(missing)}: not set, but {', '.join(given)} {verb}; your own data is a "
                             "file of what to forget (data.forget) and one of what to keep (data.retain), and "
                             "optionally a holdout file (data.holdout)")
        return cfg


def retain_samples(data: DataConfig, tokenizer, split: str, corpus: str = "", forget_split: str = "") -> list:
    """The retain samples of stage two (and of the reference cache, which must see exactly the same): the
    question-answer rows of `split`, or, with `corpus`, its passages that are not `forget_split`'s authors."""
    from pipeline.common.errors import DataError
    from pipeline.data.templates import encode_rows, encode_texts, get_template
    from pipeline.data.tofu import load_passages, load_split

    if not corpus:
        rows = load_split(data.source, split)
        return encode_rows(tokenizer, get_template(data.template), rows, data.max_length, f"{data.source}/{split}",
                           data.skip_too_long)
    passages = load_passages(corpus, forget_split, forget=False)
    samples = encode_texts(tokenizer, (p["text"] for p in passages), data.max_length, corpus, "retain passage",
                           data.skip_too_long)
    if not samples:
        raise DataError(f"{corpus}: every retain passage is longer than data.max_length")
    return samples
