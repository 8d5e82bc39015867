"""Atomic writes: every artifact is written to a temporary path beside its target, then renamed.

A killed stage therefore leaves either the old artifact or none, never a half-written one.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterable, Iterator


_UMASK = os.umask(0)
os.umask(_UMASK)


def _tmp_sibling(target: Path, is_dir: bool) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{target.name}.tmp-"
    if is_dir:
        return Path(tempfile.mkdtemp(prefix=prefix, dir=target.parent))
    fd, name = tempfile.mkstemp(prefix=prefix, dir=target.parent)
    os.close(fd)
    os.chmod(name, 0o666 & ~_UMASK)  # mkstemp makes 0600; the artifact gets the usual permissions
    return Path(name)


def _replace(tmp: Path, target: Path) -> None:
    if target.is_dir() and not target.is_symlink():
        # A directory cannot be replaced atomically: move the old one aside first, then drop it.
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.replace(target, old)
        os.replace(tmp, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, target)


@contextlib.contextmanager
def atomic_dir(target: str | os.PathLike) -> Iterator[Path]:
    """Yield a fresh temporary directory; on success it replaces `target`, on error it is removed."""
    target = Path(target)
    tmp = _tmp_sibling(target, is_dir=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _replace(tmp, target)


@contextlib.contextmanager
def atomic_file(target: str | os.PathLike, mode: str = "w") -> Iterator:
    """Open a temporary file for writing; on success it replaces `target`."""
    target = Path(target)
    tmp = _tmp_sibling(target, is_dir=False)
    try:
        with open(tmp, mode, encoding=None if "b" in mode else "utf-8") as handle:
            yield handle
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, target)


def write_json(target: str | os.PathLike, obj, indent: int = 2) -> None:
    with atomic_file(target) as f:
        json.dump(obj, f, indent=indent, sort_keys=False)
        f.write("\n")


def write_jsonl(target: str | os.PathLike, rows: Iterable[dict]) -> None:
    """JSON Lines, one record a line, as the Hugging Face hub stores TOFU's `<split>.json` files."""
    with atomic_file(target) as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False))
            f.write("\n")
