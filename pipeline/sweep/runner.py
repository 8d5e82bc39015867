"""Run a sweep's plan on Ray: each stage a Ray task with the CPUs and GPUs of its kind, started once the chosen
stages before it are done (and, where DVC is, recorded), skipped where DVC has it up to date; a failure stops only
the stages that need it. One machine (Ray started here) or a Ray cluster (its address): the same loop.

The stages run their own commands in the repository, so every node must see it at the same path (a shared file
system), with the same environment; the driver passes on the variables in DRIVER_ENV.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import fnmatch
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.common.atomic import write_json
from pipeline.common.errors import DataError, ParamError, TokenUnlearnError
from pipeline.sweep.plan import check_acyclic, read_outcome  # noqa: F401 - read_outcome: imported from here too

log = logging.getLogger(__name__)

# What a stage takes from the driver's environment: where the tools and caches are, never the machine's own
# settings (its GPUs, its thread count: Ray and the stage's resources set those).
DRIVER_ENV = ("PATH", "VIRTUAL_ENV", "PYTHONPATH", "HF_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
              "TORCH_EXTENSIONS_DIR", "DS_ACCELERATOR")
DRIVER_ENV_PREFIXES = ("TOKENUNLEARN_", "NCCL_")
OK = ("done", "up to date")
STOP_GRACE_S = 5.0  # a stopped stage's time between SIGTERM and SIGKILL
STOP_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))


def driver_env() -> dict:
    return {k: v for k, v in os.environ.items() if k in DRIVER_ENV or k.startswith(DRIVER_ENV_PREFIXES)}


def _die_with_parent(sig: int) -> None:
    """Have the kernel send `sig` to this process when its parent dies (Linux's PR_SET_PDEATHSIG; elsewhere
    nothing: there a killed worker's stage is ended only by the cancel below)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).prctl(1, sig)  # 1: PR_SET_PDEATHSIG


def _group_left(pgid: int, spare: set[int]) -> bool:
    """Whether a live process but `spare` is in process group `pgid` (read from Linux's /proc; elsewhere: yes)."""
    if not Path("/proc").is_dir():
        return True
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):  # ended meanwhile
            state, _, group = stat.read_text().rsplit(")", 1)[1].split()[:3]
            if int(group) == pgid and state not in ("Z", "X") and int(stat.parent.name) not in spare:
                return True
    return False


def end_group(pgid: int, spare: set[int]) -> None:
    """SIGTERM to a stage's process group, then SIGKILL once nothing but `spare` (the caller: it dies with it) is
    left in it, or after STOP_GRACE_S."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < deadline and _group_left(pgid, spare):
            time.sleep(0.05)
        os.killpg(pgid, signal.SIGKILL)


def _supervise(cmd: str, parent: int) -> int:
    """A stage's first process (see `launch`), the leader of the stage's own process group: it runs the command in
    a shell and, when the worker that launched it dies (SIGKILLed, or its node lost) or the group gets SIGTERM (the
    stage cancelled), ends the whole group, so no orphan goes on writing an output while Ray retries the stage
    elsewhere, or after the sweep stopped. A shell's own children (`a && b`) would not die with the shell, hence a
    group and this leader rather than a death signal on the shell alone. Ray SIGKILLs a dying worker's children,
    this leader among them, with no handler to run: then a sentinel, its child in the group, ends the rest, on the
    end of a pipe only this leader holds (the command does not inherit it)."""
    watch, held = os.pipe()
    sentinel = os.fork()
    if sentinel == 0:
        try:
            os.close(held)
            for sig in (signal.SIGTERM, signal.SIGINT):  # the group's signals are for the stage, not for its watch
                signal.signal(sig, signal.SIG_IGN)
            while os.read(watch, 1):
                pass
            end_group(os.getpgid(0), {os.getpid()})
        finally:
            os._exit(0)
    os.close(watch)

    def stop(*_):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        end_group(os.getpgid(0), {os.getpid(), sentinel})

    signal.signal(signal.SIGTERM, stop)
    _die_with_parent(signal.SIGTERM)
    if os.getppid() != parent:  # the worker died before the death signal was set
        stop()
    code = subprocess.call(cmd, shell=True)
    return code if code >= 0 else 128 - code  # killed by a signal: as a shell reports it


def launch(cmd: str, cwd: str, env: dict, out) -> subprocess.Popen:
    """Start a stage's command in its own process group, under `_supervise`: it dies with this process."""
    return subprocess.Popen([sys.executable, "-m", "pipeline.sweep.runner", "--supervise", cmd, str(os.getpid())],
                            cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)


