"""Reading one of the user's own data files (`data.forget`, `data.retain`, `data.holdout`) into records.

A file holds question-answer pairs (`question`, `answer`) or passages (`text`): JSON Lines (.jsonl), JSON (.json:
an array of records, or JSON Lines), CSV (.csv, with a header) or Parquet (.parquet). Its params value is a path
or `{path, fields}`, where `fields` maps a canonical field to the file's column (`{question: prompt, answer:
completion}`). The datasets library reads it, after the checks only the raw text allows (UTF-8, the line of
malformed JSON or CSV); every problem is one DataError (or ParamError) naming the file, its params key, the row
(1-based: the N-th record of the file, for CSV the N-th after the header) or line, and the field.
"""

from __future__ import annotations

import codecs
import contextlib
import csv
import dataclasses
import hashlib
import io
import json
import logging
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, NamedTuple

from pipeline.common.errors import DataError, ParamError
from pipeline.common.params import check_keys

SETS = ("forget", "retain", "holdout")
FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
SUPPORTED = ", ".join(FORMATS)
QA_FIELDS = ("question", "answer")
TEXT_FIELDS = ("text",)


def is_set(value) -> bool:
    """Whether a `data.forget`/`retain`/`holdout` value names a file ("" and null: unset)."""
    return value not in ("", None)


def _format(path: str, fail) -> str:
    fmt = FORMATS.get(Path(path).suffix.lower())
    if fmt is None:
        suffix = Path(path).suffix or "none"
        raise fail(f"unsupported file type '{suffix}' (supported: {SUPPORTED})")
    return fmt


@dataclass(frozen=True)
class DataFile:
    """One of the user's files: its path, the columns its canonical fields are read from, and what it holds."""

    path: str
    fields: dict = field(default_factory=dict, hash=False)  # canonical -> column; {}: none given (each field is
                                                             # its own column, and the file's columns set the kind)
    kind: str = "qa"                                          # "qa": question, answer; "text": passages

    @property
    def field_map(self) -> dict[str, str]:
        """Every canonical field of the kind, with the column it is read from."""
        names = TEXT_FIELDS if self.kind == "text" else QA_FIELDS
        return {name: self.fields.get(name, name) for name in names}

    def settled(self, columns) -> "DataFile":
        """The spec for a file with these columns: with no field map, a file with `text` but neither `question`
        nor `answer` holds passages."""
        columns = set(columns)
        if not self.fields and "text" in columns and not columns & set(QA_FIELDS):
            return dataclasses.replace(self, kind="text")
        return self

    @classmethod
    def from_params(cls, value, key: str) -> "DataFile":
        """A path, or a mapping {path, fields}; `key` names it in errors (`data.forget`). Reads no file."""
        example = "{path: FILE, fields: {question: COLUMN, answer: COLUMN}}"
        if isinstance(value, str):
            path, fields = value, None
        elif isinstance(value, dict):
            check_keys(value, ("path", "fields"), key)
            if "path" not in value:
                raise ParamError(f"{key}.path: missing; the mapping is {example}")
            path, fields = value["path"], value.get("fields")
            if not isinstance(path, str):
                raise ParamError(f"{key}.path={path!r}: expected a file path (a string)")
        else:
            raise ParamError(f"{key}={value!r}: expected a file path, or a mapping {example}")
        if not path.strip():
            raise ParamError(f"{key}: empty path; name a {SUPPORTED} file")

        def fail(message):
            return ParamError(f"{key}: '{path}': {message}")

        _format(path, fail)
        if fields is None or fields == {}:
            return cls(path)
        if not isinstance(fields, dict):
            raise ParamError(f"{key}.fields={fields!r}: expected a mapping of field to column, "
                             "e.g. {question: prompt, answer: completion}")
        unknown = sorted(set(fields) - {*QA_FIELDS, *TEXT_FIELDS}, key=str)
        if unknown:
            raise ParamError(f"{key}.fields: unknown field(s) {unknown}; the fields are question and answer (pairs) "
                             "or text (passages), each mapped to a column of the file, "
                             "e.g. {question: prompt, answer: completion}")
        for name, column in fields.items():
            if not isinstance(column, str) or not column:
                raise ParamError(f"{key}.fields.{name}={column!r}: expected a column name (a string)")
        if "text" in fields and set(fields) & set(QA_FIELDS):
            raise ParamError(f"{key}.fields: maps both text and {sorted(set(fields) & set(QA_FIELDS))}; a file holds "
                             "question-answer pairs (question, answer) or passages (text), not both")
        spec = cls(path, dict(fields), "text" if "text" in fields else "qa")
        read = list(spec.field_map.values())
        if len(set(read)) < len(read):
            raise ParamError(f"{key}.fields: question and answer both read column '{read[0]}'; each field needs a "
                             "column of its own")
        return spec



# ---- reading ---------------------------------------------------------------------------------------------------

class FileRecords(NamedTuple):
    """A file as read: its spec, its records and its sha256."""

    spec: DataFile       # settled: its kind as the file's columns say
    records: list[dict]  # canonical keys only, in file order
    sha256: str


