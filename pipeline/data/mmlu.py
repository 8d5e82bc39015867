"""MMLU: the hub's `cais/mmlu` (config `all`, split test), its Parquet or JSON records, the original release's
per-subject CSVs (a directory, its `test/`, or one file), or CSVs with a header row naming question, A-D, answer
(a letter or 0-3) and optionally subject.

The prompt's subject is the harness's description of each `mmlu_<subject>` task (`lm_eval/tasks/mmlu/default/`),
the subject's name with spaces for underscores.
"""

from __future__ import annotations

import csv
import re
from pathlib import Path
from typing import Iterable

from pipeline.common.errors import DataError, ParamError
from pipeline.common.paths import is_hub_name
from pipeline.data.mc_items import LETTERS, MCItem, item_from_record, load_hub, nonempty, own_subject, read_records

MMLU_HUB = "cais/mmlu"
# MMLU's 57 subjects (the harness's lm_eval/tasks/mmlu/default/mmlu_<subject>.yaml; "_" is a space in the prompt).
MMLU_SUBJECTS = frozenset("""
    abstract_algebra anatomy astronomy business_ethics clinical_knowledge college_biology college_chemistry
    college_computer_science college_mathematics college_medicine college_physics computer_security
    conceptual_physics econometrics electrical_engineering elementary_mathematics formal_logic global_facts
    high_school_biology high_school_chemistry high_school_computer_science high_school_european_history
    high_school_geography high_school_government_and_politics high_school_macroeconomics high_school_mathematics
    high_school_microeconomics high_school_physics high_school_psychology high_school_statistics
    high_school_us_history high_school_world_history human_aging human_sexuality international_law jurisprudence
    logical_fallacies machine_learning management marketing medical_genetics miscellaneous moral_disputes
    moral_scenarios nutrition philosophy prehistory professional_accounting professional_law professional_medicine
    professional_psychology public_relations security_studies sociology us_foreign_policy virology world_religions
""".split())


def mmlu_subject(name: str) -> str:
    """`abstract_algebra` -> "abstract algebra", the phrase of the harness's description."""
    return name.strip().replace("_", " ")


def _file_subject(path: Path) -> str:
    """The subject a CSV of the original release names: `<subject>_test.csv` (or _dev, _val); one of MMLU's 57."""
    name = re.sub(r"_(test|dev|val)$", "", path.stem)
    if name not in MMLU_SUBJECTS:
        raise DataError(f"{path}: the prompt's subject is unknown: '{name}' is not one of MMLU's 57 subjects and the "
                        "file has no 'subject' column; name it <subject>_test.csv (e.g. anatomy_test.csv) or add a "
                        "header row with a subject column")
    return name


def _answer_index(value: str, where: str, i: int, hint: str = "") -> int:
    """An answer cell: a letter A-D (the original release) or a 0-based index 0-3 (the hub's `answer`)."""
    text = value.strip()
    if text in LETTERS:
        return LETTERS.index(text)
    if text in {str(k) for k in range(len(LETTERS))}:
        return int(text)
    raise DataError(f"{where}: row {i}: field 'answer' must be a letter A-D or an index 0-3, got {value!r}{hint}")


# The original release's CSV columns (it has no header row); a header row that names these is read by name.
CSV_COLUMNS = ("question", "a", "b", "c", "d", "answer")


def _csv_layout(first: list[str]) -> tuple[dict[str, int], bool]:
    """Column positions by name, and whether `first` is a header: one that names question, A, B, C, D and answer
    (any case and order; a 'subject' column is read, others such as an index are ignored), else the original
    release's six columns."""
    names = [cell.strip().lower() for cell in first]
    if set(CSV_COLUMNS) <= set(names):
        return {name: names.index(name) for name in (*CSV_COLUMNS, "subject") if name in names}, True
    return {name: k for k, name in enumerate(CSV_COLUMNS)}, False


