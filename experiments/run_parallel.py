"""Run the stages of a DVC pipeline several at a time, then record them in its dvc.lock.

`dvc repro` runs one stage at a time. The unlearning and evaluation stages of a pipeline are independent but for
unlearn@X before evaluate@X, so a machine with many cores or GPUs can run them side by side. This script takes
the chosen stages and their commands from DVC itself, or from a plan file it wrote earlier (for a machine without
DVC), starts each stage once the chosen stages it depends on have finished, and `dvc commit`s those that ran, so
that dvc.lock records them as `dvc repro` would have.

    python experiments/run_parallel.py experiments/tofu/dvc.yaml 'unlearn@*' 'evaluate@*' report --jobs 8
    python experiments/run_parallel.py experiments/tofu/dvc.yaml 'unlearn@*' --write-plan plan.json
    python experiments/run_parallel.py --plan plan.json --jobs 8 --gpus 0,1,2,3   # elsewhere, no DVC needed

Run it from the repository root, as DVC. Each job gets OMP_NUM_THREADS = cores / jobs and, with --gpus, the GPU
running the fewest jobs (CUDA_VISIBLE_DEVICES). Its output goes to LOG_DIR/STAGE.log. A failed stage stops its
dependents, not the others; the exit code is then 1.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import logging
import os
import subprocess
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path

log = logging.getLogger("run_parallel")


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix.rstrip("/") + "/")


def stages_from_dvc(pipeline: str, patterns: list[str], root: Path) -> list[dict]:
    """The stages of `pipeline` whose names match `patterns`, in file order, as plan entries: name, command,
    working directory, and the chosen stages each one must wait for (one's dependency is another's output)."""
    from dvc.repo import Repo

    repo = Repo(str(root))
    wanted = [s for s in repo.stage.collect(str(Path(root, pipeline)))
              if any(fnmatch.fnmatchcase(s.name, p) for p in patterns)]
    if not wanted:
        raise SystemExit(f"{pipeline}: no stage matches {patterns}")
    rel = lambda p: os.path.relpath(p, repo.root_dir)  # noqa: E731
    outs = {s.name: [rel(o.fs_path) for o in s.outs] for s in wanted}
    plan = []
    for s in wanted:
        deps = [rel(d.fs_path) for d in s.deps]
        after = sorted({other for other, paths in outs.items() if other != s.name
                        and any(_under(d, o) or _under(o, d) for d in deps for o in paths)})
        plan.append({"stage": s.addressing, "name": s.name, "cmd": s.cmd if isinstance(s.cmd, str)
                     else " && ".join(s.cmd), "wdir": rel(s.wdir), "after": after})
    return plan


def run_plan(plan: list[dict], jobs: int, gpus: list[str], log_dir: Path, root: Path,
             first: list[str] = ()) -> tuple[list[str], list[str]]:
    """Run the plan's commands, `jobs` at a time, each after its `after` stages: (done, failed) stage names.
    Among the stages ready to start, those matching a `first` pattern go first (long ones, so that they do not
    start last), then those that most stages wait for."""
    log_dir.mkdir(parents=True, exist_ok=True)
    threads = str(max(1, (os.cpu_count() or 1) // jobs))
    pending = {p["name"]: p for p in plan}
    chosen = set(pending)  # an `after` outside the plan (run earlier) is taken as done
    dependents = {n: sum(n in e["after"] for e in plan) for n in chosen}  # start the most awaited first
    done: list[str] = []
    failed: list[str] = []
    running = {}  # future -> (stage name, its GPU)
    on_gpu = {g: 0 for g in gpus}  # running jobs per GPU: each new job goes to the least loaded

    def launch(entry: dict, gpu: str | None) -> int:
        env = {**os.environ, "OMP_NUM_THREADS": threads, "PYTHONUNBUFFERED": "1"}
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        start = time.perf_counter()
        with open(log_dir / f"{entry['name']}.log", "w") as out:
            code = subprocess.run(entry["cmd"], shell=True, cwd=root / entry["wdir"], env=env, stdout=out,
                                  stderr=subprocess.STDOUT).returncode
        log.info("%s: %s in %.0f s", entry["name"], "done" if code == 0 else f"FAILED (exit {code})",
                 time.perf_counter() - start)
        return code

    with ThreadPoolExecutor(jobs) as pool:
        while pending or running:
            for name in [n for n, e in pending.items() if any(a in failed for a in e["after"])]:
                log.error("%s: not run, a stage it needs failed", name)
                del pending[name]
                failed.append(name)
            ready = sorted((e for e in pending.values() if all(a in done for a in e["after"] if a in chosen)),
                           key=lambda e: (not any(fnmatch.fnmatchcase(e["name"], f) for f in first),
                                          -dependents[e["name"]]))
            for entry in ready[: jobs - len(running)]:
                gpu = min(gpus, key=on_gpu.get) if gpus else None
                if gpu is not None:
                    on_gpu[gpu] += 1
                del pending[entry["name"]]
                running[pool.submit(launch, entry, gpu)] = (entry["name"], gpu)
            if not running:
                break
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                name, gpu = running.pop(future)
                if gpu is not None:
                    on_gpu[gpu] -= 1
                (done if future.result() == 0 else failed).append(name)
    return done, failed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("pipeline", nargs="?", help="a dvc.yaml (with stage-name patterns after it)")
    p.add_argument("patterns", nargs="*", help="stage names or shell patterns: 'unlearn@*' report")
    p.add_argument("--plan", type=Path, help="run this plan file instead of asking DVC")
    p.add_argument("--write-plan", type=Path, help="only write the plan, for a machine without DVC")
    p.add_argument("--jobs", type=int, default=2, help="stages at a time [2]")
    p.add_argument("--gpus", default="", help="GPU ids to hand out, each job to the least loaded, e.g. 0,1,2,3 "
                   "[none: every job sees all]")
    p.add_argument("--first", action="append", default=[], help="start stages matching this pattern as soon as "
                   "they can start (long ones, e.g. 'tune@*')")
    p.add_argument("--log-dir", type=Path, default=Path("artifacts/logs/parallel"), help="[artifacts/logs/parallel]")
    p.add_argument("--no-commit", action="store_true", help="do not `dvc commit` the stages that ran")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    if args.plan:
        plan = json.loads(args.plan.read_text())
    elif args.pipeline and args.patterns:
        plan = stages_from_dvc(args.pipeline, args.patterns, Path.cwd())
    else:
        p.error("give a pipeline and stage patterns, or --plan")
    if args.write_plan:
        args.write_plan.write_text(json.dumps(plan, indent=1))
        log.info("%d stages written to %s", len(plan), args.write_plan)
        return
    log.info("%d stages, %d at a time", len(plan), args.jobs)
    start = time.perf_counter()
    done, failed = run_plan(plan, args.jobs, [g for g in args.gpus.split(",") if g], args.log_dir, Path.cwd(),
                            args.first)
    log.info("%d done, %d failed in %.0f s", len(done), len(failed), time.perf_counter() - start)
    if done and not args.no_commit:
        try:
            import dvc  # noqa: F401
        except ImportError:
            log.warning("DVC is not installed here: dvc.lock does not record these stages")
        else:
            by_name = {e["name"]: e["stage"] for e in plan}
            subprocess.run(["dvc", "commit", "--force", *[by_name[n] for n in done]], check=True)
    if failed:
        log.error("failed: %s (logs in %s)", ", ".join(failed), args.log_dir)
        sys.exit(1)


if __name__ == "__main__":
    main()
