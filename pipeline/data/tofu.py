"""One loader for TOFU-format data: the hub (`locuslab/TOFU`), a local directory of `<split>.json`, or the
generated world (which is such a directory).

Every row is validated: a bad row raises a `DataError` naming the file, the row (1-based line) and the field.
"""

from __future__ import annotations

import json
import logging
import re
import stat
from pathlib import Path
from typing import Sequence

from pipeline.common.errors import DataError
from pipeline.common.paths import hub_reachable, is_hub_name

log = logging.getLogger(__name__)

HUB_DATASET = "locuslab/TOFU"

# Field -> type. "list[str]" is a non-empty list of strings.
QA = {"question": "str", "answer": "str"}
PERTURBED = {**QA, "paraphrased_answer": "str", "perturbed_answer": "list[str]", "paraphrased_question": "str"}
GENERAL_PERTURBED = {**QA, "perturbed_answer": "list[str]"}
OPTIONS = {"question": "str", "option1": "str", "option2": "str", "option3": "str", "option4": "str", "answer": "str"}
GENERAL = ("world_facts", "real_authors")


def schema_for(split: str) -> dict[str, str]:
    """The fields a TOFU split's rows must have."""
    if split in GENERAL:
        return OPTIONS
    if split in {f"{g}_perturbed" for g in GENERAL}:
        return GENERAL_PERTURBED
    if split.endswith("_perturbed"):
        return PERTURBED
    return QA


def validate_rows(rows: list, schema: dict[str, str], where: str) -> list[dict]:
    """Check every row against `schema`; return the rows restricted to the schema's fields."""
    out = []
    for i, row in enumerate(rows, start=1):
        if not isinstance(row, dict):
            raise DataError(f"{where}: row {i}: expected an object, got {type(row).__name__}")
        for name, kind in schema.items():
            if name not in row:
                raise DataError(f"{where}: row {i}: missing field '{name}'")
            value = row[name]
            if kind == "str":
                if not isinstance(value, str):
                    raise DataError(f"{where}: row {i}: field '{name}' must be a string, got {type(value).__name__}")
                if not value.strip():
                    raise DataError(f"{where}: row {i}: field '{name}' is empty")
            else:
                if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
                    raise DataError(f"{where}: row {i}: field '{name}' must be a non-empty list of strings")
        out.append({name: row[name] for name in schema})
    return out


def read_json_records(path: Path) -> list:
    """JSON Lines (the hub's `<split>.json`), or one JSON array."""
    try:
        if not stat.S_ISREG(path.stat().st_mode):  # a device or a pipe would be read forever (/dev/zero)
            raise DataError(f"{path}: not a regular file (a device, a pipe or a directory); give a JSON file")
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"{path}: file not found")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e.reason})")
    if text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: malformed JSON at line {e.lineno}: {e.msg}")
        if not rows:
            raise DataError(f"{path}: no records (an empty list)")
        return rows
    rows = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: row {lineno}: malformed JSON: {e.msg}")
    if not rows:
        raise DataError(f"{path}: no records")
    return rows


def load_hub_records(name: str, config: str, split: str, what: str, offline_hint: str) -> list[dict]:
    """The records of `config`/`split` of hub dataset `name`; a failure is one DataError naming `what`."""
    import datasets  # imported lazily: slow, and only needed for the hub

    if not hub_reachable():  # offline mode is on: the local cache is read at once, or this fails at once
        log.info("the Hugging Face hub cannot be reached: reading %s of '%s' from the local cache", what, name)
    try:
        ds = datasets.load_dataset(name, config, split=split)
    except Exception as e:  # the hub raises many types: network, missing config, auth
        reason = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        where = "the local cache (the hub cannot be reached)" if not hub_reachable() else "the Hugging Face hub"
        raise DataError(f"could not load {what} of '{name}' from {where} ({reason}); {offline_hint}") from None
    return [dict(r) for r in ds]


# A split is a file <split>.json inside the source (or a hub config): a plain name, never a path.
SPLIT_NAME = re.compile(r"[A-Za-z0-9][\w.-]*")


def count_duplicates(rows: Sequence[dict], fields: str | Sequence[str], where: str = "") -> int:
    """The rows that repeat an earlier row's `fields`; logged with the first such pair where `where` is given."""
    fields = (fields,) if isinstance(fields, str) else tuple(fields)
    first: dict[tuple, int] = {}
    repeats = []
    for i, row in enumerate(rows, start=1):
        key = tuple(json.dumps(row.get(f), sort_keys=True) for f in fields)
        if key in first:
            repeats.append((i, first[key]))
        else:
            first[key] = i
    if repeats and where:
        log.warning("%s: %d duplicate row(s) (same %s; row %d repeats row %d): kept, each counts as a sample",
                    where, len(repeats), "/".join(fields), *repeats[0])
    return len(repeats)


def load_split(source: str | Path, split: str) -> list[dict]:
    """Load and validate one TOFU split from a local directory, or from the hub by dataset name."""
    if not isinstance(split, str) or not SPLIT_NAME.fullmatch(split) or ".." in split:
        raise DataError(f"split {split!r}: not a split name (letters, digits, '_', '.', '-'); a split is the file "
                        f"<split>.json inside data.source ({source}), or a hub dataset's config")
    path = Path(source)
    if path.is_dir():
        file = path / f"{split}.json"
        rows, where = read_json_records(file), str(file)
    elif path.exists():  # one file would be read for every split: forget, retain and the evaluation's alike
        raise DataError(f"data source '{source}': a file, not a directory; data.source is a directory of "
                        f"<split>.json files (this split is {split}.json), or a hub dataset name like {HUB_DATASET}")
    elif is_hub_name(source):
        rows = load_hub_records(str(source), split, "train", f"split '{split}'",
                                "point data.source at a local directory of <split>.json files instead.")
        where = f"{source}[{split}]"
    else:
        raise DataError(f"data source '{source}': no such directory (and not a hub dataset name like {HUB_DATASET})")
    if not rows:
        raise DataError(f"{where}: no records")
    rows = validate_rows(rows, schema_for(split), where)
    count_duplicates(rows, ("question", "answer"), where)
    log.debug("loaded %d rows from %s", len(rows), where)
    return rows


def load_passages(path: str | Path, split: str = "", forget: bool = True) -> list[dict]:
    """A corpus of passages (JSON Lines with a non-empty `text`). Where records name their `forget_splits` (the
    embedded world's biographies), `forget=True` keeps the passages of `split`'s authors (the forget corpus) and
    `forget=False` the others (the retain corpus); records without the field are always kept."""
    path = Path(path)
    out = []
    for i, rec in enumerate(read_json_records(path), start=1):
        if not isinstance(rec, dict) or not isinstance(rec.get("text"), str) or not rec["text"].strip():
            raise DataError(f"{path}: row {i}: field 'text' must be a non-empty string")
        if split and "forget_splits" in rec and (split in rec["forget_splits"]) != forget:
            continue
        out.append(rec)
    if not out:
        raise DataError(f"{path}: no {'forget' if forget else 'retain'} passages for split '{split}'")
    return out
