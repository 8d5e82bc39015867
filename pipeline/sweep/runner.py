"""Run a sweep's plan on Ray: each stage a Ray task with the CPUs and GPUs of its kind, started once the chosen
stages before it are done (and, where DVC is, recorded), skipped where DVC has it up to date; a failure stops only
the stages that need it. One machine (Ray started here) or a Ray cluster (its address): the same loop.

The stages run their own commands in the repository, so every node must see it at the same path (a shared file
system), with the same environment; the driver passes on the variables in DRIVER_ENV.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.common.atomic import write_json
from pipeline.common.errors import DataError, ParamError

log = logging.getLogger(__name__)

# What a stage takes from the driver's environment: where the tools and caches are, never the machine's own
# settings (its GPUs, its thread count: Ray and the stage's resources set those).
DRIVER_ENV = ("PATH", "VIRTUAL_ENV", "PYTHONPATH", "HF_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
              "TORCH_EXTENSIONS_DIR", "DS_ACCELERATOR")
DRIVER_ENV_PREFIXES = ("TOKENUNLEARN_", "NCCL_")
OK = ("done", "up to date")


def driver_env() -> dict:
    return {k: v for k, v in os.environ.items() if k in DRIVER_ENV or k.startswith(DRIVER_ENV_PREFIXES)}


def run_command(cmd: str, cwd: str, env: dict, log_path: str, threads: int) -> dict:
    """One stage, inside its Ray task: the command in a shell, its output in its log. Returns the exit code, the
    seconds it ran and where. Cancelled (Ctrl-C at the driver), it ends the command's whole process group."""
    import ray

    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, **env, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    with open(log_path, "w") as out:
        proc = subprocess.Popen(cmd, shell=True, cwd=cwd, env=full_env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait()
        except BaseException:
            os.killpg(proc.pid, signal.SIGTERM)
            raise
    return {"code": code, "seconds": round(time.perf_counter() - start, 2), "host": socket.gethostname(),
            "node": ray.get_runtime_context().get_node_id()}


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
    import ray

    root, log_dir = Path(root).resolve(), Path(log_dir).resolve()
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
            result.stages[entry["name"]] = {"stage": entry["stage"], "status": status, **info}
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
                    ref = task.options(num_cpus=entry["cpus"], num_gpus=entry["gpus"], name=entry["name"]).remote(
                        entry["cmd"], str(root / entry["wdir"]), env, str(log_dir / f"{entry['name']}.log"), threads)
                    running[ref] = entry
                if progressed or not running:
                    continue
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
