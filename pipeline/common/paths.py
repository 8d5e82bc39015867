"""Where things live: the project's cache directory."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """The project's cache (tag cache, Trankit's model, DeepSpeed's compiled ops): `TOKENUNLEARN_CACHE`, else
    ~/.cache/tokenunlearn."""
    return Path(os.environ.get("TOKENUNLEARN_CACHE", Path.home() / ".cache" / "tokenunlearn"))
