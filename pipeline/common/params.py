"""Reading `params.yaml`: every stage reads its section here, and a bad value names its key."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any, TypeVar

import yaml

from pipeline.common.errors import ParamError

T = TypeVar("T")


def load_params(path: str | Path = "params.yaml", overlay: str | None = None) -> dict:
    """The params file, with the overlay section `overlay` (if given) applied: see `apply_overlay`."""
    params = _read_params(Path(path))
    return apply_overlay(params, overlay, str(path)) if overlay else params


def apply_overlay(params: dict, name: str, where: str = "params") -> dict:
    """A variant of the params: section `name` holds changes to the other sections, merged into them (a mapping
    merges key by key; a list, scalar or null replaces), e.g. `corpus: {unlearn: {train: {epochs: 20}}}`."""
    overlay = params.get(name)
    if not isinstance(overlay, dict) or not overlay:
        raise ParamError(f"{where}: no overlay section '{name}' (a mapping of the sections' changes)")
    unknown = sorted(set(overlay) - set(params))
    if unknown:
        raise ParamError(f"{where}: overlay '{name}' changes sections {unknown} that the params do not have")
    return _merged(params, overlay)


def _merged(base: dict, changes: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _read_params(path: Path) -> dict:
    try:
        params = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ParamError(f"{path}: params file not found") from None
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


def dataclass_from_params(cls: type[T], values: dict, where: str) -> T:
    """Build a dataclass from a params mapping; unknown keys and wrong types are errors naming the key."""
    if not isinstance(values, dict):
        raise ParamError(f"{where}: expected a mapping, got {type(values).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ParamError(f"{where}: unknown parameter(s) {unknown} (known: {sorted(fields)})")
    for name, value in values.items():
        default = fields[name].default
        if default is dataclasses.MISSING:  # a required field: its annotation, where that is a plain type
            annotation = fields[name].type
            expected = annotation if annotation in (int, float, str, bool) else None
        else:
            expected = type(default) if default is not None else None
        if expected is None:
            continue
        ok = isinstance(value, expected) and not (expected is not bool and isinstance(value, bool))
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            ok = True
        if not ok:
            raise ParamError(f"{where}.{name}={value!r}: expected {expected.__name__}")
    try:
        return cls(**values)
    except TypeError as e:
        raise ParamError(f"{where}: {e}") from None
