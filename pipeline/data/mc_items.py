"""Multiple-choice items: the record every benchmark's loader yields (`MCItem`), and what those loaders share: a
record's checks, the readers of local files (JSON, JSON Lines, Parquet) and of the hub.

Each benchmark has its own module (`wmdp.py`, `mmlu.py`, `world_mc.py`); how an item is scored is evaluation's
(`pipeline/evaluation/mc_scoring.py`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from pipeline.common.errors import DataError
from pipeline.data.tofu import load_hub_records, read_json_records

log = logging.getLogger(__name__)

LETTERS = ("A", "B", "C", "D")


@dataclass(frozen=True)
class MCItem:
    """One question with four choices; `answer` indexes `choices`; `subject` is the phrase of the prompt's header;
    `stem` is the answer's text before the choice (cloze scoring only; "" where the choice is the whole answer);
    `index` is the item's 0-based position in its source (lm-eval's doc_id), to join results back to it."""

    question: str
    choices: list[str]
    answer: int
    subject: str
    stem: str = ""
    index: int = 0


def item_from_record(row, where: str, i: int, subject: str, index: int) -> MCItem:
    """Validate one record {question, choices, answer (int), optional stem} (row `i` of `where`, 1-based)."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: row {i}: expected an object, got {type(row).__name__}")
    for name in ("question", "choices", "answer"):
        if name not in row:
            raise DataError(f"{where}: row {i}: missing field '{name}'")
    question, choices, answer = row["question"], row["choices"], row["answer"]
    if not isinstance(question, str) or not question.strip():
        raise DataError(f"{where}: row {i}: field 'question' must be a non-empty string")
    if not isinstance(choices, (list, tuple)) or not all(isinstance(c, str) for c in choices):
        raise DataError(f"{where}: row {i}: field 'choices' must be a list of {len(LETTERS)} strings")
    if len(choices) != len(LETTERS):
        raise DataError(f"{where}: row {i}: field 'choices' must have {len(LETTERS)} entries, got {len(choices)}")
    if isinstance(answer, bool) or not isinstance(answer, int):
        raise DataError(f"{where}: row {i}: field 'answer' must be an integer index, got {answer!r}")
    if not 0 <= answer < len(LETTERS):
        raise DataError(f"{where}: row {i}: field 'answer' is {answer}, out of range 0..{len(LETTERS) - 1}")
    stem = row.get("stem", "")
    if not isinstance(stem, str):
        raise DataError(f"{where}: row {i}: field 'stem' must be a string")
    return MCItem(question, list(choices), answer, subject, stem, index)


def _read_parquet(path: Path) -> list[dict]:
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise DataError(f"{path}: not a readable Parquet file ({e})") from None


# File suffix -> reader of its records (a list of dicts).
RECORD_READERS: dict[str, Callable[[Path], list]] = {
    ".json": read_json_records,
    ".jsonl": read_json_records,
    ".parquet": _read_parquet,
}


def read_records(path: Path) -> list:
    reader = RECORD_READERS.get(path.suffix)
    if reader is None:
        raise DataError(f"{path}: unknown file type (expected one of {sorted(RECORD_READERS)})")
    return reader(path)


def load_hub(name: str, config: str, split: str = "test") -> list[dict]:
    return load_hub_records(name, config, split, f"config '{config}'", "point at a local file instead.")


def nonempty(items: list[MCItem], where: str) -> list[MCItem]:
    if not items:
        raise DataError(f"{where}: no multiple-choice items")
    log.debug("loaded %d multiple-choice items from %s", len(items), where)
    return items


def own_subject(row) -> str | None:
    """A record's own `subject` field, where it has a non-empty one."""
    value = row.get("subject") if isinstance(row, dict) else None
    return value if isinstance(value, str) and value.strip() else None
