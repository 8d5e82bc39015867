"""Lock ownership: who holds a lock, whether its owner is still running, what a wait on a lock says while it
lasts, and the exclusive lock on an output a stage writes. `atomic.hold_outputs` takes these locks for a whole
(possibly multi-process) stage, and `distributed` breaks torch's build locks whose owner died."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from pipeline.common.errors import TokenUnlearnError


log = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class LockFile:
    """A lock file as read once: its owner where it names one (torch's build lock as `_OwnedBaton` writes it,
    "HOST PID"; an output lock, "pid PID on HOST"), its age, and what tells it from a lock taken since (`stamp`)."""

    path: Path
    text: str
    age: float  # seconds since it was written
    stamp: tuple  # inode, modification time and text: a new file may get the inode of one just removed
    host: str | None = None
    pid: int | None = None

    def owner_alive(self) -> bool | None:
        """Whether the owner runs; None where that cannot be told from here (no owner named, another host)."""
        if self.pid is None or self.host != socket.gethostname():
            return None
        return pid_alive(self.pid)

    def holder(self) -> str:
        """Who holds it, in words: "pid 12 on HOST, running", "an empty lock 40 s old", ..."""
        if self.pid is not None:
            alive = self.owner_alive()
            state = {True: "running", False: "not running"}.get(alive, "another host: whether it runs cannot be "
                                                                     "told from here")
            return f"pid {self.pid} on {self.host}, {state}"
        if not self.text:
            return f"an empty lock {self.age:.0f} s old"
        return f"an owner it cannot read ('{self.text[:100]}'), {self.age:.0f} s old"


def _read(path: Path) -> tuple[os.stat_result, str] | None:
    try:
        with open(path, "rb") as f:
            return os.fstat(f.fileno()), f.read(200).decode(errors="replace").strip()
    except FileNotFoundError:
        return None


def read_lock(path: Path) -> LockFile | None:
    """The lock file `path` as it is now; None when there is none."""
    if (read := _read(path)) is None:
        return None
    st, text = read
    # never below 0: a file's mtime may lie a hair after time.time() (CI printed "an empty lock -0 s old")
    age, stamp = max(0.0, time.time() - st.st_mtime), (st.st_ino, st.st_mtime_ns, text)
    if m := re.fullmatch(r"(\S+) (\d+)", text):
        return LockFile(path, text, age, stamp, m.group(1), int(m.group(2)))
    if m := re.fullmatch(r"pid (\d+) on (\S+)", text):
        return LockFile(path, text, age, stamp, m.group(2), int(m.group(1)))
    return LockFile(path, text, age, stamp)


def stale_lock_owner(path: Path, empty_after_seconds: float) -> str | None:
    """Who left the lock file `path`, if they are gone ("pid N on HOST, not running"; a lock that names no owner,
    "an empty lock N s old", once older than `empty_after_seconds`); None while it is held (or the owner cannot
    be told from here: another host)."""
    lock = read_lock(path)
    return _stale(lock, empty_after_seconds) if lock is not None else None


def _stale(lock: LockFile, empty_after_seconds: float) -> str | None:
    if lock.pid is not None:
        return lock.holder() if lock.owner_alive() is False else None
    return lock.holder() if lock.age > empty_after_seconds else None  # no owner to ask: its age decides


def break_stale_lock(path: Path, empty_after_seconds: float) -> str | None:
    """Remove the lock file `path` if its owner is gone (`stale_lock_owner`); returns that owner (also where another
    waiter removed it first), or None while it is held. Only the file judged is removed, never a lock another
    process took since."""
    lock = read_lock(path)
    owner = _stale(lock, empty_after_seconds) if lock is not None else None
    if owner is None:
        return None
    now = _read(path)
    if now is not None and (now[0].st_ino, now[0].st_mtime_ns, now[1]) != lock.stamp:
        return None  # replaced since it was read: a live process's lock now
    path.unlink(missing_ok=True)  # missing: another waiter broke it first
    return owner


# A wait on a lock says what it waits for at once and again this often while it lasts: a silent wait looks like a
# hang, and the lines name the lock to delete where its owner is gone and it is not broken on its own.
WAIT_REPORT_SECONDS = 30.0


class LockWait:
    """The lines of one wait on the lock file `path` (`what` it guards; `clear`, how to clear it by hand): call
    `report()` on every round of the wait; it logs at once, then every `every` seconds, each line with the lock, its
    holder as the file names it and how long the wait has lasted."""

    def __init__(self, path: str | os.PathLike, what: str, clear: str, every: float | None = None):
        self.path, self.what, self.clear, self.every = Path(path), what, clear, every or WAIT_REPORT_SECONDS
        self.start, self.next_at = time.monotonic(), None

    def report(self) -> None:
        now = time.monotonic()
        if self.next_at is not None and now < self.next_at:
            return
        waited = "waiting" if self.next_at is None else f"still waiting after {now - self.start:.0f} s"
        self.next_at = now + self.every
        lock = read_lock(self.path)
        holder = lock.holder() if lock is not None else "none any more (just released)"
        log.warning("%s for the lock %s (%s); its holder: %s; %s", waited, self.path, self.what, holder, self.clear)


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