def _ended(proc: subprocess.Popen) -> bool:
    """Whether a launched stage's leader has ended, without reaping it (its id stays its group's until then)."""
    if hasattr(os, "waitid"):
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is not None
    return proc.poll() is not None


def wait_and_end_group(proc: subprocess.Popen) -> int:
    """Wait for a launched stage, then end whatever of its process group is left (a background process it left
    behind). If the wait is cut short (the task cancelled: Ray raises KeyboardInterrupt in it, which only a wait
    that wakes up takes, hence the polling), end all of it: SIGTERM, then SIGKILL after STOP_GRACE_S (its leader
    does: see `_supervise`). The group is killed while its leader is not yet reaped, so its id cannot be some other
    process's by then."""
    try:
        while not _ended(proc):
            time.sleep(0.2)
    except BaseException:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S + 2
        while time.monotonic() < deadline and not _ended(proc):
            time.sleep(0.05)
        raise
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        code = proc.wait()
    return code


def run_command(cmd: str, cwd: str, env: dict, log_path: str, threads: int) -> dict:
    """One stage, inside its Ray task: the command in a shell, its output in its log. Returns the exit code, the
    seconds it ran and where. Cancelled (the driver stopped), it ends the command's whole process group.

    The log is appended to: a retry of the task (Ray reruns it when its worker dies) adds to the same run's log;
    the driver removed the previous run's before submitting the stage."""
    import ray

    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, **env, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    with open(log_path, "a") as out:
        code = wait_and_end_group(launch(cmd, cwd, full_env, out))
    return {"code": code, "seconds": round(time.perf_counter() - start, 2), "host": socket.gethostname(),
            "node": ray.get_runtime_context().get_node_id()}


