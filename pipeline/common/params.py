"""Reading `params.yaml`: every stage reads its section here, and a bad value names its key.

A run's params are the file, then its overlays (files of changes, `--overlay configs/corpus.yaml`, in order), then
the command line's overrides (`-S unlearn.train.lr=1e-4`, the syntax of `dvc exp run -S`). Unknown sections and
unknown keys are errors, so a typo never runs with a default.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, TypeVar

import yaml

from pipeline.common.errors import ParamError
from pipeline.common.names import check_param_names

T = TypeVar("T")

# The sections a params file (or an overlay) may have.
SECTIONS = ("world", "tokenizer", "data", "model", "finetune", "check", "attribution", "reference", "unlearn",
            "evaluate", "relearn", "report", "tune", "sweep", "seeds", "ladder", "diagnosis")


class _Loader(yaml.SafeLoader):
    """YAML 1.2's floats: `1e-4` is a number, as DVC (ruamel) reads it; PyYAML's YAML 1.1 needs `1.0e-4`."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                |[-+]?\.(?:inf|Inf|INF)
                |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."))


def read_yaml(text: str):
    return yaml.load(text, Loader=_Loader)


def load_params(path: str | Path = "params.yaml", overlays: str | Path | Iterable[str | Path] | None = None,
                overrides: Iterable[str] = ()) -> dict:
    """The params file with its overlay files applied in order (see `apply_overlay`), then the `overrides`
    (`key.path=value`, the value read as YAML)."""
    params = _read_params(Path(path), "params file")
    check_sections(params, str(path))
    for overlay in [overlays] if isinstance(overlays, (str, Path)) else (overlays or ()):
        params = apply_overlay(params, overlay)
    for item in overrides:
        params = apply_override(params, item)
    check_param_names(params, str(path))
    return params


def check_sections(params: dict, where: str = "params") -> None:
    """Every top-level key is a known section."""
    for name, value in params.items():
        if name in SECTIONS:
            continue
        close = [s for s in SECTIONS if _similar(name, s)]
        if not close and isinstance(value, dict) and value and all(k in SECTIONS for k in value):
            raise ParamError(f"{where}: '{name}' looks like an overlay (changes to sections); overlays are files: "
                             f"move it to configs/{name}.yaml and pass --overlay configs/{name}.yaml")
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ParamError(f"{where}: unknown section '{name}'{hint}; sections are {list(SECTIONS)}")


def _similar(a: str, b: str) -> bool:
    import difflib

    return difflib.SequenceMatcher(None, a, b).ratio() >= 0.75


def read_overlay(path: str | Path) -> dict:
    """An overlay file: a mapping of changes to known sections (e.g. configs/corpus.yaml)."""
    path = Path(path)
    if not path.is_file():
        guess = Path("configs") / f"{path.name}.yaml"
        hint = f" (did you mean --overlay {guess}?)" if path.suffix == "" and guess.is_file() else \
            " (an overlay is a YAML file of changes to the params' sections, e.g. configs/corpus.yaml)"
        raise ParamError(f"--overlay {path}: no such file{hint}")
    overlay = _read_params(path, "overlay")
    unknown = sorted(set(overlay) - set(SECTIONS))
    if unknown:
        raise ParamError(f"{path}: unknown section(s) {unknown}; an overlay changes the sections {list(SECTIONS)}")
    return overlay


def apply_overlay(params: dict, overlay: str | Path | dict, where: str | None = None) -> dict:
    """The params with an overlay's changes merged in: a mapping merges key by key; a list, a scalar or null
    replaces (null switches a mapping param off). `{}` over a non-empty mapping would merge nothing, so it is an
    error that names null. `overlay`: a file, or its mapping (then `where` names it in errors)."""
    if not isinstance(overlay, dict):
        where, overlay = str(overlay), read_overlay(overlay)
    _check_no_empty_merges(params, overlay, where or "overlay", [])
    return _merged(params, overlay)


def _check_no_empty_merges(base: dict, changes: dict, where: str, keys: list[str]) -> None:
    for key, value in changes.items():
        old = base.get(key) if isinstance(base, dict) else None
        if value == {} and isinstance(old, dict) and old:
            dotted = ".".join(keys + [key])
            raise ParamError(f"{where}: {dotted}: {{}} merges nothing into the mapping it overlays; to switch it off "
                             f"write `{key}: null`, to replace it write the new mapping in full")
        if isinstance(value, dict) and isinstance(old, dict):
            _check_no_empty_merges(old, value, where, keys + [key])


