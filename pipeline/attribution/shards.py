"""Attribution shards: Parquet files of one row per sample with per-token list columns, and a manifest.

A directory is valid only with its `_manifest.json` (shard names, row counts, sha256), written last; readers
refuse a directory without one or whose files do not match it. Each shard is written to a temporary name and
renamed, and the whole directory is built beside its target and renamed into place.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.attribution.teacher import TEACHER_COLUMNS
from pipeline.common.atomic import write_json
from pipeline.common.errors import DataError

SCHEMA_VERSION = 1
METADATA_KEY = b"tokenunlearn"
MANIFEST = "_manifest.json"  # a leading "_": pyarrow and pandas skip it when they read the directory

f32 = pa.list_(pa.float32())
SCHEMA = pa.schema([
    ("sample_id", pa.int64()),
    ("split", pa.string()),
    ("text", pa.string()),
    ("input_ids", pa.list_(pa.int32())),
    ("positions", pa.list_(pa.int32())),
    ("token_start", pa.list_(pa.int32())),   # character offsets of each token in `text`
    ("token_end", pa.list_(pa.int32())),
    ("scored", pa.list_(pa.bool_())),
    ("masked", pa.list_(pa.bool_())),        # input positions replaced by the mask token in the masked pass
    ("logp_orig", f32),                      # NaN where not scored
    ("logp_mask", f32),
    ("delta", f32),
    ("entropy", f32),
    ("phi", f32),
    ("fact", pa.list_(pa.bool_())),          # ground truth where the data has it (the embedded world), else null
])
# The extra signals stage one can compute (attribution.signals; pipeline/attribution/variants.py), the columns
# each writes after the paper's, and their types.
SIGNAL_COLUMNS: dict[str, tuple[str, ...]] = {
    "copy": ("copied",),
    "span": ("span",),
    "per_noun": ("delta_noun_min", "delta_noun_max"),
    "grad_x_input": ("grad_x_input",),
    "learned": ("learned",),
    "nouns": ("answer_noun",),
}
EXTRA_COLUMNS = {
    "copied": pa.list_(pa.bool_()),          # the token's word occurs in the prompt (corpus: earlier in the passage)
    "span": pa.list_(pa.int32()),            # span id: a phrase of content words, else the word; -1 special tokens
    "delta_noun_min": f32,                   # min / max over the prompt's nouns of |Δ| masking that noun alone
    "delta_noun_max": f32,
    "grad_x_input": f32,                     # |embedding · gradient of the answer's log-likelihood|
    "learned": f32,                          # the learned scorer's probability that the token is a fact
    "answer_noun": pa.list_(pa.bool_()),     # the token is in a noun or proper noun of the answer (the tagger's)
}
# The alternative answers stage one can add (attribution.alternatives; pipeline/attribution/alternatives.py), for
# the preference methods: per forget sample one answer of each kind, its tokens (the prompt and that answer, encoded
# as the forget sample is) and θ_o's summed log-likelihood of its scored tokens.
ALTERNATIVES = ("idk", "perturbed")


def alternative_columns(kind: str) -> dict[str, pa.DataType]:
    """The columns alternative KIND adds, with their types."""
    return {f"{kind}_answer": pa.string(),             # the answer's text
            f"{kind}_ids": pa.list_(pa.int32()),        # prompt + answer + end, as input_ids
            f"{kind}_scored": pa.list_(pa.bool_()),     # the answer tokens (and EOS) scored, as `scored`
            f"{kind}_logp": pa.float64()}               # θ_o's Σ log p over the scored tokens (one per sample)


def shard_schema(signals: list[str] = (), alternatives: list[str] = (), teacher: bool = False) -> pa.Schema:
    """The paper's columns, then those the extra `signals` add, then those of the `alternatives`, then θ_o's top-k
    (`teacher`: attribution.teacher_top_k > 0; pipeline/attribution/teacher.py)."""
    schema = SCHEMA
    for signal in sorted(signals):
        for name in SIGNAL_COLUMNS[signal]:
            schema = schema.append(pa.field(name, EXTRA_COLUMNS[name]))
    for kind in sorted(alternatives):
        for name, dtype in alternative_columns(kind).items():
            schema = schema.append(pa.field(name, dtype))
    for name, dtype in (TEACHER_COLUMNS.items() if teacher else ()):
        schema = schema.append(pa.field(name, dtype))
    return schema


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@dataclass
class ShardInfo:
    name: str
    rows: int
    sha256: str


class ShardWriter:
    """Buffers rows and writes a zstd Parquet shard every `rows_per_shard` rows (bounded memory)."""

    def __init__(self, out_dir: Path, prefix: str, rows_per_shard: int, metadata: dict, schema: pa.Schema = SCHEMA):
        self.out_dir, self.prefix, self.rows_per_shard = out_dir, prefix, rows_per_shard
        self.schema = schema.with_metadata({METADATA_KEY: json.dumps(metadata, sort_keys=True).encode()})
        self.rows: list[dict] = []
        self.shards: list[ShardInfo] = []

    def add(self, row: dict) -> None:
        self.rows.append(row)
        if len(self.rows) >= self.rows_per_shard:
            self.flush()

    def flush(self) -> None:
        if not self.rows:
            return
        table = pa.Table.from_pylist(self.rows, schema=self.schema)
        name = f"{self.prefix}-{len(self.shards):05d}.parquet"
        tmp = self.out_dir / f".{name}.tmp"
        pq.write_table(table, tmp, compression="zstd")
        os.replace(tmp, self.out_dir / name)
        self.shards.append(ShardInfo(name, len(self.rows), _sha256(self.out_dir / name)))
        self.rows = []

    def close(self) -> list[ShardInfo]:
        self.flush()
        return self.shards


def write_manifest(out_dir: Path, shards: list[ShardInfo], metadata: dict, summary: dict) -> None:
    shards = sorted(shards, key=lambda s: s.name)
    write_json(out_dir / MANIFEST, {
        "schema_version": SCHEMA_VERSION,
        "shards": [s.__dict__ for s in shards],
        "rows": sum(s.rows for s in shards),
        "metadata": metadata,
        "summary": summary,
    })


def read_manifest(shard_dir: str | Path, verify: bool = True,
                  hint: str = "; rerun the stage that wrote it") -> dict:
    """The manifest of a shard directory, its structure checked and every shard it lists confined to the directory;
    with `verify`, every shard's sha256 is checked too, and its Parquet footer read (the row count it holds): a
    manifest rewritten over a damaged shard passes the sha256 but not this, so no reader meets the damage later.
    `hint`: how a damaged shard's error ends (the command that writes this directory, where the caller knows it)."""
    shard_dir = Path(shard_dir)
    path = shard_dir / MANIFEST
    if not path.is_file():
        raise DataError(f"{shard_dir}: no {MANIFEST}: not a complete attribution directory (rerun `attribute`)")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: malformed JSON ({getattr(e, 'msg', e)})") from None
    if not isinstance(manifest, dict) or manifest.get("schema_version") != SCHEMA_VERSION:
        version = manifest.get("schema_version") if isinstance(manifest, dict) else None
        raise DataError(f"{path}: schema_version {version}, this code reads {SCHEMA_VERSION}")
    check_manifest(manifest, path)
    for shard in manifest["shards"]:
        file = shard_path(shard_dir, shard["name"], path)
        if verify and _sha256(file) != shard["sha256"]:
            raise DataError(f"{shard_dir}: shard {shard['name']} does not match the manifest's sha256")
        if verify:
            check_shard(file, {}, shard["rows"], hint)
    return manifest


