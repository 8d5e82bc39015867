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
}
EXTRA_COLUMNS = {
    "copied": pa.list_(pa.bool_()),          # the token's word occurs in the prompt (corpus: earlier in the passage)
    "span": pa.list_(pa.int32()),            # span id: a phrase of content words, else the word; -1 special tokens
    "delta_noun_min": f32,                   # min / max over the prompt's nouns of |Δ| masking that noun alone
    "delta_noun_max": f32,
    "grad_x_input": f32,                     # |embedding · gradient of the answer's log-likelihood|
    "learned": f32,                          # the learned scorer's probability that the token is a fact
}


def shard_schema(signals: list[str] = ()) -> pa.Schema:
    """The paper's columns, then those the extra `signals` add."""
    schema = SCHEMA
    for signal in sorted(signals):
        for name in SIGNAL_COLUMNS[signal]:
            schema = schema.append(pa.field(name, EXTRA_COLUMNS[name]))
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


def read_manifest(shard_dir: str | Path, verify: bool = True) -> dict:
    """The manifest of a shard directory; with `verify`, every shard's size and sha256 are checked."""
    shard_dir = Path(shard_dir)
    path = shard_dir / MANIFEST
    if not path.is_file():
        raise DataError(f"{shard_dir}: no {MANIFEST}: not a complete attribution directory (rerun `attribute`)")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: malformed JSON ({e.msg})") from None
    if manifest.get("schema_version") != SCHEMA_VERSION:
        raise DataError(f"{path}: schema_version {manifest.get('schema_version')}, this code reads {SCHEMA_VERSION}")
    for shard in manifest["shards"]:
        file = shard_dir / shard["name"]
        if not file.is_file():
            raise DataError(f"{shard_dir}: shard {shard['name']} listed in the manifest is missing")
        if verify and _sha256(file) != shard["sha256"]:
            raise DataError(f"{shard_dir}: shard {shard['name']} does not match the manifest's sha256")
    return manifest


def shard_files(shard_dir: str | Path, verify: bool = True) -> list[Path]:
    manifest = read_manifest(shard_dir, verify)
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

