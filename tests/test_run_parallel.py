"""experiments/run_parallel.py: DVC stages run several at a time, in dependency order, and recorded in dvc.lock."""

import importlib.util
import subprocess
import sys
import time

from .conftest import REPO, cli_env

spec = importlib.util.spec_from_file_location("run_parallel", REPO / "experiments" / "run_parallel.py")
run_parallel = importlib.util.module_from_spec(spec)
spec.loader.exec_module(run_parallel)


def _entry(name, cmd, after=()):
    return {"stage": name, "name": name, "cmd": cmd, "wdir": ".", "after": list(after)}


def test_a_stage_waits_for_its_upstream_and_a_failure_stops_only_its_dependents(tmp_path):
    plan = [
        _entry("slow", "sleep 0.5 && echo slow > slow.txt"),
        _entry("reads_slow", "cat slow.txt > copy.txt", after=["slow"]),  # fails if it started before `slow` ended
        _entry("broken", "exit 3"),
        _entry("after_broken", "touch never.txt", after=["broken"]),
        _entry("independent", "touch independent.txt", after=["ran_before"]),  # an upstream outside the plan
    ]
    start = time.perf_counter()
    done, failed = run_parallel.run_plan(plan, jobs=3, gpus=[], log_dir=tmp_path / "logs", root=tmp_path)
    assert sorted(done) == ["independent", "reads_slow", "slow"]
    assert sorted(failed) == ["after_broken", "broken"]
    assert (tmp_path / "copy.txt").read_text() == "slow\n" and not (tmp_path / "never.txt").exists()
    assert (tmp_path / "logs" / "slow.log").is_file()
    assert time.perf_counter() - start < 30


def test_each_job_gets_the_least_loaded_gpu(tmp_path):
    plan = [_entry("long", "echo $CUDA_VISIBLE_DEVICES > long.txt && sleep 1"),
            _entry("short1", "echo $CUDA_VISIBLE_DEVICES > short1.txt"),
            _entry("short2", "sleep 0.3 && echo $CUDA_VISIBLE_DEVICES > short2.txt", after=["short1"])]
    run_parallel.run_plan(plan, jobs=2, gpus=["0", "1"], log_dir=tmp_path / "logs", root=tmp_path, first=["long"])
    gpu = {n: (tmp_path / f"{n}.txt").read_text().strip() for n in ("long", "short1", "short2")}
    assert gpu["long"] != gpu["short1"] and gpu["short2"] == gpu["short1"]  # not back on the busy GPU


def test_stages_matching_first_start_before_the_others(tmp_path):
    plan = [_entry(name, f"echo {name} >> order.txt") for name in ("a", "b", "long")]
    run_parallel.run_plan(plan, jobs=1, gpus=[], log_dir=tmp_path / "logs", root=tmp_path, first=["lo*"])
    assert (tmp_path / "order.txt").read_text().split() == ["long", "a", "b"]


def test_stages_come_from_dvc_and_are_committed_to_its_lock(tmp_path):
    (tmp_path / "dvc.yaml").write_text(
        "stages:\n"
        "  make:\n"
        "    foreach: [a, b, c]\n"
        "    do:\n"
        "      cmd: mkdir -p parts && echo ${item} > parts/${item}.txt\n"
        "      outs:\n"
        "        - parts/${item}.txt\n"
        "  combine:\n"
        "    cmd: cat parts/a.txt parts/b.txt parts/c.txt > all.txt\n"
        "    deps: [parts]  # a directory holding the outputs of other stages, as the report's metrics\n"
        "    outs: [all.txt]\n")
    env = {**cli_env(), "DVC_NO_ANALYTICS": "1"}
    subprocess.run(["dvc", "init", "--no-scm", "-q"], cwd=tmp_path, env=env, check=True)

    plan = run_parallel.stages_from_dvc("dvc.yaml", ["make@*", "combine"], tmp_path)
    after = {e["name"]: e["after"] for e in plan}
    assert after == {"make@a": [], "make@b": [], "make@c": [], "combine": ["make@a", "make@b", "make@c"]}

    proc = subprocess.run([sys.executable, str(REPO / "experiments" / "run_parallel.py"), "dvc.yaml", "make@*",
                           "combine", "--jobs", "3", "--log-dir", "logs"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "all.txt").read_text() == "a\nb\nc\n"
    status = subprocess.run(["dvc", "status"], cwd=tmp_path, env=env, capture_output=True, text=True, check=True)
    assert "up to date" in status.stdout, status.stdout  # dvc.lock records all four as `dvc repro` would
