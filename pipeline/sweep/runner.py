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
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.common.atomic import write_json
from pipeline.common.errors import DataError, ParamError, TokenUnlearnError
from pipeline.sweep.plan import check_acyclic

log = logging.getLogger(__name__)

# What a stage takes from the driver's environment: where the tools and caches are, never the machine's own
# settings (its GPUs, its thread count: Ray and the stage's resources set those).
DRIVER_ENV = ("PATH", "VIRTUAL_ENV", "PYTHONPATH", "HF_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
              "TORCH_EXTENSIONS_DIR", "DS_ACCELERATOR")
DRIVER_ENV_PREFIXES = ("TOKENUNLEARN_", "NCCL_")
OK = ("done", "up to date")


def driver_env() -> dict:
    return {k: v for k, v in os.environ.items() if k in DRIVER_ENV or k.startswith(DRIVER_ENV_PREFIXES)}


def _die_with_parent(sig: int) -> None:
    """Have the kernel send `sig` to this process when its parent dies (Linux's PR_SET_PDEATHSIG; elsewhere
    nothing: there a killed worker's stage is ended only by the cancel below)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).prctl(1, sig)  # 1: PR_SET_PDEATHSIG


def _supervise(cmd: str, parent: int) -> int:
    """A stage's first process (see `launch`), the leader of the stage's own process group: it runs the command in
    a shell and, when the worker that launched it dies (SIGKILLed, or its node lost), ends the whole group, so no
    orphan goes on writing an output while Ray retries the stage elsewhere. A shell's own children (`a && b`) would
    not die with the shell, hence a group and this leader rather than a death signal on the shell alone."""
    signal.signal(signal.SIGTERM, lambda *_: os.killpg(0, signal.SIGKILL))
    _die_with_parent(signal.SIGTERM)
    if os.getppid() != parent:  # the worker died before the death signal was set
        os.killpg(0, signal.SIGKILL)
    code = subprocess.call(cmd, shell=True)
    return code if code >= 0 else 128 - code  # killed by a signal: as a shell reports it


def launch(cmd: str, cwd: str, env: dict, out) -> subprocess.Popen:
    """Start a stage's command in its own process group, under `_supervise`: it dies with this process."""
    return subprocess.Popen([sys.executable, "-m", "pipeline.sweep.runner", "--supervise", cmd, str(os.getpid())],
                            cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)


def wait_and_end_group(proc: subprocess.Popen) -> int:
    """Wait for a launched stage, then end whatever of its process group is left (a background process it left
    behind); if the wait is cut short (the task cancelled or failing), end all of it. The group is killed while
    its leader is not yet reaped, so its id cannot be some other process's by then."""
    try:
        if hasattr(os, "waitid"):
            os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
        else:
            proc.wait()
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        code = proc.wait()
    return code