def read_records(spec: DataFile, key: str) -> list[dict]:
    """The file's records with canonical keys only (question and answer, or text), in file order; every row
    validated. `key` names the file's params key in errors (`data.forget`)."""
    return read_file(spec, key).records


def read_file(spec: DataFile, key: str) -> FileRecords:
    """`read_records`, with the spec as the file settles it and the file's sha256."""
    where = f"{spec.path} ({key})"
    fmt = _format(spec.path, lambda message: DataError(f"{where}: {message}"))
    data = _read_bytes(Path(spec.path), where)
    digest = hashlib.sha256(data).hexdigest()
    text = None
    if fmt != "parquet":
        text = _utf8(data, where)
        if not text.strip():
            raise DataError(f"{where}: empty file (no records); write one record a line (or a .json array)")
    # The datasets library reads a copy in a temporary directory, with its cache there too: nothing is written
    # beside the user's file or in the repository, and what it reads is exactly the bytes checked and hashed.
    with tempfile.TemporaryDirectory(prefix="tokenunlearn-own-data-") as tmp:
        parsed, header = None, None
        if fmt == "json":  # as JSON Lines, which every datasets version reads the same
            parsed = _parse_json(text, Path(spec.path).suffix.lower() == ".json", where)
            name, count = "in.jsonl", len(parsed)
            payload = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in parsed).encode("utf-8")
        elif fmt == "csv":
            header, count = _parse_csv(text, where)
            name, payload = "in.csv", text.encode("utf-8")
        else:
            name, count, payload = "in.parquet", _parquet_rows(data, where), data
        file = Path(tmp) / name
        file.write_bytes(payload)
        try:
            rows, columns = _load_dataset(fmt, file, Path(tmp) / "cache", header)
        except Exception as e:  # noqa: BLE001 - datasets and pyarrow raise many types; each becomes one line
            if parsed is not None:  # an older datasets refuses a column of mixed types: say which row
                _records(parsed, spec.settled(_keys(parsed)), _keys(parsed), where, key)
            cause = e.__cause__ or e
            first = (str(cause).strip().splitlines() or [""])[0][:200]
            what = "not a readable Parquet file" if fmt == "parquet" else "the datasets library could not read it"
            raise DataError(f"{where}: {what} ({type(cause).__name__}: {first})") from None
    if len(rows) != count:  # the checks above and datasets must see the same records
        raise DataError(f"{where}: datasets read {len(rows)} records where the file has {count}; write it as "
                        f"{'JSON Lines' if fmt == 'json' else 'plain CSV with a header'}")
    settled = spec.settled(columns)
    return FileRecords(settled, _records(rows, settled, columns, where, key), digest)


def _read_bytes(path: Path, where: str) -> bytes:
    try:
        if not stat.S_ISREG(path.stat().st_mode):  # a device or a pipe would be read forever (/dev/zero)
            raise DataError(f"{where}: not a regular file (a directory, a device or a pipe); name a {SUPPORTED} "
                            "file")
        return path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"{where}: file not found; check the path (relative paths start where the command "
                        "runs)") from None


def _utf8(data: bytes, where: str) -> str:
    bom = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0  # a byte-order mark is no record's
    try:
        return data[bom:].decode("utf-8")
    except UnicodeDecodeError as e:
        at = bom + e.start
        line = data[:at].count(b"\n") + 1
        column = at - (data.rfind(b"\n", 0, at) + 1) + 1
        raise DataError(f"{where}: not UTF-8 text: line {line}, byte {column} of the line (offset {at} in the file) "
                        f"is 0x{data[at]:02x}; save the file as UTF-8") from None


def _parse_json(text: str, array_ok: bool, where: str) -> list[dict]:
    """The records of JSON Lines, or (`array_ok`, .json) of one array; a line that is no JSON object is an error."""
    if array_ok and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: line {e.lineno}: malformed JSON ({e.msg}, column {e.colno})") from None
        if not isinstance(rows, list) or not rows:
            raise DataError(f"{where}: no records (an empty array)")
        for i, row in enumerate(rows, start=1):
            if not isinstance(row, dict):
                raise DataError(f"{where}: row {i}: expected a JSON object with the fields, got "
                                f"{type(row).__name__}")
        return rows
    rows = []
    for lineno, line in enumerate(text.split("\n"), start=1):  # not splitlines: U+2028 may stand in a value
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            _refuse_whole_json(text, array_ok, where)
            raise DataError(f"{where}: line {lineno}: malformed JSON ({e.msg}, column {e.colno})") from None
        if not isinstance(row, dict):
            raise DataError(f"{where}: line {lineno}: expected a JSON object with the fields, got "
                            f"{type(row).__name__}")
        rows.append(row)
    return rows


def _refuse_whole_json(text: str, array_ok: bool, where: str) -> None:
    """A file that is one JSON value spanning lines is valid JSON but no JSON Lines: say so, not a line's error."""
    try:
        whole = json.loads(text)
    except json.JSONDecodeError:
        return
    if isinstance(whole, list) and not array_ok:
        raise DataError(f"{where}: one JSON array, not JSON Lines; name the file .json, or write one record a line")
    raise DataError(f"{where}: one JSON {type(whole).__name__.replace('dict', 'object')}, not records; write an array "
                    "of records ([{...}, ...]) in a .json file, or JSON Lines (one record a line)")


