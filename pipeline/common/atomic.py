"""Atomic writes: every artifact is written to a temporary path beside its target, then renamed; and output locks.

A killed stage therefore leaves either the old artifact or none, never a half-written one; and two runs cannot
write the same output at once (`hold_outputs`).
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import re
import shutil
import socket
import stat
import tempfile
from pathlib import Path
from typing import Iterable, Iterator

from pipeline.common.locks import OutputBusy, output_lock, pid_alive, refuse_symlink


log = logging.getLogger(__name__)

_UMASK = os.umask(0)
os.umask(_UMASK)


def _tmp_sibling(target: Path, is_dir: bool) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(target)
    # The name carries the host and pid, so the next run can tell a dead run's leftover from a live run's work.
    prefix = f".{target.name}.tmp-{socket.gethostname()}-{os.getpid()}-"
    if is_dir:
        path = Path(tempfile.mkdtemp(prefix=prefix, dir=target.parent))
        os.chmod(path, 0o777 & ~_UMASK)  # mkdtemp makes 0700; the artifact follows the user's umask
        return path
    fd, name = tempfile.mkstemp(prefix=prefix, dir=target.parent)
    os.close(fd)
    os.chmod(name, 0o666 & ~_UMASK)  # mkstemp makes 0600; the artifact follows the user's umask
    return Path(name)


def _follow_umask(root: Path) -> None:
    """Give every file and directory under `root` (itself included) the mode a plain create under the user's umask
    gives: libraries that write through a temporary file and rename it (safetensors' `save_file`, so every
    `save_pretrained`) leave 0600, which another user of a shared artifacts directory cannot read."""
    for path in [root, *root.rglob("*")]:
        st = path.lstat()
        if stat.S_ISLNK(st.st_mode):
            continue  # chmod would change the link's target, which may lie outside the output
        # Directories and executables keep their execute bits, as a create with them would; a shared directory's
        # setgid bit (its group passed on to what is made in it) is kept.
        full = 0o777 if stat.S_ISDIR(st.st_mode) or st.st_mode & 0o111 else 0o666
        mode = stat.S_IMODE(st.st_mode) & 0o7000 | full & ~_UMASK
        if stat.S_IMODE(st.st_mode) != mode:
            os.chmod(path, mode)


def remove_leftovers(target: Path) -> list[Path]:
    """Remove the temporary siblings (`.NAME.tmp-HOST-PID-*`, `.NAME.old-PID`) that killed runs of this host left
    beside `target`; a live run's are kept. Returns what was removed."""
    host, removed = socket.gethostname(), []
    for path in target.parent.glob(f".{glob.escape(target.name)}.*"):
        rest = path.name[len(target.name) + 2:]
        m = re.fullmatch(rf"tmp-{re.escape(host)}-(\d+)-.*|old-(\d+)", rest)
        if not m or pid_alive(int(m.group(1) or m.group(2))):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path)
    if removed:
        log.info("removed %d leftover(s) of killed runs beside %s", len(removed), target)
    return removed


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
    """Yield a fresh temporary directory; on success its tree is given the umask's modes (`_follow_umask`) and it
    replaces `target`; on error it is removed."""
    target = Path(target)
    tmp = _tmp_sibling(target, is_dir=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _follow_umask(tmp)
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


# ---- output locks, held for a stage ---------------------------------------------------------------------------

@contextlib.contextmanager
def hold_outputs(*targets: str | os.PathLike | None) -> Iterator[None]:
    """Lock each output (directory or file) while a stage writes it, so two runs never write the same output, or
    resume from each other's checkpoints; refuse an output that is a symbolic link. In a multi-process run the
    main process locks and every process gets the same answer."""
    from pipeline.common.distributed import broadcast_from_main, is_main_process  # torch, only when needed

    paths = [Path(t) for t in targets if t is not None]
    for path in paths:
        refuse_symlink(path)
    error, stack = None, contextlib.ExitStack()
    with stack:
        if is_main_process():
            try:
                for path in paths:
                    stack.enter_context(output_lock(path))
            except OutputBusy as e:
                error = str(e)
        error = broadcast_from_main(error)
        if error:
            raise OutputBusy(error)
        yield
