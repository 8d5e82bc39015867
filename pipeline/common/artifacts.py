"""Values one stage writes and another reads (a tuning's chosen rate, a target's model utility) pass the same
checks as the param they stand for: a hand-edited or stale artifact is refused where it is read, with the file and
the key, never handed on to the optimizer or a report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.common.errors import DataError
from pipeline.common.params import Rule


def read_json(path: str | Path, what: str, fix: str) -> Any:
    """The JSON artifact at `path` (`what` it is, for the error; `fix`: how to make it), or a DataError that tells a
    missing file from one that is not JSON (with its line and column)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"{path}: no {what} to read (no such file); {fix}") from None
    except IsADirectoryError:
        raise DataError(f"{path}: a directory, not {what} (a JSON file)") from None
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: the {what} is not UTF-8 text (byte {e.start}); {fix}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: the {what} is not JSON ({e.msg} at line {e.lineno}, column {e.colno}); "
                        f"{fix}") from None


def value_at(data: Any, path: str | Path, key: str, rule: Rule | None = None, param: str | None = None) -> Any:
    """`data[k1][k2]...` for the dotted `key` of the artifact read from `path`, checked by `rule` (the rule of
    `param`, named in the error so that the user sees which setting the value would have been)."""
    value = data
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            raise DataError(f"{path}: no {key} in it")
        value = value[part]
    if rule is not None:
        try:
            ok = not isinstance(value, bool) and rule.ok(value)
        except TypeError:
            ok = False
        if not ok:
            as_param = f" (as {param})" if param else ""
            raise DataError(f"{path}: {key}={value!r}: must be {rule.expect}{as_param}")
    return value
