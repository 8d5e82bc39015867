"""Waits on torch's JIT build lock: a wait says at once, and every 30 s, which lock it waits on, who holds it and how
to clear it; a lock whose owner is not running is broken at once, an empty one after a minute. The clocks are
fakes: a minute of waiting takes no real time."""

import logging
import os
import socket
import subprocess
import sys
import time

import pytest

import pipeline.common.distributed as distributed
import pipeline.common.locks as locks
from pipeline.common.distributed import _OwnedBaton
from pipeline.common.errors import TokenUnlearnError

HOST = socket.gethostname()


class FakeClock:
    """`time` for the lock code: sleeping moves both clocks on at once; `on_sleep(seconds waited)` runs at each."""

    def __init__(self, on_sleep=None):
        self.wall, self.mono, self.on_sleep = time.time(), 1000.0, on_sleep
        self.waited = 0.0

    def time(self):
        return self.wall

    def monotonic(self):
        return self.mono

    def sleep(self, seconds):
        self.wall, self.mono, self.waited = self.wall + seconds, self.mono + seconds, self.waited + seconds
        if self.on_sleep is not None:
            self.on_sleep(self.waited)


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(locks, "time", fake)
    monkeypatch.setattr(distributed, "time", fake)
    return fake


@pytest.fixture
def lock(tmp_path):
    path = tmp_path / "torch_extensions" / "cpu_adam" / "lock"
    path.parent.mkdir(parents=True)
    return path


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _waits(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "for the lock" in r.getMessage()]


def test_a_wait_on_an_empty_lock_says_so_at_once_and_every_30_s_and_breaks_it_after_a_minute(lock, clock, caplog):
    caplog.set_level(logging.INFO)
    lock.touch()  # what a build killed by torch's own baton leaves
    at_first_sleep = []
    clock.on_sleep = lambda waited: at_first_sleep or at_first_sleep.append(list(_waits(caplog)))
    baton = _OwnedBaton(str(lock), wait_seconds=1.0)
    assert not baton.try_acquire()  # a fresh empty lock may be a live build's: wait for it
    with pytest.raises(TokenUnlearnError, match="died before it finished; its lock is removed: run the command "
                                                "again") as error:
        baton.wait()
    first = at_first_sleep[0]  # logged before the wait slept at all
    assert len(first) == 1 and first[0].startswith(f"waiting for the lock {lock} ")
    assert "its holder: an empty lock 0 s old" in first[0] and f"if no build of it is running, delete {lock}" in first[0]
    assert "an empty lock" in str(error.value)
    assert _OwnedBaton.EMPTY_LOCK_SECONDS == 60  # a minute, not the ten a stage used to wait in silence
    assert 60 <= clock.waited <= 61 and not lock.exists()  # broken a minute after it was made
    waits = _waits(caplog)
    assert [w.split(" for the lock")[0] for w in waits[:2]] == ["waiting", "still waiting after 30 s"]
    assert len(waits) in (2, 3)  # at 0 and 30 s, and at 60 s where the clock reaches the minute exactly
    assert any("removed the build lock" in r.getMessage() and "an empty lock" in r.getMessage()
               for r in caplog.records)


def test_an_empty_lock_older_than_a_minute_is_broken_at_once_and_a_younger_one_kept(lock, caplog):
    lock.touch()
    old = time.time() - 59
    os.utime(lock, (old, old))
    assert not _OwnedBaton(str(lock)).try_acquire() and lock.read_text() == ""
    old = time.time() - 61
    os.utime(lock, (old, old))
    baton = _OwnedBaton(str(lock))
    assert baton.try_acquire()  # this process builds
    assert lock.read_text() == f"{HOST} {os.getpid()}"
    assert "removed the build lock" in caplog.text and "an empty lock 61 s old" in caplog.text
    baton.release()


def test_a_lock_naming_a_dead_pid_is_broken_at_once(lock, clock, caplog):
    caplog.set_level(logging.INFO)
    pid = _dead_pid()
    lock.write_text(f"{HOST} {pid}")
    with pytest.raises(TokenUnlearnError, match=rf"\(pid {pid} on {HOST}, not running\) died before it finished"):
        _OwnedBaton(str(lock)).wait()
    assert clock.waited == 0 and not lock.exists()  # no wait at all
    assert f"removed the build lock {lock} of a killed run (pid {pid} on {HOST}, not running)" in caplog.text

    lock.write_text(f"{HOST} {pid}")
    baton = _OwnedBaton(str(lock))
    assert baton.try_acquire()  # a builder breaks it and builds
    baton.release()


@pytest.mark.parametrize("owner, holder", [
    (lambda: f"{HOST} {os.getpid()}", lambda: f"pid {os.getpid()} on {HOST}, running"),
    (lambda: "elsewhere 1", lambda: "pid 1 on elsewhere, another host: whether it runs cannot be told from here"),
])
def test_a_wait_on_a_live_or_remote_owner_names_it_every_30_s_until_released(lock, clock, caplog, owner, holder):
    caplog.set_level(logging.INFO)
    lock.write_text(owner())
    clock.on_sleep = lambda waited: lock.unlink() if waited >= 95 else None  # the build ends after 95 s
    _OwnedBaton(str(lock), wait_seconds=1.0).wait()  # returns: the build is done
    waits = _waits(caplog)
    assert [w.split(" for the lock")[0] for w in waits] == [
        "waiting", "still waiting after 30 s", "still waiting after 60 s", "still waiting after 90 s"]
    assert all(f"its holder: {holder()}; if no build of it is running, delete {lock}" in w for w in waits)
    assert "removed the build lock" not in caplog.text  # a live owner's lock is never broken


def test_an_output_locks_owner_is_read_too(tmp_path):
    path = tmp_path / ".model.lock"
    path.write_text(f"pid {os.getpid()} on {HOST}")
    assert locks.read_lock(path).holder() == f"pid {os.getpid()} on {HOST}, running"
    assert locks.stale_lock_owner(path, 0) is None
    path.write_text(f"pid {_dead_pid()} on {HOST}")
    assert locks.stale_lock_owner(path, 600).endswith("not running")


def test_a_lock_taken_since_it_was_judged_stale_is_not_removed(lock, monkeypatch):
    lock.write_text(f"{HOST} {_dead_pid()}")
    real_read = locks.read_lock

    def read_then_replaced(path):
        judged = real_read(path)
        path.unlink()
        path.write_text(f"{HOST} {os.getpid()}")  # a live process took the lock in between
        return judged

    monkeypatch.setattr(locks, "read_lock", read_then_replaced)
    assert locks.break_stale_lock(lock, 60) is None
    assert lock.read_text() == f"{HOST} {os.getpid()}"