def check_manifest(manifest: dict, path: Path) -> None:
    """The manifest's fields have the types readers rely on: a hand-edited one (`"shards": null`, a row count as a
    string) would otherwise fail later with a traceback, or be read wrong."""
    shards = manifest.get("shards")
    if not isinstance(shards, list):
        raise DataError(f"{path}: 'shards' is {json.dumps(shards)}, not a list of shards; rerun the stage that "
                        "wrote it")
    for i, shard in enumerate(shards):
        ok = isinstance(shard, dict) and isinstance(shard.get("name"), str) and isinstance(shard.get("sha256"), str) \
            and isinstance(shard.get("rows"), int) and not isinstance(shard.get("rows"), bool) and shard["rows"] >= 0
        if not ok:
            raise DataError(f"{path}: shards[{i}] is {json.dumps(shard)}, not {{name, rows (a count), sha256}}")
    names = [s["name"] for s in shards]
    if len(set(names)) != len(names):
        raise DataError(f"{path}: shard {next(n for n in names if names.count(n) > 1)} is listed twice")
    if not isinstance(manifest.get("metadata", {}), dict):
        raise DataError(f"{path}: 'metadata' is not an object")
    total = sum(s["rows"] for s in shards)
    if "rows" in manifest and manifest["rows"] != total:
        raise DataError(f"{path}: 'rows' is {manifest['rows']}, but its shards hold {total}")


