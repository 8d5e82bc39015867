"""What the Ray sweep costs and gains, in one run.

  overhead   Ray's start (a local Ray of 2 CPUs) and its cost per task: N stages whose command is `true`, run
             one at a time through the sweep, against the same commands run by subprocess
  dvc        the sweep driver's DVC calls per stage, on a one-stage project: is it up to date, and recording it
  lock       (--lock-only) DVC's parse of a large dvc.lock (default: experiments/seeds/dvc.lock), which the
             driver reads again for each stage it asks about or records: ruamel.yaml's C loader against its
             pure-Python one, interleaved
  record     (--lock-only) recording one stage in a lock of N stages (--lock-stages) made here: the ledger's write
             (DVC's fast parser, a rename) against DVC's own in-place round-trip rewrite, interleaved
  stages     real stages of a pipeline (default: six evaluations of the paper's sweep, experiments/paper), rerun
             by `dvc repro --force --single-item` (one stage at a time, all cores to each) and by `tokenunlearn
             sweep --force --workers 2` (two at a time, a core each); both rewrite the same outputs, which
             dvc.lock records again (the stages are deterministic: the lock does not change)

    python benchmarks/bench_sweep.py                              # after `make paper`
    python benchmarks/bench_sweep.py --lock-only                  # the lock parse and write, on a fresh clone
    python benchmarks/bench_sweep.py --dvc-file dvc.yaml --stages evaluate@npo evaluate@t_npo   # after `make demo`
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
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
        subprocess.run([sys.executable, "-m", "dvc", "init", "--no-scm", "-q"], cwd=root, check=True)
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


def lock_parse(lock: Path, repeats: int = 3) -> dict:
    """Seconds per parse of `lock` as DVC parses it (ruamel.yaml, typ="safe"), with the C loader and without it."""
    from ruamel.yaml import YAML
    from ruamel.yaml.main import CParser

    text = lock.read_text()
    loaders = {"c": YAML(typ="safe"), "pure": YAML(typ="safe", pure=True)}
    if CParser is None:
        return {"lock": str(lock), "error": "no C loader: install ruamel.yaml.clib (pyproject.toml)"}
    seconds = {name: [] for name in loaders}
    parsed = {}
    for _ in range(repeats):  # interleaved, so that a busy spell on the shared cores falls on both
        for name, yaml in loaders.items():
            t = time.process_time()
            parsed[name] = yaml.load(text)
            seconds[name].append(time.process_time() - t)
    c, pure = (statistics.median(seconds[n]) for n in ("c", "pure"))
    return {"lock": str(lock.relative_to(REPO)) if lock.is_relative_to(REPO) else str(lock),
            "mib": round(len(text) / 2**20, 2), "c_s": round(c, 2), "pure_s": round(pure, 2),
            "pure_over_c": round(pure / c, 2), "same_data": parsed["c"] == parsed["pure"]}


@contextlib.contextmanager
def _cwd(path):
    before = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


def lock_record(n_stages: int, repeats: int = 3) -> dict:
    """CPU seconds to record one stage in a lock of `n_stages` stages (each with 150 params: 4 kB a stage, as the
    experiments' stages have): by the ledger's `write_lock`; by DVC's `dump_stages`; and by DVC's with ruamel.yaml's
    pure-Python loader, as before the C loader was a dependency. The locks must come out the same."""
    import ruamel.yaml.main

    from pipeline.sweep import ledger as ledger_module

    dvc_dump = ledger_module.dump_by_dvc
    ways = {"ledger": (ledger_module.write_lock, ruamel.yaml.main.CParser), "dvc": (dvc_dump, ruamel.yaml.main.CParser),
            "dvc_pure": (dvc_dump, None)}
    with tempfile.TemporaryDirectory() as tmp, _cwd(tmp):  # DVC reads paths from the cwd
        root = Path(tmp)
        keys = [f"k{j}" for j in range(150)]
        (root / "params.yaml").write_text("".join(f"{k}: {j}.5e-05\n" for j, k in enumerate(keys)))
        (root / "dvc.yaml").write_text(
            f"stages:\n  s:\n    foreach: {list(range(n_stages))}\n    do:\n"
            "      cmd: echo ${item} > out/${item}.txt\n      params: [" + ", ".join(keys) + "]\n"
            "      outs:\n        - out/${item}.txt\n")
        subprocess.run([sys.executable, "-m", "dvc", "init", "--no-scm", "-q"], cwd=root, check=True)
        (root / "out").mkdir()
        for i in range(n_stages):
            (root / "out" / f"{i}.txt").write_text(f"{i}\n")
        book = DvcLedger(root)
        book.record([f"dvc.yaml:s@{i}" for i in range(n_stages)])
        seconds, locks = {name: [] for name in ways}, {}

        def record(name: str, output: str) -> float:
            (root / "out" / "0.txt").write_text(output)
            saved = ledger_module.write_lock, ruamel.yaml.main.CParser
            ledger_module.write_lock, ruamel.yaml.main.CParser = ways[name]
            try:
                t = time.process_time()
                book.record(["dvc.yaml:s@0"])
                return time.process_time() - t
            finally:
                ledger_module.write_lock, ruamel.yaml.main.CParser = saved

        for r in range(repeats):  # interleaved, so that a busy spell on the shared cores falls on all
            for name in ways:
                seconds[name].append(record(name, f"{r} {name}\n"))  # a new output each time: a changed entry
        for name in ways:  # the same output recorded each way: the same lock
            record(name, "same\n")
            locks[name] = (root / "dvc.lock").read_text()
        median = {name: statistics.median(s) for name, s in seconds.items()}
        return {"stages": n_stages, "lock_mib": round((root / "dvc.lock").stat().st_size / 2**20, 2),
                **{f"{name}_s": round(m, 2) for name, m in median.items()},
                "dvc_over_ledger": round(median["dvc"] / median["ledger"], 2),
                "dvc_pure_over_ledger": round(median["dvc_pure"] / median["ledger"], 2),
                "same_lock": len(set(locks.values())) == 1}


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
    p.add_argument("--lock", type=Path, default=REPO / "experiments/seeds/dvc.lock", help="the lock to parse")
    p.add_argument("--lock-stages", type=int, default=400, help="the stages of the lock `record` writes in")
    p.add_argument("--lock-only", action="store_true", help="measure the lock parse and write alone")
    args = p.parse_args()
    if args.lock_only:
        print(json.dumps({"lock": lock_parse(args.lock), "record": lock_record(args.lock_stages)}, indent=1))
        return
    result = {"overhead": overhead(args.tasks), "dvc": dvc_calls()}
    print(json.dumps(result), flush=True)
    if args.stages:
        result["stages"] = stages(args.dvc_file, args.stages)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    from pipeline.common.cli_errors import run_script  # as the CLI: one line per error, an exit status
    run_script(main)
