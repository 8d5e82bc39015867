"""tokenunlearn sweep: a DVC pipeline's stages as Ray tasks, in dependency order, recorded in dvc.lock."""

import json
import os
import subprocess

import pytest

from pipeline.common.errors import ParamError
from pipeline.sweep.plan import downstream_closure, plan_from_dvc, resources_for, resources_table
from pipeline.sweep.runner import run_sweep

from tests.conftest import cli_env, plan_entry

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray of 3 CPUs for the module (a start costs seconds); the sweep uses a Ray it finds running."""
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.slow
def test_a_stage_waits_for_its_upstream_and_a_failure_stops_only_its_dependents(local_ray, tmp_path):
    plan = [
        plan_entry("slow", "sleep 1 && echo slow > slow.txt"),
        plan_entry("reads_slow", "cat slow.txt > copy.txt", after=["slow"]),  # fails if it started before `slow` ended
        plan_entry("broken", "echo why >&2; exit 3"),
        plan_entry("after_broken", "touch never.txt", after=["broken"]),
        plan_entry("then_blocked", "touch never2.txt", after=["after_broken"]),
        plan_entry("independent", "echo $OMP_NUM_THREADS > threads.txt", after=["ran_before"], cpus=2),  # outside
    ]
    result = run_sweep(plan, tmp_path, tmp_path / "logs")
    assert sorted(result.named("done")) == ["independent", "reads_slow", "slow"]
    assert result.named("failed") == ["broken"] and sorted(result.named("blocked")) == ["after_broken", "then_blocked"]
    assert (tmp_path / "copy.txt").read_text() == "slow\n" and not (tmp_path / "never.txt").exists()
    assert (tmp_path / "threads.txt").read_text() == "2\n"  # a stage's threads are its CPUs
    assert (tmp_path / "logs" / "broken.log").read_text() == "why\n"
    summary = json.loads((tmp_path / "logs" / "sweep.json").read_text())
    assert summary["stages"]["broken"]["code"] == 3 and summary["stages"]["slow"]["seconds"] >= 1


@pytest.mark.slow
def test_stages_matching_first_start_before_the_others(local_ray, tmp_path):
    # each stage takes all 3 CPUs, so they run one at a time, in the order they were handed to Ray
    plan = [plan_entry(name, f"echo {name} >> order.txt", cpus=3) for name in ("a", "b", "long")]
    run_sweep(plan, tmp_path, tmp_path / "logs", first=("lo*",))
    assert (tmp_path / "order.txt").read_text().split() == ["long", "a", "b"]


@pytest.mark.slow
def test_a_rerun_never_truncates_a_log_another_process_still_writes(local_ray, tmp_path):
    """A process of an earlier run (an orphan, a second sweep) still writing a stage's log: the new run's log is a
    new file, so the old writer's offset cannot leave NUL bytes in it, and neither run's lines mix."""
    (tmp_path / "logs").mkdir()
    with open(tmp_path / "logs" / "a.log", "a") as old:
        old.write("old line\n" * 100)
        old.flush()
        run_sweep([plan_entry("a", "echo new")], tmp_path, tmp_path / "logs")
        old.write("old still writing\n")
    assert (tmp_path / "logs" / "a.log").read_bytes() == b"new\n"


@pytest.mark.slow
def test_a_stage_no_node_can_hold_is_an_error_before_anything_runs(local_ray, tmp_path):
    plan = [plan_entry("evaluate@npo", "touch ran.txt", gpus=1)]
    with pytest.raises(ParamError, match=r"sweep.resources.evaluate.gpus=1: stage 'evaluate@npo'.*0 GPU"):
        run_sweep(plan, tmp_path, tmp_path / "logs")
    assert not (tmp_path / "ran.txt").exists()


def test_resources_per_stage_kind():
    table = resources_table({"unlearn": {"cpus": 4, "gpus": 1}, "evaluate": {"gpus": 0.5}})
    assert resources_for("unlearn@t_ga", table).gpus == 1 and resources_for("unlearn@t_ga", table).cpus == 4
    assert resources_for("evaluate@ga", table).gpus == 0.5 and resources_for("report", table).cpus == 1
    with pytest.raises(ParamError, match="sweep.resources.unlearn.gpu: unknown"):
        resources_table({"unlearn": {"gpu": 1}})
    with pytest.raises(ParamError, match=r"sweep.resources.unlearn.cpus=-1: must be at least 0"):
        resources_table({"unlearn": {"cpus": -1}})


def test_downstream_closure():
    plan = [plan_entry("a", ""), plan_entry("b", "", ["a"]), plan_entry("c", "", ["b"]), plan_entry("d", "")]
    assert downstream_closure(plan, {"a"}) == {"a", "b", "c"} and downstream_closure(plan, set()) == set()


def _dvc_project(tmp_path):
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
    (tmp_path / "params.yaml").write_text("sweep: {resources: {default: {cpus: 1}}}\n")
    env = {**cli_env(), "DVC_NO_ANALYTICS": "1"}
    subprocess.run(["dvc", "init", "--no-scm", "-q"], cwd=tmp_path, env=env, check=True)
    return env


def _sweep(args, cwd, env):
    proc = subprocess.run(["tokenunlearn", "sweep", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)
    return proc, json.loads((cwd / "artifacts/logs/sweep/sweep.json").read_text())["stages"] \
        if (cwd / "artifacts/logs/sweep/sweep.json").is_file() else {}


def _status(cwd, env):
    return subprocess.run(["dvc", "status"], cwd=cwd, env=env, capture_output=True, text=True, check=True).stdout


@pytest.mark.slow
def test_stages_come_from_dvc_run_where_stale_and_are_recorded_in_its_lock(tmp_path):
    env = _dvc_project(tmp_path)
    plan = plan_from_dvc("dvc.yaml", ["make@*", "combine"], tmp_path, resources_table({"make": {"cpus": 0.5}}))
    assert {e["name"]: e["after"] for e in plan} == {"make@a": [], "make@b": [], "make@c": [],
                                                     "combine": ["make@a", "make@b", "make@c"]}
    assert [e["cpus"] for e in plan] == [0.5, 0.5, 0.5, 1]

    proc, stages = _sweep(["dvc.yaml", "make@*", "combine", "--workers", "2"], tmp_path, env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "all.txt").read_text() == "a\nb\nc\n"
    assert {s["status"] for s in stages.values()} == {"done"}
    assert "up to date" in _status(tmp_path, env)  # dvc.lock records all four as `dvc repro` would

    # as `dvc repro`: only what is not up to date runs; a rerun that gives the same output stops there
    (tmp_path / "parts/b.txt").unlink()
    proc, stages = _sweep(["dvc.yaml", "make@*", "combine", "--workers", "2"], tmp_path, env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {n: s["status"] for n, s in stages.items()} == {"make@a": "up to date", "make@b": "done",
                                                          "make@c": "up to date", "combine": "up to date"}
    assert "up to date" in _status(tmp_path, env)


@pytest.mark.slow
def test_a_plan_runs_without_dvc_and_is_recorded_where_dvc_is(tmp_path):
    env = _dvc_project(tmp_path)
    proc, _ = _sweep(["dvc.yaml", "make@*", "combine", "--workers", "2"], tmp_path, env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (tmp_path / "dvc.yaml").write_text((tmp_path / "dvc.yaml").read_text().replace("echo ${item}", "echo x${item}"))
    proc, _ = _sweep(["dvc.yaml", "make@*", "combine", "--write-plan", "plan.json"], tmp_path, env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [e["name"] for e in json.loads((tmp_path / "plan.json").read_text())] == ["make@a", "make@b", "make@c",
                                                                                     "combine"]
    proc, stages = _sweep(["--plan", "plan.json", "--workers", "2"], tmp_path, env)  # where DVC is not
    assert proc.returncode == 0 and (tmp_path / "all.txt").read_text() == "xa\nxb\nxc\n", proc.stderr[-3000:]
    assert "changed" in _status(tmp_path, env)  # not recorded yet
    proc, _ = _sweep(["--record", "artifacts/logs/sweep/sweep.json"], tmp_path, env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "up to date" in _status(tmp_path, env)


@pytest.mark.slow
def test_a_bad_plan_file_is_an_error_naming_the_entry(tmp_path):
    (tmp_path / "plan.json").write_text(json.dumps([{"name": "a", "cmd": "true"}]))
    (tmp_path / "params.yaml").write_text("sweep: {}\n")
    proc, _ = _sweep(["--plan", "plan.json"], tmp_path, cli_env())
    assert proc.returncode == 2 and "plan.json: entry 0 lacks ['after', 'cpus', 'gpus', 'stage', 'wdir']" in proc.stderr


@pytest.mark.slow
def test_a_broken_dvc_yaml_is_a_one_line_error(tmp_path):
    env = _dvc_project(tmp_path)
    (tmp_path / "dvc.yaml").write_text("stages:\n  a: [\n")
    proc, _ = _sweep(["dvc.yaml", "*"], tmp_path, env)
    assert proc.returncode == 2 and "tokenunlearn: error: dvc.yaml: unable to read" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_the_ledger_waits_for_another_dvc_process_holding_the_lock(tmp_path, monkeypatch):
    """A `dvc status` or `dvc commit` run beside a sweep holds the repository's lock; the sweep's record of a stage
    that ran well then waits for it instead of failing the stage (it did, once, while a `dvc commit` ran)."""
    import threading

    from dvc.repo import Repo

    from pipeline.sweep.ledger import DvcLedger

    env = _dvc_project(tmp_path)
    monkeypatch.chdir(tmp_path)
    subprocess.run(["sh", "-c", "mkdir -p parts && echo a > parts/a.txt"], cwd=tmp_path, check=True)
    other = Repo(str(tmp_path))
    other.lock.lock()  # another DVC process at work
    threading.Timer(4.0, other.lock.unlock).start()
    DvcLedger(tmp_path).record(["dvc.yaml:make@a"])
    other.close()
    assert "make@a" not in _status(tmp_path, env).split("combine")[0]
    assert "make@a" in (tmp_path / "dvc.lock").read_text()


@pytest.mark.slow
def test_recording_stages_collects_their_dvc_yaml_once(tmp_path, monkeypatch):
    """The sweep records each stage that ends as it ends: with a lock of thousands of stages DVC's collection of a
    dvc.yaml (which parses its lock) takes seconds, so a record checks the fingerprints and saves the stages on one."""
    from dvc.repo.stage import StageLoad

    from pipeline.sweep.ledger import DvcLedger

    _dvc_project(tmp_path)
    monkeypatch.chdir(tmp_path)
    subprocess.run(["sh", "-c", "mkdir -p parts && echo a > parts/a.txt && echo b > parts/b.txt"], cwd=tmp_path,
                   check=True)
    ledger, plan = DvcLedger(tmp_path), ["dvc.yaml:make@a", "dvc.yaml:make@b", "dvc.yaml:combine"]
    expected = ledger.fingerprints(plan)
    collect, calls = StageLoad.collect, []
    monkeypatch.setattr(StageLoad, "collect", lambda self, *a, **k: calls.append(a) or collect(self, *a, **k))
    assert ledger.record(plan[:2], expected, plan) == []
    assert len(calls) == 1
    lock = (tmp_path / "dvc.lock").read_text()
    assert "make@a" in lock and "make@b" in lock and "combine" not in lock


@pytest.mark.slow
def test_the_ledger_writes_the_bytes_dvc_writes_and_a_failed_write_keeps_the_lock(tmp_path, monkeypatch):
    """The ledger writes dvc.lock itself (DVC's serializer, its fast parser, a rename) instead of DVC's in-place
    round-trip rewrite: for the same stages the same bytes (new entries, a changed one, float params), the lock's
    mode kept, and a write that fails halfway leaves the lock as it was."""
    import contextlib
    import stat

    from pipeline.sweep import ledger

    def project(root):
        root.mkdir()
        _dvc_project(root)
        text = (root / "dvc.yaml").read_text()
        (root / "dvc.yaml").write_text(text.replace("      outs:\n", "      params: [lr, floor, name]\n      outs:\n"))
        with open(root / "params.yaml", "a") as f:
            f.write("lr: 1.0e-05\nfloor: 0.9\nname: 'yes'\n")
        subprocess.run(["sh", "-c", "mkdir -p parts && for x in a b c; do echo $x > parts/$x.txt; done && "
                        "cat parts/a.txt parts/b.txt parts/c.txt > all.txt"], cwd=root, check=True)

    locks = {}
    for name, write in (("ours", ledger.write_lock), ("dvc", ledger.dump_by_dvc)):
        root = tmp_path / name
        project(root)
        monkeypatch.chdir(root)
        ledger.DvcLedger(root).record(["dvc.yaml:make@a"])  # a new lock: DVC writes it, its header first
        monkeypatch.setattr(ledger, "write_lock", write)
        ledger.DvcLedger(root).record(["dvc.yaml:make@b", "dvc.yaml:make@c", "dvc.yaml:combine"])
        (root / "parts/a.txt").write_text("a again\n")  # an entry already there, changed
        ledger.DvcLedger(root).record(["dvc.yaml:make@a"])
        monkeypatch.undo()
        locks[name] = (root / "dvc.lock").read_text()
    assert locks["ours"] == locks["dvc"] and "combine" in locks["ours"] and "1e-05" in locks["ours"]

    ours = tmp_path / "ours"
    monkeypatch.chdir(ours)
    os.chmod(ours / "dvc.lock", 0o640)
    (ours / "all.txt").write_text("changed\n")
    ledger.DvcLedger(ours).record(["dvc.yaml:combine"])
    assert stat.S_IMODE((ours / "dvc.lock").stat().st_mode) == 0o640
    written = (ours / "dvc.lock").read_text()

    real = ledger.atomic_file

    @contextlib.contextmanager
    def half_written(target):
        with real(target) as f:
            class Full:  # the disk fills halfway through the lock
                name = f.name

                def write(self, text):
                    f.write(text[: len(text) // 2])
                    raise OSError(28, "No space left on device")
            yield Full()

    monkeypatch.setattr(ledger, "atomic_file", half_written)
    (ours / "all.txt").write_text("changed again\n")
    with pytest.raises(Exception, match="No space left"):
        ledger.DvcLedger(ours).record(["dvc.yaml:combine"])
    assert (ours / "dvc.lock").read_text() == written
    assert not [p for p in ours.iterdir() if p.name.startswith(".dvc.lock.tmp")]