def shard_path(shard_dir: Path, name: str, manifest_path: Path) -> Path:
    """The file of shard `name`. A manifest is data: a name like `../../other/part.parquet`, an absolute path or a
    symlink out of the directory would make a reader take another directory's rows, so a shard must be a plain
    file name that resolves inside the manifest's own directory."""
    if name in ("", ".", "..") or "\0" in name or "/" in name or "\\" in name or Path(name).name != name:
        raise DataError(f"{manifest_path}: shard name {name!r} is not a plain file name in {shard_dir} "
                        "(a manifest may only list files beside it)")
    file = shard_dir / name
    if not file.is_file():
        raise DataError(f"{shard_dir}: shard {name} listed in the manifest is missing")
    if not file.resolve().is_relative_to(shard_dir.resolve()):
        raise DataError(f"{manifest_path}: shard {name} is a link to {file.resolve()}, outside {shard_dir} "
                        "(a manifest may only list files beside it)")
    return file


def _kind(dtype: pa.DataType) -> str:
    """A type's kind as readers use it: the width of a number does not matter (they convert), its kind does."""
    if pa.types.is_list(dtype) or pa.types.is_large_list(dtype):
        return f"list<{_kind(dtype.value_type)}>"
    for name, test in (("int", pa.types.is_integer), ("float", pa.types.is_floating), ("bool", pa.types.is_boolean),
                       ("string", lambda t: pa.types.is_string(t) or pa.types.is_large_string(t))):
        if test(dtype):
            return name
    return str(dtype)


def check_shard(file: Path, columns: dict[str, pa.DataType], rows: int | None = None, hint: str = "") -> None:
    """Before a shard is used: it is readable Parquet, holds the manifest's row count, and has each of `columns` with
    its type's kind; one error naming the file and every missing or mistyped column (`hint`: what to do)."""
    try:
        meta = pq.ParquetFile(file).metadata
        schema = meta.schema.to_arrow_schema()
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{file}: not a readable Parquet file ({str(e).splitlines()[0]}){hint}") from None
    missing = [name for name in columns if name not in schema.names]
    wrong = [f"{name} is {_kind(schema.field(name).type)}, not {_kind(dtype)}" for name, dtype in columns.items()
             if name in schema.names and _kind(schema.field(name).type) != _kind(dtype)]
    if missing or wrong:
        what = ([f"no column {', '.join(missing)}"] if missing else []) + wrong
        raise DataError(f"{file}: {'; '.join(what)}{hint}")
    if rows is not None and meta.num_rows != rows:
        raise DataError(f"{file}: {meta.num_rows} rows, the manifest says {rows}{hint}")


def check_shards(shard_dir: str | Path, manifest: dict, columns: dict[str, pa.DataType], hint: str = "") -> None:
    """`check_shard` for every shard the manifest lists (their footers only: cheap)."""
    for shard in manifest["shards"]:
        check_shard(Path(shard_dir) / shard["name"], columns, shard["rows"], hint)


def column_types(names) -> dict[str, pa.DataType]:
    """The types of attribution columns `names` (the paper's, the extra signals', the alternatives', the teacher's) as
    `attribute` writes them."""
    known = {**EXTRA_COLUMNS, **{k: v for kind in ALTERNATIVES for k, v in alternative_columns(kind).items()},
             **TEACHER_COLUMNS}
    return {name: SCHEMA.field(name).type if name in SCHEMA.names else known[name] for name in names}


def shard_files(shard_dir: str | Path, verify: bool = True) -> list[Path]:
    manifest = read_manifest(shard_dir, verify)  # every name confined to shard_dir
    return [Path(shard_dir) / s["name"] for s in manifest["shards"]]


def iter_rows(shard_dir: str | Path, columns: list[str] | None = None, batch_size: int = 256,
              verify: bool = True) -> Iterator[dict]:
    """Stream rows (as dicts of Python lists) shard by shard; memory is one record batch."""
    for file in shard_files(shard_dir, verify):
        for batch in pq.ParquetFile(file).iter_batches(batch_size=batch_size, columns=columns):
            yield from batch.to_pylist()


def read_table(shard_dir: str | Path, columns: list[str] | None = None) -> pa.Table:
    """All shards as one table sorted by sample id (small data, inspection and tests)."""
    tables = [pq.read_table(f, columns=columns) for f in shard_files(shard_dir)]
    table = pa.concat_tables(tables) if tables else SCHEMA.empty_table()
    return table.sort_by("sample_id") if "sample_id" in table.column_names else table

