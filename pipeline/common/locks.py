"""Lock ownership: who holds a lock, whether its owner is still running, and the exclusive lock on an output a
stage writes. `atomic.hold_outputs` takes these locks for a whole (possibly multi-process) stage, and
`distributed` breaks torch's build locks whose owner died."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from pathlib import Path
from typing import Iterator

from pipeline.common.errors import TokenUnlearnError


_UMASK = os.umask(0)  # read once, at import: setting it back and forth later would race other threads
os.umask(_UMASK)


def pid_alive(pid: int) -> bool:
    """Whether process `pid` of this host is running (another user's counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def stale_lock_owner(path: Path, empty_after_seconds: float) -> str | None:
    """Who left the lock file `path`, if they are gone ("pid N on HOST, not running"); None while it is held (or
    the owner cannot be told from here: another host)."""
    try:
        text, age = path.read_text(errors="replace").split(), time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return None
    if len(text) == 2 and text[1].isdigit():
        host, pid = text[0], int(text[1])
        if host != socket.gethostname() or pid_alive(pid):
            return None
        return f"pid {pid} on {host}, not running"
    return f"an empty lock {age:.0f} s old" if age > empty_after_seconds else None


class OutputBusy(TokenUnlearnError):
    """Another run is writing the same output."""


def lock_file(target: Path) -> Path:
    return target.parent / f".{target.name}.lock"


@contextlib.contextmanager
def output_lock(target: Path) -> Iterator[None]:
    """Hold an exclusive lock on `target` (a lock file beside it) or fail at once; the lock dies with the process,
    so a killed run never leaves a stale one."""
    import fcntl

    path = lock_file(target)
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666 & ~_UMASK)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise OutputBusy(f"{target}: another run is writing it ({holder}); wait for it to finish, or write "
                             "elsewhere (--out)") from None
        # The lock file may have been removed and recreated by a run that just finished: lock the current one.
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode())
        yield
    finally:
        path.unlink(missing_ok=True)
        os.close(fd)


def refuse_symlink(target: Path) -> None:
    if target.is_symlink():
        raise TokenUnlearnError(f"{target}: is a symbolic link (to {os.readlink(target)}); outputs are replaced "
                                "atomically, which would replace the link: give the real path instead")