def _read_mmlu_csv(path: Path, first_index: int = 0) -> list[MCItem]:
    """An MMLU CSV: the original release's (no header: question, A, B, C, D, answer letter), or one with a header
    row naming question, A, B, C, D and answer (a letter or an index 0-3), and optionally subject. Without a
    subject column the file's name gives it. `first_index`: the first item's index (files of one directory)."""
    where = str(path)
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:  # -sig: a spreadsheet's byte-order mark
            rows = list(csv.reader(f))
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e.reason})") from None
    if not rows:
        raise DataError(f"{path}: an empty file")
    columns, has_header = _csv_layout(rows[0])
    width = len(rows[0]) if has_header else len(CSV_COLUMNS)
    expected = (f"{width} columns, as its header" if has_header else
                f"{width} columns (question, A-D, answer) or a header row naming question, A, B, C, D, answer")
    file_subject = None if "subject" in columns else _file_subject(path)
    first_row = 2 if has_header else 1  # rows are counted in the file, the header included
    items = []
    for n, row in enumerate(rows[first_row - 1:]):
        i = first_row + n
        if len(row) != width:
            raise DataError(f"{where}: row {i}: expected {expected}, got {len(row)}")
        hint = " (or is this a header? It must name question, A, B, C, D, answer)" if i == 1 else ""
        answer = _answer_index(row[columns["answer"]], where, i, hint)
        subject = file_subject or row[columns["subject"]].strip()
        if not subject:
            raise DataError(f"{where}: row {i}: field 'subject' is empty")
        record = {"question": row[columns["question"]], "choices": [row[columns[c]] for c in "abcd"], "answer": answer}
        items.append(item_from_record(record, where, i, mmlu_subject(subject), first_index + n))
    return items


def _mmlu_records(rows: list, where: str) -> list[MCItem]:
    """The hub's records {question, subject, choices, answer (int)} (cais/mmlu, hails/mmlu_no_train, ...)."""
    items = []
    for i, row in enumerate(rows, start=1):
        subject = own_subject(row)
        if subject is None and isinstance(row, dict):
            raise DataError(f"{where}: row {i}: missing field 'subject' (MMLU records name their subject)")
        # not an object: `item_from_record` says so
        items.append(item_from_record(row, where, i, mmlu_subject(subject or ""), i - 1))
    return items


def _mmlu_file(path: Path) -> list[MCItem]:
    return _read_mmlu_csv(path) if path.suffix == ".csv" else _mmlu_records(read_records(path), str(path))


def _mmlu_directory(path: Path) -> list[MCItem]:
    """The original release's `data/test/` (or `data/`, whose `test/` is used): every `<subject>_test.csv`, in
    name order (the order of the hub's `all`); indices run on across the files."""
    files = sorted(path.glob("*_test.csv")) or sorted((path / "test").glob("*_test.csv"))
    if not files:
        raise DataError(f"{path}: no <subject>_test.csv files (the original MMLU release's data/test/)")
    items: list[MCItem] = []
    for file in files:
        items += _read_mmlu_csv(file, first_index=len(items))
    return items


def _keep_subjects(items: list[MCItem], subjects: Iterable[str], where: str, key: str) -> list[MCItem]:
    """The items of `subjects` (names as `abstract_algebra`); a name that matches no item is an error."""
    wanted = {name: mmlu_subject(name) for name in subjects}
    present = {it.subject for it in items}
    missing = [name for name, phrase in wanted.items() if phrase not in present]
    if missing:
        have = sorted(s.replace(" ", "_") for s in present)
        raise ParamError(f"{key}: {missing} match no question of {where} (its subjects: "
                         f"{', '.join(have[:8])}{', ...' if len(have) > 8 else ''})")
    return [it for it in items if it.subject in set(wanted.values())]


def load_mmlu(source: str | Path, subjects: Iterable[str] | None = None, key: str = "subjects") -> list[MCItem]:
    """MMLU from a directory of the original `{subject}_test.csv` files (or its `test/` folder), one CSV (the
    original's, or one with a header row: see `_read_mmlu_csv`), a Parquet/JSON file of the hub's records
    (question, subject, choices, answer), or the hub by name (config `all`, split test). `subjects` (e.g.
    "abstract_algebra") keeps only those; `key` names that param in its error."""
    path = Path(source)
    if path.is_dir():
        items, where = _mmlu_directory(path), str(path)
    elif path.is_file():
        items, where = _mmlu_file(path), str(path)
    elif is_hub_name(source):
        where = f"{source}[all]"
        items = _mmlu_records(load_hub(str(source), "all"), where)
    else:
        raise DataError(f"MMLU source '{source}': no such file or directory (and not a hub name like {MMLU_HUB})")
    if subjects is not None:
        items = _keep_subjects(items, subjects, where, key)
    return nonempty(items, where)