def apply_override(params: dict, item: str) -> dict:
    """`key.path=value`: set one param, as `dvc exp run -S` does; the value is read as YAML (`1e-4`, `[0, 1]`,
    `{lr: 1e-4}`, `null`). The key's parent must exist; the key itself may be new (a new run, say)."""
    key, sep, text = item.partition("=")
    if not sep or not re.fullmatch(r"[\w-]+(\.[\w-]+)*", key.strip()):
        raise ParamError(f"-S {item!r}: expected KEY.PATH=VALUE, e.g. -S unlearn.train.lr=1e-4")
    try:
        value = read_yaml(text) if text.strip() else None
    except yaml.YAMLError as e:
        raise ParamError(f"-S {item!r}: the value is not YAML ({str(e).splitlines()[0]})") from None
    out = copy.deepcopy(params)
    *parents, last = key.strip().split(".")
    node = out
    for i, part in enumerate(parents):
        if not isinstance(node.get(part), dict):
            raise ParamError(f"-S {item!r}: params have no section '{'.'.join(parents[: i + 1])}'")
        node = node[part]
    node[last] = value
    return out


def _merged(base: dict, changes: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _read_params(path: Path, kind: str) -> dict:
    try:
        params = read_yaml(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ParamError(f"{path}: {kind} not found") from None
    except IsADirectoryError:
        raise ParamError(f"{path}: a directory, not a {kind}") from None
    except yaml.YAMLError as e:
        raise ParamError(f"{path}: malformed YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(params, dict):
        raise ParamError(f"{path}: expected a mapping at the top level")
    return params


def section(params: dict, dotted: str) -> Any:
    """`section(params, "finetune.train")`: the value at a dotted key, or an error naming the key."""
    node: Any = params
    seen = []
    for key in dotted.split("."):
        seen.append(key)
        if not isinstance(node, dict) or key not in node:
            raise ParamError(f"params: missing key '{'.'.join(seen)}'")
        node = node[key]
    return node


def check_keys(values: Any, known: Iterable[str], where: str) -> dict:
    """A mapping whose keys are all `known`; anything else is an error naming the key."""
    if not isinstance(values, dict):
        raise ParamError(f"{where}: expected a mapping, got {type(values).__name__}")
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ParamError(f"{where}: unknown key(s) {unknown} (known: {sorted(known)})")
    return values


def dataclass_from_params(cls: type[T], values: dict, where: str, origins: dict[str, str] | None = None) -> T:
    """Build a dataclass from a params mapping; unknown keys and wrong types are errors naming the key.

    `origins`: the full key each value was set at, where values were merged from several places (a run's
    `unlearn.runs.NAME.r` over `unlearn.defaults.r`); by default `where.NAME`."""
    if not isinstance(values, dict):
        raise ParamError(f"{where}: expected a mapping, got {type(values).__name__}")
    key_of = _key_namer(where, origins)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ParamError(f"{', '.join(key_of(k) for k in unknown)}: unknown parameter{'s' if len(unknown) > 1 else ''} "
                         f"(known: {sorted(fields)})")
    values = dict(values)
    for name, value in list(values.items()):
        if value is None and fields[name].default_factory is dict:
            values[name] = value = {}  # null switches a mapping param off (a LoRA spec, an attack), as {} does
        default = fields[name].default
        kinds = fields[name].metadata.get("types")  # a field that takes several kinds (a name or a mapping, say)
        if kinds is not None:
            if not isinstance(value, kinds) or isinstance(value, bool) and bool not in kinds:
                raise ParamError(f"{key_of(name)}={value!r}: expected {' or '.join(k.__name__ for k in kinds)}")
            continue
        if default is dataclasses.MISSING:  # a required field: its annotation, where that is a plain type
            annotation = fields[name].type
            expected = annotation if annotation in (int, float, str, bool, "int", "float", "str", "bool") else None
            expected = {"int": int, "float": float, "str": str, "bool": bool}.get(expected, expected)
        else:
            expected = type(default) if default is not None else None
        if expected is None:  # a list, a union, a default of None: the annotation says what fits
            hint = _type_hints(cls).get(name)
            if hint is not None and not _conforms(value, hint):
                raise ParamError(f"{key_of(name)}={value!r}: expected {_describe(hint)}")
            continue
        ok = isinstance(value, expected) and not (expected is not bool and isinstance(value, bool))
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            ok = True
        if not ok:
            raise ParamError(f"{key_of(name)}={value!r}: expected {expected.__name__}")
    try:
        return cls(**values)
    except TypeError as e:
        raise ParamError(f"{where}: {e}") from None


@functools.lru_cache(maxsize=None)  # resolved once per dataclass, not once per field and call
def _type_hints(cls) -> dict:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # an annotation that does not resolve here: fall back to the defaults' types
        return {}


def _conforms(value: Any, hint: Any) -> bool:
    """Whether `value` (as YAML gives it) fits the annotation `hint`: plain types, unions, lists, tuples, dicts
    and literals are checked, anything else passes. An int fits a float; a bool fits only bool."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if origin in (typing.Union, types.UnionType):
        return any(_conforms(value, arg) for arg in args)
    if origin is typing.Literal:
        return value in args
    if origin in (list, tuple, set, frozenset) or hint in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return False
        if origin is tuple and args and args[-1] is not Ellipsis:  # tuple[int, str]: one type per place
            return len(value) == len(args) and all(_conforms(v, a) for v, a in zip(value, args))
        return not args or all(_conforms(v, args[0]) for v in value)
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            return False
        return len(args) != 2 or all(_conforms(k, args[0]) and _conforms(v, args[1]) for k, v in value.items())
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(hint, type) and origin is None:
        return isinstance(value, hint)
    return True


def _describe(hint: Any) -> str:
    if isinstance(hint, type) and typing.get_origin(hint) is None:
        return hint.__name__
    return re.sub(r"\bNone(Type)?\b", "null", str(hint).replace("typing.", ""))  # YAML's word for None


def _key_namer(where: str, origins: dict[str, str] | None) -> Callable[[str], str]:
    return lambda name: (origins or {}).get(name, f"{where}.{name}")


@dataclass(frozen=True)
class Rule:
    """A check of one param: `ok(value)`, and what a valid value is, for the error ("in (0, 1]")."""

    ok: Callable[[Any], bool]
    expect: str


def between(lo: float, hi: float, lo_open: bool = False, hi_open: bool = False) -> Rule:
    left, right = "(" if lo_open else "[", ")" if hi_open else "]"
    return Rule(lambda v: (lo < v if lo_open else lo <= v) and (v < hi if hi_open else v <= hi),
                f"in {left}{lo:g}, {hi:g}{right}")


# A learning rate: the rule of every `train.lr`, and of every rate a tuning tries or an artifact hands on.
LEARNING_RATE = between(0, 1, lo_open=True, hi_open=True)


# A number param is finite: YAML's `.inf` passes `> 0`, and β = inf, say, would pass validation only to make the
# loss non-finite at step 1, blamed there on the learning rate.
def at_least(lo: float) -> Rule:
    return Rule(lambda v: v >= lo and math.isfinite(v), f"at least {lo:g} and finite")


def positive() -> Rule:
    return Rule(lambda v: v > 0 and math.isfinite(v), "positive and finite")


def one_of(options: Iterable) -> Rule:
    options = list(options)
    return Rule(lambda v: v in options, f"one of {options}")


def check_rules(cfg, rules: dict[str, Rule], where: str, origins: dict[str, str] | None = None) -> None:
    """Check each field of `cfg` named in `rules`; an error names the key where the value was set and the valid
    values, e.g. `unlearn.defaults.r=1.5: must be in (0, 1]`."""
    key_of = _key_namer(where, origins)
    for name, rule in rules.items():
        value = getattr(cfg, name)
        try:
            ok = rule.ok(value)
        except TypeError:  # a value of the wrong kind where the field has no typed default (a list, say)
            ok = False
        if not ok:
            raise ParamError(f"{key_of(name)}={value!r}: must be {rule.expect}")


def origins_of(**sources: dict) -> dict[str, str]:
    """{key: the dotted key it was set at}, for values merged from several mappings, later ones winning:
    `origins_of(**{"unlearn.defaults": defaults, "unlearn.runs.ga": spec})`."""
    out: dict[str, str] = {}
    for prefix, mapping in sources.items():
        for key in mapping or {}:
            out[key] = f"{prefix}.{key}"
    return out
