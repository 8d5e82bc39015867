"""What the Ray sweep costs and gains, in one run.

  overhead   Ray's start (a local Ray of 2 CPUs) and its cost per task: N stages whose command is `true`, run
             one at a time through the sweep, against the same commands run by subprocess
  dvc        the sweep driver's DVC calls per stage, on a one-stage project: is it up to date, and recording it
  stages     real stages of a pipeline (default: six evaluations of the paper's sweep, experiments/paper), rerun
             by `dvc repro --force --single-item` (one stage at a time, all cores to each) and by `tokenunlearn
             sweep --force --workers 2` (two at a time, a core each); both rewrite the same outputs, which
             dvc.lock records again (the stages are deterministic: the lock does not change)

    python benchmarks/bench_sweep.py                              # after `make paper`
    python benchmarks/bench_sweep.py --dvc-file dvc.yaml --stages evaluate@npo evaluate@t_npo   # after `make demo`
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pipeline.sweep.ledger import DvcLedger  # noqa: E402
from pipeline.sweep.runner import connect, run_sweep  # noqa: E402

MAIN = ["evaluate@ga", "evaluate@t_ga", "evaluate@s_ga", "evaluate@npo", "evaluate@t_npo", "evaluate@s_npo"]


def overhead(tasks: int) -> dict:
    import ray

    start = time.perf_counter()
    connect(None, 2)
    ray_start = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as tmp:
        plan = [{"stage": f"t{i}", "name": f"t{i}", "cmd": "true", "wdir": ".", "after": [], "cpus": 2, "gpus": 0}
                for i in range(tasks)]
        run_sweep(plan[:2], Path(tmp), Path(tmp) / "logs")  # the workers' first start, not counted
        start = time.perf_counter()
        run_sweep(plan, Path(tmp), Path(tmp) / "logs")
        swept = (time.perf_counter() - start) / tasks
    start = time.perf_counter()
    for _ in range(tasks):
        subprocess.run("true", shell=True, check=True)
    direct = (time.perf_counter() - start) / tasks
    ray.shutdown()
    return {"ray_start_s": round(ray_start, 2), "per_task_s": round(swept - direct, 3)}


def dvc_calls(repeats: int = 5) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "dvc.yaml").write_text("stages:\n  a:\n    cmd: echo a > a.txt\n    outs: [a.txt]\n")
        subprocess.run(["dvc", "init", "--no-scm", "-q"], cwd=root, check=True)
        (root / "a.txt").write_text("a\n")
        ledger, stale, record = DvcLedger(root), [], []
        for _ in range(repeats):
            t = time.perf_counter()
            ledger.record(["dvc.yaml:a"])
            record.append(time.perf_counter() - t)
            t = time.perf_counter()
            ledger.stale(["dvc.yaml:a"])
            stale.append(time.perf_counter() - t)
    return {"stale_s": round(statistics.median(stale), 3), "record_s": round(statistics.median(record), 3)}


def stages(dvc_file: str, names: list[str]) -> dict:
    """Rerun `names` both ways, in the DVC project that holds `dvc_file` (experiments/ for the experiments)."""
    path = (REPO / dvc_file).resolve()
    project = next(d for d in path.parents if (d / ".dvc").is_dir())
    dvc_file = str(path.relative_to(project))
    start = time.perf_counter()
    subprocess.run(["dvc", "repro", "--force", "--single-item", *(f"{dvc_file}:{n}" for n in names)], cwd=project,
                   check=True, capture_output=True)
    repro = time.perf_counter() - start
    log_dir = Path(tempfile.mkdtemp())
    start = time.perf_counter()
    subprocess.run(["tokenunlearn", "sweep", dvc_file, *names, "--force", "--workers", "2", "--log-dir",
                    str(log_dir)], cwd=project, check=True, capture_output=True)
    swept = time.perf_counter() - start
    ran = json.loads((log_dir / "sweep.json").read_text())["stages"]
    busy = sum(s["seconds"] for s in ran.values())
    return {"stages": len(names), "dvc_repro_s": round(repro, 1), "sweep_2_workers_s": round(swept, 1),
            "speedup": round(repro / swept, 2), "stage_seconds_sum": round(busy, 1),
            "sweep_over_ideal": round(swept / (busy / 2), 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", type=int, default=20)
    p.add_argument("--dvc-file", default="experiments/paper/dvc.yaml", help="the pipeline of the stages")
    p.add_argument("--stages", nargs="*", default=MAIN, help="its stages to rerun both ways")
    args = p.parse_args()
    result = {"overhead": overhead(args.tasks), "dvc": dvc_calls()}
    print(json.dumps(result), flush=True)
    if args.stages:
        result["stages"] = stages(args.dvc_file, args.stages)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    from pipeline.common.cli_errors import run_script  # as the CLI: one line per error, an exit status
    run_script(main)
