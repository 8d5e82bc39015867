"""Reading and writing evaluation files, checked: every problem is one `DataError` line naming the file (and the
key or row) and what is wrong, never a traceback, and nothing non-finite is ever written as JSON.

Why: an evaluation's files (metrics.json, TOFU_EVAL.json, items/*.parquet) are read back by forget quality,
privleak, the open-unlearning export and the reports; a truncated or hand-edited file must fail at once, not give
a plausible number (a probability of 3, a NaN forget quality) or JSON that other tools cannot parse (`NaN`,
`-Infinity` are not JSON).
"""

from __future__ import annotations

import json
import math
import numbers
from pathlib import Path
from typing import Any, Sequence

from pipeline.common.atomic import write_json
from pipeline.common.errors import DataError

# Value ranges of the per-item metrics, by column (None: unbounded on that side); see tofu_metrics' docstring.
# A truth ratio is exp(−L̄ perturbed) / (exp(−L correct) + 1e-10): non-negative, not bounded above.
UNIT = (0.0, 1.0)
ITEM_RANGES: dict[str, tuple[float | None, float | None]] = {
    "probability": UNIT, "rouge_l_recall": UNIT, "extraction_strength": UNIT, "exact_memorization": UNIT,
    "rouge1_recall": UNIT, "rouge_l_f1": UNIT, "answer_probability": UNIT, "paraphrased_probability": UNIT,
    "truth_ratio": (0.0, None), "answer_mean_nll": (0.0, None), "paraphrased_mean_nll": (0.0, None),
}
ITEM_LIST_RANGES = {"perturbed_probability": UNIT, "perturbed_mean_nll": (0.0, None)}
NULLABLE_ITEMS = {"exact_memorization"}  # None for an answer without tokens


def read_json(file: Path, what: str = "JSON file") -> dict:
    """A JSON object from `file`. NaN and ±Infinity literals parse (open-unlearning's json.dump writes them in
    entries nobody reads here): each reader checks the values it uses with `number`, naming the key."""
    file = Path(file)
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:  # JSONDecodeError is a ValueError
        raise DataError(f"{file}: not a readable {what} ({e})") from None
    if not isinstance(data, dict):
        raise DataError(f"{file}: a JSON object was expected ({what}), found a {type(data).__name__}")
    return data


def read_parquet(file: Path):
    """A pyarrow Table from `file`; a truncated or foreign file is a DataError (pyarrow's ArrowInvalid is a
    ValueError, its IO errors OSErrors)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.read_table(file)
    except (OSError, ValueError, pa.ArrowException) as e:
        raise DataError(f"{file}: not a readable Parquet file ({str(e).splitlines()[0] if str(e) else e!r}); "
                        "evaluate the model again") from None


def number(value: Any, where: str, lo: float | None = None, hi: float | None = None, nullable: bool = False):
    """`value` as a finite float in [lo, hi] (None allowed where `nullable`); else a DataError naming `where`."""
    if value is None and nullable:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise DataError(f"{where}: {value!r} is not a number")
    value = float(value)
    if not math.isfinite(value):
        raise DataError(f"{where}: {value} is not a finite number")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f"[{-math.inf if lo is None else lo:g}, {math.inf if hi is None else hi:g}]"
        raise DataError(f"{where}: {value:g} is out of range {bounds}")
    return value


def check_items(rows: Sequence[dict], file: Path, expected: int | None = None) -> None:
    """The per-item records of items/<set>.parquet: at least one, `expected` many where given, and each metric
    column it has a finite number in its range (ITEM_RANGES)."""
    if not rows:
        raise DataError(f"{file}: no rows")
    if expected is not None and len(rows) != expected:
        raise DataError(f"{file}: {len(rows)} rows, but the forget set compared has {expected} items")
    for i, row in enumerate(rows):
        for column, (lo, hi) in ITEM_RANGES.items():
            if column in row:
                number(row[column], f"{file}: row {i}: {column}", lo, hi, nullable=column in NULLABLE_ITEMS)
        for column, (lo, hi) in ITEM_LIST_RANGES.items():
            if column in row:
                if not isinstance(row[column], list) or not row[column]:
                    raise DataError(f"{file}: row {i}: {column}: {row[column]!r} is not a list of numbers")
                for v in row[column]:
                    number(v, f"{file}: row {i}: {column}", lo, hi)
        for column in (c for c in row if c.startswith("mia_")):  # membership-inference scores: any sign
            number(row[column], f"{file}: row {i}: {column}")


def non_finite(obj: Any, path: str = "") -> tuple[str, float] | None:
    """(dotted key path, value) of the first NaN or ±Infinity in `obj` (dicts, lists, numbers), or None."""
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    else:
        ok = isinstance(obj, bool) or not isinstance(obj, numbers.Real) or math.isfinite(float(obj))
        return None if ok else (path or "value", float(obj))
    for key, value in items:
        found = non_finite(value, f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


def write_strict_json(target: Path, obj: Any, indent: int = 2) -> None:
    """`write_json`, refusing a non-finite number (json.dump would write NaN / -Infinity, which is not JSON): the
    error names the metric's key path."""
    bad = non_finite(obj)
    if bad is not None:
        raise DataError(f"{target}: metric {bad[0]} is {bad[1]}, not a finite number; not written (an input or the "
                        "model's scores are not finite)")
    write_json(target, obj, indent=indent)


def item_table(records: list[dict], meta: dict):
    """Per-item records as an Arrow table, `meta` in its schema metadata (`tokenunlearn`: split, questions hash)."""
    import pyarrow as pa

    return pa.Table.from_pylist(records).replace_schema_metadata({b"tokenunlearn": json.dumps(meta).encode()})