def _flock(path: Path, what: str):
    """An exclusive lock on `path`, held while the returned file stays open; it dies with this process, so a killed
    sweep never leaves a stale one. Held already: an error naming the holder (written in the file)."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    handle = open(path, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read(200).strip() or "another process"
        handle.close()
        raise TokenUnlearnError(f"{what}: another sweep is running ({holder}); wait for it to end") from None
    handle.truncate(0)
    handle.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}")
    handle.flush()
    return handle


@contextlib.contextmanager
def one_sweep_at_a_time(root: Path, log_dir: Path):
    """One sweep per repository (its DVC scratch directory, where it has one) and per log directory: two would run
    the same stages into the same outputs and logs."""
    with contextlib.ExitStack() as stack:
        if (root / ".dvc").is_dir():
            stack.enter_context(_flock(root / ".dvc" / "tmp" / "sweep.lock", str(root)))
        stack.enter_context(_flock(log_dir / ".sweep.lock", str(log_dir)))
        yield


@dataclass
class SweepResult:
    stages: dict = field(default_factory=dict)  # name -> {status, seconds, host, node, code, error}
    seconds: float = 0.0

    def named(self, status: str) -> list[str]:
        return [n for n, s in self.stages.items() if s["status"] == status]


def connect(address: str | None, workers: int | None) -> bool:
    """Ray at `address`, or a local Ray with `workers` CPUs (all the machine's by default; its GPUs are found).
    True if this call started the connection (and so should end it)."""
    import ray

    if ray.is_initialized():
        return False
    if address:
        if workers:
            raise ParamError("--workers sizes a local Ray; a cluster's size is its own (ray start --num-cpus)")
        ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
    else:
        ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    return True


def check_feasible(plan: list[dict]) -> None:
    """Every stage fits on one node of the cluster; otherwise Ray would wait for it forever."""
    import ray

    nodes = [n["Resources"] for n in ray.nodes() if n["Alive"]]
    most = {r: max((n.get(r, 0) for n in nodes), default=0) for r in ("CPU", "GPU")}
    for entry in plan:
        for key, resource in (("cpus", "CPU"), ("gpus", "GPU")):
            if entry[key] > most[resource]:
                kind = entry["name"].split("@")[0]
                raise ParamError(f"sweep.resources.{kind}.{key}={entry[key]:g}: stage '{entry['name']}' needs more "
                                 f"than the largest node of the Ray cluster has ({most[resource]:g} {resource})")


def _record(ledger, succeeded: list[tuple[dict, dict]]) -> list[tuple[tuple[dict, dict], str | None]]:
    """Record the stages that ended well in dvc.lock, all at once; if that fails, one by one, so that only the
    stage whose outputs are not what DVC expects fails. Pairs each with its error, or None."""
    if ledger is None or not succeeded:
        return [(item, None) for item in succeeded]
    try:
        ledger.record([entry["stage"] for entry, _ in succeeded])
        return [(item, None) for item in succeeded]
    except DataError:
        results = []
        for item in succeeded:
            try:
                ledger.record([item[0]["stage"]])
                results.append((item, None))
            except DataError as e:
                results.append((item, str(e)))
        return results


class SweepStopped(TokenUnlearnError):
    """The driver was stopped (SIGINT, SIGTERM, SIGHUP): it ended the stages running and recorded none of them."""


def _catch_stops(caught: list):
    """SIGINT, SIGTERM, SIGHUP while the driver runs: the first goes in `caught`, for the loop to stop where it waits
    (never amid a record in dvc.lock); a second stops it at once (a DVC lock held elsewhere can keep it from its next
    wait for minutes). Set after `ray.init`, whose own SIGTERM handler exits at once. Returns what sets them back."""
    def on_signal(signum, frame):
        caught.append(signum)
        log.warning("%s: stopping the sweep and the stages it runs", signal.Signals(signum).name)
        if len(caught) == 2:
            raise KeyboardInterrupt

    if threading.current_thread() is not threading.main_thread():  # only there can Python take a signal
        return lambda: None
    previous = {s: signal.signal(s, on_signal) for s in STOP_SIGNALS}
    return lambda: [signal.signal(s, handler) for s, handler in previous.items()]


def _cancel(refs: list) -> None:
    """End the stages running, and wait for them, so that none outlives the driver: each task ends its command's
    group (SIGTERM, then SIGKILL after STOP_GRACE_S); a task late to end has its worker killed (see `_supervise`)."""
    import ray

    for force in (False, True):
        for ref in refs:
            with contextlib.suppress(ray.exceptions.RayError):
                ray.cancel(ref, force=force)
        refs = ray.wait(refs, num_returns=len(refs), timeout=STOP_GRACE_S + 10)[1] if refs else []


def run_sweep(plan: list[dict], root: Path, log_dir: Path, *, address: str | None = None, workers: int | None = None,
              first: tuple = (), ledger=None, force: bool = False) -> SweepResult:
    """Run `plan`; with a `ledger` (DVC), skip each stage it has up to date (unless `force`) and record each one
    that ran, as it ends. Logs in `log_dir/STAGE.log`, the outcome in `log_dir/sweep.json`. Stopped (SIGINT,
    SIGTERM, SIGHUP), it ends the stages running, records none of them, and raises SweepStopped."""
    root, log_dir = Path(root).resolve(), Path(log_dir).resolve()
    check_acyclic(plan, "sweep plan")
    with one_sweep_at_a_time(root, log_dir):
        return _run(plan, root, log_dir, address, workers, first, ledger, force)


def _run(plan, root, log_dir, address, workers, first, ledger, force) -> SweepResult:
    import ray

    started = connect(address, workers)
    result, t0 = SweepResult(), time.perf_counter()
    caught: list = []  # the signals that stop the sweep
    restore = _catch_stops(caught)
    try:
        check_feasible(plan)
        task = ray.remote(run_command)
        env = driver_env()
        pending = {e["name"]: e for e in plan}
        waited_on = {n: sum(n in e["after"] for e in plan) for n in pending}
        running: dict = {}  # ObjectRef -> plan entry

        def settle(entry, status, **info):
            # its fingerprint (where the plan has one) goes on to --record, which checks the stage is still this one
            kept = {"fingerprint": entry["fingerprint"]} if "fingerprint" in entry else {}
            result.stages[entry["name"]] = {"stage": entry["stage"], "status": status, **info, **kept}
            log.log({"failed": logging.ERROR, "blocked": logging.ERROR, "stopped": logging.WARNING}.get(
                status, logging.INFO), "%s: %s%s%s", entry["name"], status,
                f" in {info['seconds']:.0f} s" if "seconds" in info else "",
                f": {info['error']}" if status in ("failed", "stopped") and "error" in info else "")

        def collect(ended, stopped_by=None) -> list:
            """Settle the stages whose tasks ended, but those that ended well: returned, to be recorded. Stopping,
            a task that did not return (cancelled, its worker gone) is a stage stopped."""
            succeeded = []
            for ref in ended:
                entry = running.pop(ref)
                try:
                    out = ray.get(ref, timeout=5)  # it has ended (or been cancelled, and waited for)
                except ray.exceptions.RayError as e:  # the worker or its node died; or the task was cancelled
                    if stopped_by:
                        settle(entry, "stopped", error=f"its command was ended ({stopped_by}); nothing recorded")
                    else:
                        settle(entry, "failed", error=str(e).splitlines()[0])
                    continue
                if out["code"] != 0:
                    settle(entry, "failed", **out, error=f"exit {out['code']}, log {log_dir / entry['name']}.log")
                else:
                    succeeded.append((entry, out))
            return succeeded

        try:
            while (pending or running) and not caught:
                progressed = False
                for entry in list(pending.values()):
                    states = [result.stages[a]["status"] for a in entry["after"] if a in result.stages]
                    if any(s not in OK for s in states):
                        settle(pending.pop(entry["name"]), "blocked", error="a stage it needs failed")
                        progressed = True
                ready = [e for e in pending.values()
                         if all(a in result.stages or a not in waited_on for a in e["after"])]
                ready.sort(key=lambda e: (not any(fnmatch.fnmatchcase(e["name"], f) for f in first),
                                          -waited_on[e["name"]]))
                stale = None if ledger is None or force or not ready else ledger.stale([e["stage"] for e in ready])
                if caught:  # stopped while DVC was asked: start nothing more
                    break
                for entry in ready:
                    del pending[entry["name"]]
                    progressed = True
                    if stale is not None and entry["stage"] not in stale:
                        settle(entry, "up to date")
                        continue
                    threads = max(1, int(entry["cpus"]))
                    # this run's log: the last run's goes (a process still writing it writes to no name, not here)
                    (log_dir / f"{entry['name']}.log").unlink(missing_ok=True)
                    ref = task.options(num_cpus=entry["cpus"], num_gpus=entry["gpus"], name=entry["name"]).remote(
                        entry["cmd"], str(root / entry["wdir"]), env, str(log_dir / f"{entry['name']}.log"), threads)
                    running[ref] = entry
                if progressed:
                    continue
                if not running:  # stages left that can never start (check_acyclic refuses such a plan)
                    raise DataError(f"sweep plan: {sorted(pending)} wait on each other; none can start")
                # then every stage that has ended by now: one record for all; waits of a second, to see a stop
                if not ray.wait(list(running), num_returns=1, timeout=1.0)[0]:
                    continue
                ended, _ = ray.wait(list(running), num_returns=len(running), timeout=0)
                for (entry, out), error in _record(ledger, collect(ended)):
                    settle(entry, "failed" if error else "done", **out, **({"error": error} if error else {}))
        except KeyboardInterrupt:  # a second signal, or Ctrl-C where no handler of ours was set
            caught.append(signal.SIGINT)
        if caught and (running or pending):  # (else it stopped as it ended anyway)
            name = signal.Signals(caught[0]).name
            _cancel(list(running))
            for (entry, out), error in _record(ledger, collect(list(running), stopped_by=name)):
                settle(entry, "failed" if error else "done", **out, **({"error": error} if error else {}))
            resume = ("the stages that finished are recorded in dvc.lock: rerun the same command to run the rest"
                      if ledger is not None else f"the stages that finished are in {log_dir / 'sweep.json'} "
                      "(--record records them): rerun the same command to run the plan again")
            raise SweepStopped(f"sweep stopped by {name}: the running stages were ended, nothing recorded for "
                               f"them ({', '.join(result.named('stopped')) or 'none'}); {resume}")
    finally:
        restore()
        result.seconds = round(time.perf_counter() - t0, 2)
        write_json(log_dir / "sweep.json", {"seconds": result.seconds, "stages": result.stages})
        if started:
            ray.shutdown()
    return result


if __name__ == "__main__" and sys.argv[1:2] == ["--supervise"]:  # a stage's first process: see `launch`
    sys.exit(_supervise(sys.argv[2], int(sys.argv[3])))
