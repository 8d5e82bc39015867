"""The sets of `evaluate.multiple_choice`: each set's spec, checked (`check_mc_spec`), and its items, loaded by its
format's benchmark module (`load_mc_sets`). A new benchmark is a loader in `pipeline/data` and one `MC_FORMATS`
entry here; it is scored as every other (`mc_scoring.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from pipeline.common.errors import ParamError
from pipeline.common.params import check_keys
from pipeline.data.mc_items import MCItem
from pipeline.data.mmlu import load_mmlu
from pipeline.data.wmdp import WMDP_SUBJECTS, load_wmdp
from pipeline.data.world_mc import world_mc_sets
from pipeline.evaluation.mc_scoring import SCORINGS

MC_KEY = "evaluate.multiple_choice"  # where the sets' specs live, for messages of the loaders

# The keys every format's spec may have: format, source, scoring (letter | cloze), add_bos_token (letter scoring;
# null: the tokenizer's default, as lm-eval >= 0.4.9.2; true/false force it, as lm-eval's model arg) and max_length
# (null: the model's, resolved as lm-eval does).
MC_COMMON_KEYS = ("format", "source", "scoring", "add_bos_token", "max_length")


@dataclass(frozen=True)
class MCFormat:
    """A benchmark's format: the spec keys it adds to MC_COMMON_KEYS, and its loader (the entry's name, its spec,
    evaluate.forget_split and evaluate.seed) -> {set name: items}."""

    keys: tuple[str, ...]
    load: Callable[[str, dict, str, int], dict[str, list[MCItem]]]


def _world_sets(name: str, spec: dict, forget_split: str, seed: int) -> dict[str, list[MCItem]]:
    sets = world_mc_sets(spec["source"], spec.get("split", forget_split), seed)
    return {f"{name}_{part}": items for part, items in sets.items()}


MC_FORMATS: dict[str, MCFormat] = {
    # the embedded world: forget authors' facts (WMDP's role), retained ones, world facts
    "world": MCFormat(("split",), _world_sets),
    "wmdp": MCFormat(("config", "subject"), lambda name, spec, forget_split, seed: {
        name: load_wmdp(spec["source"], spec.get("config"), spec.get("subject"), f"{MC_KEY}.{name}")}),
    "mmlu": MCFormat(("subjects",), lambda name, spec, forget_split, seed: {
        name: load_mmlu(spec["source"], spec.get("subjects"), f"{MC_KEY}.{name}.subjects")}),
}

# Key -> (is a set value valid, what it must be); null is "not set" for each.
MC_SPEC_RULES: dict[str, tuple[Callable[[object], bool], str]] = {
    "config": (lambda v: v in WMDP_SUBJECTS, f"one of {sorted(WMDP_SUBJECTS)}"),
    "subject": (lambda v: isinstance(v, str) and bool(v.strip()),
                "a non-empty string: the prompt's 'about ...' phrase, e.g. biology"),
    "subjects": (lambda v: isinstance(v, list) and bool(v) and all(isinstance(s, str) and s.strip() for s in v),
                 "a non-empty list of MMLU subjects, e.g. [anatomy, virology]"),
    "add_bos_token": (lambda v: isinstance(v, bool), "null (the tokenizer's default), true or false"),
    "max_length": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
                   "null (the model's) or a positive integer"),
}


def check_mc_spec(spec, where: str) -> None:
    """One multiple-choice set's spec: its format, its keys (unknown ones refused) and their values."""
    if not isinstance(spec, dict) or spec.get("format") not in MC_FORMATS:
        raise ParamError(f"{where}: needs format: one of {sorted(MC_FORMATS)}")
    check_keys(spec, (*MC_COMMON_KEYS, *MC_FORMATS[spec["format"]].keys), where)
    if not spec.get("source"):
        raise ParamError(f"{where}: needs source (a file, directory or hub name)")
    scoring = spec.get("scoring", "letter")
    if not isinstance(scoring, str) or scoring not in SCORINGS:
        raise ParamError(f"{where}.scoring: {scoring!r} is unknown (choose from {sorted(SCORINGS)})")
    for key, (valid, what) in MC_SPEC_RULES.items():
        if spec.get(key) is not None and not valid(spec[key]):
            raise ParamError(f"{where}.{key}: {spec[key]!r} is invalid: must be {what}")
    if scoring == "cloze" and spec.get("add_bos_token") is not None:
        raise ParamError(f"{where}.add_bos_token: applies to letter scoring only (cloze scoring encodes each "
                         "prompt as the training template does); remove it")


def load_mc_sets(specs: dict[str, dict], forget_split: str, seed: int) -> dict[str, tuple[dict, list[MCItem]]]:
    """Every set of `evaluate.multiple_choice` ({name: spec}, checked): {set name: (its spec, its items)}; a
    `world` entry gives three sets, NAME_forget, NAME_retain and NAME_world_facts."""
    return {set_name: (spec, items) for name, spec in specs.items()
            for set_name, items in MC_FORMATS[spec["format"]].load(name, spec, forget_split, seed).items()}
