"""Where things live: the project's cache directory, and local paths told apart from hub ids."""

from __future__ import annotations

import os
import re
from pathlib import Path

from pipeline.common.errors import DataError


def cache_dir() -> Path:
    """The project's cache (tag cache, Trankit's model, DeepSpeed's compiled ops): `TOKENUNLEARN_CACHE`, else
    ~/.cache/tokenunlearn."""
    return Path(os.environ.get("TOKENUNLEARN_CACHE", Path.home() / ".cache" / "tokenunlearn"))


# A Hugging Face hub id: `owner/name`, one slash, letters, digits, `_`, `.` and `-`.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
_FILE_SUFFIXES = (".json", ".jsonl", ".parquet", ".csv", ".yaml", ".yml", ".txt", ".safetensors", ".bin", ".pt")


def is_hub_name(source: str | Path) -> bool:
    """Is `source` a hub id (`microsoft/phi-1_5`, `locuslab/TOFU`) rather than a local path? A path that exists is
    local; so is one that cannot be a hub id: more or less than one slash, a leading `.`, `/` or `~`, a file's
    suffix, or a first part that is a local directory (`artifacts/modls` is a mistyped path, not a hub id)."""
    text = str(source)
    if Path(text).exists() or not _HUB_ID.fullmatch(text) or text.lower().endswith(_FILE_SUFFIXES):
        return False
    return not Path(text.split("/")[0]).is_dir()


def require_local_or_hub(source: str | Path, what: str) -> None:
    """Fail at once on a path that looks local and does not exist (the hub would otherwise be tried for a minute
    before a network error)."""
    if not Path(source).exists() and not is_hub_name(source):
        raise DataError(f"{what} '{source}': no such file or directory")