def run_command(cmd: str, cwd: str, env: dict, log_path: str, threads: int) -> dict:
    """One stage, inside its Ray task: the command in a shell, its output in its log. Returns the exit code, the
    seconds it ran and where. Cancelled (Ctrl-C at the driver), it ends the command's whole process group.

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


STATUSES = ("done", "up to date", "failed", "blocked")


def read_outcome(path: Path) -> dict[str, dict]:
    """A sweep's sweep.json, checked: its stages (name -> {stage, status, ...}); a bad one is an error naming the
    file and what is wrong."""
    try:
        outcome = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: not a readable sweep.json (a sweep's outcome): {e}") from None
    stages = outcome.get("stages") if isinstance(outcome, dict) else None
    if not isinstance(stages, dict):
        raise DataError(f"{path}: not a sweep's sweep.json: it needs a mapping 'stages' of stage name -> outcome")
    for name, info in stages.items():
        if not isinstance(info, dict):
            raise DataError(f"{path}: stages.{name} is a {type(info).__name__}, not a mapping {{stage, status}}")
        if not isinstance(info.get("stage"), str) or not info["stage"]:
            raise DataError(f"{path}: stages.{name}.stage: missing or not a DVC stage address (text)")
        if info.get("status") not in STATUSES:
            raise DataError(f"{path}: stages.{name}.status is {info.get('status')!r}, not one of {list(STATUSES)}")
        if not isinstance(info.get("fingerprint"), (str, type(None))):
            raise DataError(f"{path}: stages.{name}.fingerprint is {info['fingerprint']!r}, not text")
    return stages


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


def run_sweep(plan: list[dict], root: Path, log_dir: Path, *, address: str | None = None, workers: int | None = None,
              first: tuple = (), ledger=None, force: bool = False) -> SweepResult:
    """Run `plan`; with a `ledger` (DVC), skip each stage it has up to date (unless `force`) and record each one
    that ran, as it ends. Logs in `log_dir/STAGE.log`, the outcome in `log_dir/sweep.json`."""
    root, log_dir = Path(root).resolve(), Path(log_dir).resolve()
    check_acyclic(plan, "sweep plan")
    with one_sweep_at_a_time(root, log_dir):
        return _run(plan, root, log_dir, address, workers, first, ledger, force)


def _run(plan, root, log_dir, address, workers, first, ledger, force) -> SweepResult:
    import ray

    started = connect(address, workers)
    result, t0 = SweepResult(), time.perf_counter()
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
            (log.error if status in ("failed", "blocked") else log.info)(
                "%s: %s%s%s", entry["name"], status, f" in {info['seconds']:.0f} s" if "seconds" in info else "",
                f": {info['error']}" if status == "failed" and "error" in info else "")

        try:
            while pending or running:
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
                ray.wait(list(running), num_returns=1)  # then every stage that has ended by now: one record for all
                ended, _ = ray.wait(list(running), num_returns=len(running), timeout=0)
                succeeded = []
                for ref in ended:
                    entry = running.pop(ref)
                    try:
                        out = ray.get(ref)
                    except ray.exceptions.RayError as e:  # the worker or its node died
                        settle(entry, "failed", error=str(e).splitlines()[0])
                        continue
                    if out["code"] != 0:
                        settle(entry, "failed", **out, error=f"exit {out['code']}, log {log_dir / entry['name']}.log")
                    else:
                        succeeded.append((entry, out))
                for (entry, out), error in _record(ledger, succeeded):
                    settle(entry, "failed" if error else "done", **out, **({"error": error} if error else {}))
        except KeyboardInterrupt:
            for ref in running:
                ray.cancel(ref)
            raise
    finally:
        result.seconds = round(time.perf_counter() - t0, 2)
        write_json(log_dir / "sweep.json", {"seconds": result.seconds, "stages": result.stages})
        if started:
            ray.shutdown()
    return result


def record_outcome(record: Path, ledger) -> None:
    """--record: the stages a --plan run finished, into dvc.lock, where each is still the stage its plan had (its
    fingerprint); any other is refused by name, since its outputs follow from a command, params or inputs that are
    no longer the stage's."""
    stages = read_outcome(record)
    done = {s["stage"]: s.get("fingerprint") for s in stages.values() if s["status"] == "done"}
    refused = ledger.record(list(done), expected=done, planned=[s["stage"] for s in stages.values()])
    log.info("recorded %d stages in dvc.lock", len(done) - len(refused))
    if refused:
        unmarked = [a for a in refused if done[a] is None]
        raise DataError(f"{record}: not recorded, as their command, params or inputs changed since the plan was "
                        f"written (or the plan has no fingerprint{': ' + ', '.join(unmarked) if unmarked else ''}): "
                        f"{', '.join(refused)}; run them again (tokenunlearn sweep PIPELINE STAGES)")


if __name__ == "__main__" and sys.argv[1:2] == ["--supervise"]:  # a stage's first process: see `launch`
    sys.exit(_supervise(sys.argv[2], int(sys.argv[3])))
