"""The user's flows on the demo, timed as a user runs them (after `make demo`, on a clean checkout):

  status   `dvc status dvc.yaml`: the CPU seconds DVC spends (its own process and children), median of --repeat
  tau      `dvc exp run -S unlearn.weightings.soft.tau=T`: the wall time from the command to the report, the stages'
           own share of it (each stage command timed by a wrapper put first on PATH) and what DVC spends around
           them, and how many of DVC's warnings name other pipelines' outputs ("No file hash info found")

The τ change is undone afterwards (params.yaml and dvc.lock from git, the cached outputs by `dvc checkout`, the
uncached ones, the evaluation summaries, by `dvc repro`; the experiment removed). Give a τ the checkout has not run:
DVC's run cache would restore a run it has seen instead of running it. It imports nothing of the project's, so it
times an older checkout alike:

    python benchmarks/bench_flows.py                                   # in the repository, after `make demo`
    /other/.venv/bin/python benchmarks/bench_flows.py --repo /other    # another checkout with its own venv
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WRAPPER = """#!/bin/sh
# times one stage command for bench_flows.py, then runs it
start=$(date +%s.%N)
"{real}" "$@"
code=$?
echo "$start $(date +%s.%N) $1" >> "{log}"
exit $code
"""


def fail(message: str) -> None:
    print(f"bench_flows: error: {message}", file=sys.stderr)
    sys.exit(2)


def dvc(repo: Path, bin_dir: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`dvc ARGS` in `repo`, its stages' commands found in the checkout's venv (`bin_dir`) first."""
    path = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"
    return subprocess.run([str(bin_dir / "dvc"), *args], cwd=repo, capture_output=True, text=True,
                          env={**os.environ, "DVC_NO_ANALYTICS": "1", "PATH": path, **(env or {})})


def status_cpu_seconds(repo: Path, bin_dir: Path, repeat: int) -> list[float]:
    """CPU seconds (user + system) of each `dvc status dvc.yaml`, children included."""
    seconds = []
    for _ in range(repeat):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        proc = dvc(repo, bin_dir, "status", "dvc.yaml")
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if proc.returncode:
            fail(f"dvc status dvc.yaml failed in {repo}: {proc.stderr.strip()[-500:]}")
        seconds.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return seconds


def tau_change(repo: Path, bin_dir: Path, tau: str) -> dict:
    """One `dvc exp run -S unlearn.weightings.soft.tau=TAU`, each stage command timed; then undone."""
    name = f"bench-tau-{os.getpid()}"
    with tempfile.TemporaryDirectory() as tmp:
        shim, log = Path(tmp), Path(tmp) / "stages.log"
        (shim / "tokenunlearn").write_text(WRAPPER.format(real=bin_dir / "tokenunlearn", log=log))
        (shim / "tokenunlearn").chmod(0o755)
        env = {"PATH": f"{shim}{os.pathsep}{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
        start = time.perf_counter()
        proc = dvc(repo, bin_dir, "exp", "run", "-n", name, "-S", f"unlearn.weightings.soft.tau={tau}", env=env)
        wall = time.perf_counter() - start
        stages = [line.split() for line in log.read_text().splitlines()] if log.is_file() else []
    output = proc.stdout + proc.stderr
    try:
        if proc.returncode:
            fail(f"dvc exp run failed (exit {proc.returncode}): {output.strip()[-1500:]}")
    finally:
        undo = [subprocess.run(["git", "checkout", "--", "params.yaml", "dvc.lock"], cwd=repo, capture_output=True,
                               text=True), dvc(repo, bin_dir, "checkout", "--force"), dvc(repo, bin_dir, "repro"),
                dvc(repo, bin_dir, "exp", "remove", name)]
        for step in undo:
            if step.returncode:
                print(f"bench_flows: warning: undoing the τ change: {' '.join(map(str, step.args[:3]))} failed: "
                      f"{(step.stdout + step.stderr).strip()[-300:]}", file=sys.stderr)
    ran = [line.split("'")[1] for line in output.splitlines() if line.startswith("Running stage '")]
    if not ran:
        print(f"bench_flows: warning: τ={tau} ran no stage (restored from DVC's run cache): give another --tau",
              file=sys.stderr)
    own = sum(float(end) - float(begin) for begin, end, *_ in stages)
    return {"tau": tau, "wall_s": round(wall, 1), "stages_s": round(own, 1), "around_stages_s": round(wall - own, 1),
            "stages": ran, "commands": [s[2] if len(s) > 2 else "" for s in stages],
            "warnings_about_other_outputs": output.count("No file hash info found")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[1],
                        help="The checkout, after `make demo` [this one].")
    parser.add_argument("--tau", default="1.0", help="The new τ [1.0]; one the checkout has not run before.")
    parser.add_argument("--repeat", type=int, default=3, help="dvc status runs [3].")
    parser.add_argument("--skip-tau", action="store_true", help="Only time `dvc status`.")
    args = parser.parse_args()
    repo, bin_dir = args.repo.resolve(), Path(sys.executable).parent
    if not (repo / "dvc.yaml").is_file() or not (bin_dir / "dvc").is_file():
        fail(f"{repo}: no dvc.yaml, or no dvc beside {sys.executable} (run it with the checkout's .venv/bin/python)")
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "params.yaml", "dvc.lock"], cwd=repo,
                           capture_output=True, text=True).stdout.strip()
    if dirty:
        fail(f"{repo}: params.yaml or dvc.lock has uncommitted changes ({dirty}); the τ change is undone from git")
    status = status_cpu_seconds(repo, bin_dir, args.repeat)
    result = {"repo": str(repo), "dvc_status_cpu_s": [round(s, 2) for s in status],
              "dvc_status_cpu_s_median": round(statistics.median(status), 2)}
    if not args.skip_tau:
        result["tau_change"] = tau_change(repo, bin_dir, args.tau)
    print(json.dumps(result, indent=1))
    if "tau_change" in result:
        t = result["tau_change"]
        print(f"dvc status dvc.yaml: {result['dvc_status_cpu_s_median']} CPU s; τ={t['tau']}: {t['wall_s']} s from "
              f"command to report, {t['stages_s']} s of it the stages ({', '.join(t['stages'])}), "
              f"{t['around_stages_s']} s around them; {t['warnings_about_other_outputs']} warnings about other "
              "pipelines' outputs")


if __name__ == "__main__":
    from pipeline.common.cli_errors import run_script  # as the CLI: one line per error, an exit status
    run_script(main)
