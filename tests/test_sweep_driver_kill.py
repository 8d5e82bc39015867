"""A sweep's driver stopped (SIGTERM, Ctrl-C, its terminal closed) ends the stage commands it started, records
nothing for them, and says how to resume; no stage goes on to write an output that dvc.lock never records."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.sweep.runner import STOP_GRACE_S, launch, wait_and_end_group

from tests.conftest import cli_env

STAGE_SECONDS = 8
# a compound command: the shell forks, so the whole process group must go, not only the shell
STAGE = f"echo $$ > stage.pid; sleep {STAGE_SECONDS}; echo done > out.txt"
# Under a sweep, a stage that outlives any stop the test may wait for (Ray's shutdown on busy cores takes seconds):
# once its group is gone, nothing can write its output any more.
SWEPT_STAGE = "echo $$ > stage.pid; sleep 120; echo done > out.txt"


def _group_alive(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group `pgid`."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            alive.append(int(stat.parent.name))
    return alive


def _dvc_project(tmp_path: Path) -> dict:
    (tmp_path / "dvc.yaml").write_text(f"stages:\n  slow:\n    cmd: {SWEPT_STAGE}\n    outs: [out.txt]\n")
    (tmp_path / "params.yaml").write_text("sweep: {resources: {default: {cpus: 1}}}\n")
    env = {**cli_env(), "DVC_NO_ANALYTICS": "1", "OMP_NUM_THREADS": "1"}
    subprocess.run(["dvc", "init", "--no-scm", "-q"], cwd=tmp_path, env=env, check=True)
    return env


def _started(path: Path, seconds: float = 10.0) -> int:
    deadline = time.monotonic() + seconds
    while not (path.is_file() and path.read_text().strip()):
        assert time.monotonic() < deadline, "the stage did not start"
        time.sleep(0.05)
    return int(path.read_text())


def _gone_within(pgid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _group_alive(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads process groups from /proc")


@linux
def test_a_stage_whose_supervisor_is_sigkilled_is_ended_by_its_sentinel(tmp_path):
    """Ray SIGKILLs a dying worker's children, the stage's supervisor among them: no handler of its own runs, yet
    the shell and what it started must not go on."""
    with open(tmp_path / "log", "a") as out:
        proc = launch(STAGE, str(tmp_path), dict(os.environ), out)
        pgid = os.getpgid(_started(tmp_path / "stage.pid"))
        assert pgid == proc.pid
        proc.kill()
        proc.wait()
        assert _gone_within(pgid, 5), f"{_group_alive(pgid)} outlived their SIGKILLed supervisor"
    time.sleep(max(0.0, STAGE_SECONDS - 5 + 1))
    assert not (tmp_path / "out.txt").exists()


@linux
def test_a_cancelled_stage_gets_sigterm_then_sigkill_after_a_grace(tmp_path):
    """A cancel is SIGTERM to the whole group, which a stage may handle; what ignores it is SIGKILLed after the
    grace."""
    def cancel_after(seconds):
        def cancel(*_):
            raise KeyboardInterrupt  # what ray.cancel raises in the task
        previous = signal.signal(signal.SIGALRM, cancel)
        signal.setitimer(signal.ITIMER_REAL, seconds)
        return previous

    with open(tmp_path / "log", "a") as out:
        # handles SIGTERM: its handler runs (the shell's `wait` returns at once on a trapped signal)
        proc = launch("trap 'echo term > term.txt; exit 0' TERM; echo $$ > stage.pid; sleep 30 & wait",
                      str(tmp_path), dict(os.environ), out)
        pgid = os.getpgid(_started(tmp_path / "stage.pid"))
        previous = cancel_after(0.3)
        try:
            with pytest.raises(KeyboardInterrupt):
                wait_and_end_group(proc)
        finally:
            signal.signal(signal.SIGALRM, previous)
        assert (tmp_path / "term.txt").read_text() == "term\n" and _gone_within(pgid, 2)

        # ignores it (and so does its `sleep`, which inherits that): killed after the grace
        (tmp_path / "stage.pid").unlink()
        proc = launch("trap '' TERM; echo $$ > stage.pid; sleep 30", str(tmp_path), dict(os.environ), out)
        pgid = os.getpgid(_started(tmp_path / "stage.pid"))
        previous = cancel_after(0.3)
        start = time.monotonic()
        try:
            with pytest.raises(KeyboardInterrupt):
                wait_and_end_group(proc)
        finally:
            signal.signal(signal.SIGALRM, previous)
        assert _gone_within(pgid, 2) and time.monotonic() - start >= STOP_GRACE_S - 0.5


@pytest.mark.slow
@linux
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stopped_driver_ends_its_running_stages_and_records_nothing(tmp_path, sig):
    pytest.importorskip("ray")
    env = _dvc_project(tmp_path)
    driver = subprocess.Popen(["tokenunlearn", "sweep", "dvc.yaml", "slow", "--workers", "1"], cwd=tmp_path,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)  # a signal meant for it alone, not for pytest
    try:
        deadline = time.monotonic() + 40
        pid_file = tmp_path / "stage.pid"
        while not (pid_file.is_file() and pid_file.read_text().strip()):
            assert driver.poll() is None, driver.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the stage did not start"
            time.sleep(0.05)
        shell = int(pid_file.read_text())
        pgid = os.getpgid(shell)
        assert pgid != os.getpgid(driver.pid)  # the stage runs in a group of its own

        driver.send_signal(sig)
        _, err = driver.communicate(timeout=30)
        assert driver.returncode != 0, err[-3000:]
        assert _gone_within(pgid, 10), f"the stage's processes {_group_alive(pgid)} outlived the driver"
        assert not (tmp_path / "out.txt").exists(), "a stopped stage wrote its output"
        lock = tmp_path / "dvc.lock"
        assert not lock.exists() or "slow" not in lock.read_text()
        # one line per stage it stopped, and how to resume; no traceback
        assert "Traceback" not in err, err[-3000:]
        assert "slow: stopped" in err and "rerun the same command" in err, err[-3000:]
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