def _parse_csv(text: str, where: str) -> tuple[list[str], int]:
    """The header and the number of records of a CSV file; a record whose fields do not match the header is an
    error naming its line (pandas would fill a short one with empty values)."""
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    header, count = None, 0
    try:
        for fields in reader:
            if not fields or len(fields) == 1 and not fields[0].strip():
                continue  # a blank (or whitespace) line, as pandas skips it
            if header is None:
                header = fields
                for j, name in enumerate(header, start=1):
                    if not name.strip():
                        raise DataError(f"{where}: line {reader.line_num}: the header's column {j} has no name; "
                                        "the first line names every column")
                    if header.index(name) != j - 1:
                        raise DataError(f"{where}: line {reader.line_num}: column '{name}' appears twice in the "
                                        "header; give each column its own name")
                continue
            if len(fields) != len(header):
                raise DataError(f"{where}: line {reader.line_num}: malformed CSV ({len(fields)} fields where the "
                                f"header has {len(header)}; quote a value that holds a comma)")
            count += 1
    except csv.Error as e:
        raise DataError(f"{where}: line {reader.line_num}: malformed CSV ({e})") from None
    if not count:
        raise DataError(f"{where}: no records (only a header)")
    return header, count


def _parquet_rows(data: bytes, where: str) -> int:
    import pyarrow.parquet as pq

    try:
        rows = pq.ParquetFile(io.BytesIO(data)).metadata.num_rows
    except Exception as e:  # noqa: BLE001 - pyarrow's ArrowInvalid, OSError: not Parquet
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise DataError(f"{where}: not a readable Parquet file ({type(e).__name__}: {first})") from None
    if not rows:
        raise DataError(f"{where}: no records (a Parquet file of 0 rows)")
    return rows


@contextlib.contextmanager
def _quiet_datasets() -> Iterator:
    """datasets, with no progress bars and none of its log lines (a failure is our one line), restored after."""
    import datasets  # imported lazily: slow, and only this command reads the user's files

    logger = logging.getLogger("datasets")
    level = logger.level
    bars = getattr(datasets, "is_progress_bar_enabled", lambda: True)()
    datasets.disable_progress_bars()
    logger.setLevel(logging.CRITICAL + 1)
    try:
        yield datasets
    finally:
        logger.setLevel(level)
        if bars:
            datasets.enable_progress_bars()


def _load_dataset(fmt: str, file: Path, cache: Path, header: list[str] | None) -> tuple[list[dict], list[str]]:
    with _quiet_datasets() as datasets:
        options = {}
        if fmt == "json":
            from datasets.packaged_modules.json.json import JsonConfig

            # Newer datasets read a file of agent traces (`type`, `message` columns) as such: these are records
            if "parse_agent_traces" in {f.name for f in dataclasses.fields(JsonConfig)}:
                options["parse_agent_traces"] = False
        elif fmt == "csv":
            # Every value as the text it is: pandas would read 1984 as a number and "NA", "null" or "" as missing
            options = {"features": datasets.Features({c: datasets.Value("string") for c in header}),
                       "keep_default_na": False, "na_filter": False}
        ds = datasets.load_dataset(fmt, data_files=str(file), split="train", cache_dir=str(cache), **options)
        rows, columns = ds.to_list(), list(ds.column_names)
        del ds  # its Arrow files lie in the temporary directory
    return rows, columns


def _keys(rows: list[dict]) -> list[str]:
    return list(dict.fromkeys(k for row in rows for k in row))


def _records(rows: list[dict], spec: DataFile, columns: list[str], where: str, key: str) -> list[dict]:
    """The rows with canonical keys; a missing column, or a missing, null, non-string or empty value, is an
    error naming the row and the field."""
    fields = spec.field_map
    for name, column in fields.items():
        if column not in columns:
            how = f"correct {key}.fields.{name}" if name in spec.fields else (
                f"map them: {key}: {{path: {spec.path}, fields: {{question: COLUMN, answer: COLUMN}}}} "
                "(passages: {text: COLUMN})")
            raise DataError(f"{where}: no column '{column}' (field '{name}'); the file's columns: {columns}; {how}")
    out = []
    for i, row in enumerate(rows, start=1):
        record = {}
        for name, column in fields.items():
            value = row.get(column)
            label = f"field '{name}'" + (f" (column '{column}')" if column != name else "")
            if value is None:
                raise DataError(f"{where}: row {i}: {label} is missing or null; give it a value or remove the row")
            if not isinstance(value, str):
                raise DataError(f"{where}: row {i}: {label} must be a string, got {type(value).__name__} "
                                f"({short(value)}); write it as text")
            if not value.strip():
                raise DataError(f"{where}: row {i}: {label} is empty (or whitespace only); fill it in or remove the "
                                "row")
            record[name] = value
        out.append(record)
    return out


def short(value, limit: int = 60) -> str:
    """A value as an error quotes it, cut to `limit` characters."""
    text = json.dumps(value, ensure_ascii=False) if not isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
