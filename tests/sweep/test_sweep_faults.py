"""tokenunlearn sweep against hostile input and accidents: cycles, malformed plans and outcomes, records of stages
that changed since their plan, -S it cannot honour, two sweeps at once, and a killed worker's stage."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.common.errors import DataError, ParamError, TokenUnlearnError
from pipeline.sweep.plan import find_cycle, read_plan
from pipeline.sweep.runner import launch, one_sweep_at_a_time, read_outcome, run_sweep, wait_and_end_group

from tests.conftest import cli_env, plan_entry


def _write(tmp_path, name, content):
    path = tmp_path / name
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


# 1. cycles --------------------------------------------------------------------------------------------------------

def test_a_cycle_is_found_and_named():
    assert find_cycle([plan_entry("a"), plan_entry("b", after=["a", "outside"])]) is None
    assert find_cycle([plan_entry("a", after=["a"])]) == ["a", "a"]
    cycle = find_cycle([plan_entry("x"), plan_entry("a", after=["c"]), plan_entry("b", after=["a"]),
                        plan_entry("c", after=["b"]), plan_entry("d", after=["c", "x"])])
    assert cycle[0] == cycle[-1] and set(cycle) == {"a", "b", "c"}


def test_a_plan_with_a_cycle_is_refused_at_once(tmp_path):
    path = _write(tmp_path, "plan.json", [plan_entry("a", after=["b"]), plan_entry("b", after=["a"])])
    with pytest.raises(DataError, match=r"plan.json: the stages wait on each other in a cycle.*\(([ab]) -> [ab] -> \1"):
        read_plan(path)
    with pytest.raises(DataError, match=r"sweep plan: .*cycle.*\(self -> self\)"):  # before any Ray starts
        run_sweep([plan_entry("self", after=["self"])], tmp_path, tmp_path / "logs")


def test_the_cli_refuses_a_cycle_in_one_line(tmp_path):
    _write(tmp_path, "params.yaml", "sweep: {}\n")
    _write(tmp_path, "plan.json", [plan_entry("a", after=["a"])])
    proc = subprocess.run(["tokenunlearn", "sweep", "--plan", "plan.json"], cwd=tmp_path, env=cli_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("tokenunlearn: error: plan.json: ") and "(a -> a)" in last


# 2. malformed plans and outcomes ----------------------------------------------------------------------------------

@pytest.mark.parametrize("content, says", [
    ("{not json", "not a readable plan"),
    ({"a": plan_entry("a")}, "a JSON list of stages, not a dict"),
    ([["a"]], "entry 0 is a list, not a mapping"),
    ([{**plan_entry("a"), "after": "b"}], r"entry 0 \('a'\): after is 'b', not a list of stage names"),
    ([{**plan_entry("a"), "cpus": "two"}], "cpus is 'two', not a number at least 0"),
    ([{**plan_entry("a"), "gpus": True}], "gpus is True, not a number"),
    ([{**plan_entry("a"), "name": ["a"]}], r"name is \['a'\], not a stage name"),
    ([{**plan_entry("a"), "cpu": 1}], r"unknown key\(s\) \['cpu'\]"),
])
def test_a_malformed_plan_is_an_error_naming_the_file_and_the_fault(tmp_path, content, says):
    with pytest.raises(DataError, match=f"plan.json: .*{says}"):
        read_plan(_write(tmp_path, "plan.json", content))


@pytest.mark.parametrize("content, says", [
    ("\x00\x00", "not a readable sweep.json"),
    ([], "needs a mapping 'stages'"),
    ({"stages": []}, "needs a mapping 'stages'"),
    ({"stages": {"a": "done"}}, "stages.a is a str, not a mapping"),
    ({"stages": {"a": {"status": "done"}}}, "stages.a.stage: missing"),
    ({"stages": {"a": {"stage": "dvc.yaml:a", "status": "fine"}}}, "stages.a.status is 'fine', not one of"),
    ({"stages": {"a": {"stage": "dvc.yaml:a", "status": "done", "fingerprint": 3}}}, "fingerprint is 3"),
])
def test_a_malformed_outcome_is_an_error_naming_the_file_and_the_fault(tmp_path, content, says):
    with pytest.raises(DataError, match=f"sweep.json: .*{says}"):
        read_outcome(_write(tmp_path, "sweep.json", content))


# 3. a record of a stage that changed since its plan ---------------------------------------------------------------

def _dvc_project(tmp_path):
    _write(tmp_path, "dvc.yaml", "stages:\n"
           "  make:\n    cmd: cp stage.yaml out.txt\n    params: [{stage.yaml: [size]}]\n    outs: [out.txt]\n"
           "  copy:\n    cmd: cp out.txt copy.txt\n    deps: [out.txt]\n    outs: [copy.txt]\n")
    _write(tmp_path, "params.yaml", "sweep: {}\n")
    _write(tmp_path, "stage.yaml", "size: 1\n")
    subprocess.run(["dvc", "init", "--no-scm", "-q"], cwd=tmp_path, env={**cli_env(), "DVC_NO_ANALYTICS": "1"},
                   check=True)


def test_a_record_refuses_stages_whose_params_changed_since_the_plan(tmp_path, monkeypatch):
    from pipeline.sweep.ledger import DvcLedger

    _dvc_project(tmp_path)
    monkeypatch.chdir(tmp_path)
    ledger, plan = DvcLedger(tmp_path), ["dvc.yaml:make", "dvc.yaml:copy"]
    marks = ledger.fingerprints(plan)
    (tmp_path / "out.txt").write_text("1\n")  # the plan's run
    (tmp_path / "copy.txt").write_text("1\n")
    _write(tmp_path, "stage.yaml", "size: 2\n")  # then the params change
    assert ledger.record(plan, expected=marks, planned=plan) == ["dvc.yaml:make"]
    lock = (tmp_path / "dvc.lock").read_text()
    assert "copy:" in lock and "make:" not in lock  # copy's input is make's output, which it did copy
    assert ledger.record(["dvc.yaml:copy"], expected={"dvc.yaml:copy": None}) == ["dvc.yaml:copy"]  # no mark
    with pytest.raises(DataError, match=r"dvc.yaml: no stage \['nosuch'\]"):
        ledger.record(["dvc.yaml:nosuch"], expected={"dvc.yaml:nosuch": "x"})


def test_the_cli_record_names_the_refused_stage(tmp_path, monkeypatch):
    from stages.sweep import command

    _dvc_project(tmp_path)
    monkeypatch.chdir(tmp_path)
    _write(tmp_path, "sweep.json", {"stages": {"make": {"stage": "dvc.yaml:make", "status": "done",
                                                        "fingerprint": "0000"}}})
    result = CliRunner().invoke(command, ["--record", "sweep.json"])
    assert isinstance(result.exception, DataError), result.output
    assert "sweep.json: not recorded" in str(result.exception) and "dvc.yaml:make" in str(result.exception)


# 4. -S and --overlay ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, says", [
    (["dvc.yaml", "*", "-S", "unlearn.lr=2"], r"-S unlearn.lr=2: change \['unlearn'\], which the stages would not"),
    (["--plan", "plan.json", "-S", "sweep.resources.default.cpus=2"], "--plan and --record read no params"),
    (["--record", "sweep.json", "-S", "unlearn.lr=2"], "--plan and --record read no params"),
])
def test_overrides_the_stages_would_not_see_are_refused(tmp_path, monkeypatch, args, says):
    from stages.sweep import command

    monkeypatch.chdir(tmp_path)
    _write(tmp_path, "params.yaml", "unlearn: {lr: 1}\nsweep: {resources: {default: {cpus: 1}}}\n")
    result = CliRunner().invoke(command, args)
    assert isinstance(result.exception, ParamError) and result.exception.args[0].startswith(args[-2]), result.output
    assert __import__("re").search(says, str(result.exception))


def test_overrides_of_the_sweep_itself_are_taken(tmp_path, monkeypatch):
    from stages.sweep import command

    monkeypatch.chdir(tmp_path)
    _write(tmp_path, "params.yaml", "sweep: {resources: {default: {cpus: 1}}}\n")
    result = CliRunner().invoke(command, ["-S", "sweep.resources.default.cpus=2"])
    assert "give a pipeline and stage patterns" in result.output  # past the check, to the next question


# 5. one sweep at a time -------------------------------------------------------------------------------------------

def test_a_second_sweep_on_the_same_repository_is_refused_naming_the_first(tmp_path):
    (tmp_path / ".dvc").mkdir()
    with one_sweep_at_a_time(tmp_path, tmp_path / "logs"):
        with pytest.raises(TokenUnlearnError, match=rf"{tmp_path}: another sweep is running \(pid {os.getpid()} on "):
            one_sweep_at_a_time(tmp_path, tmp_path / "other_logs").__enter__()
        with pytest.raises(TokenUnlearnError, match="another sweep is running"):  # so is one from a plan run
            run_sweep([plan_entry("a", "touch ran")], tmp_path, tmp_path / "other_logs")
    assert not (tmp_path / "ran").exists()
    with one_sweep_at_a_time(tmp_path, tmp_path / "logs"):  # free again once the first ended
        pass


# 6. a stage dies with the worker that launched it -----------------------------------------------------------------

def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")  # a zombie has ended; where nothing reaps it, it stays listed


def _gone_within(pids, seconds=5.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


def _pids(tmp_path, *names, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not all((tmp_path / n).is_file() and (tmp_path / n).read_text().strip() for n in names):
        assert time.monotonic() < deadline, "the stage did not start"
        time.sleep(0.05)
    return [int((tmp_path / n).read_text()) for n in names]


# a shell that forks (a compound command), so the shell's own child must die too, not only the shell
STAGE = "echo $$ > sh.pid; sleep 60 & echo $! > sleep.pid; wait"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_stage_dies_with_its_killed_launcher(tmp_path):
    launcher = subprocess.Popen([sys.executable, "-c", (
        "import os, sys; from pipeline.sweep.runner import launch, wait_and_end_group\n"
        f"wait_and_end_group(launch({STAGE!r}, {str(tmp_path)!r}, dict(os.environ), sys.stdout))")],
        env=cli_env())
    pids = _pids(tmp_path, "sh.pid", "sleep.pid")
    assert all(_alive(p) for p in pids)
    launcher.kill()  # SIGKILL: the Ray worker lost, no cleanup of its own
    launcher.wait()
    assert _gone_within(pids), "the stage outlived the worker that launched it"


def test_a_stage_is_ended_when_its_wait_is_cut_short_and_leaves_nothing_behind(tmp_path):
    with open(tmp_path / "log", "a") as out:
        proc = launch(STAGE, str(tmp_path), dict(os.environ), out)
        pids = _pids(tmp_path, "sh.pid", "sleep.pid")

        def cancel(*_):
            raise KeyboardInterrupt  # what ray.cancel raises in the task

        previous = signal.signal(signal.SIGALRM, cancel)
        try:
            signal.setitimer(signal.ITIMER_REAL, 0.3)
            with pytest.raises(KeyboardInterrupt):
                wait_and_end_group(proc)
        finally:
            signal.signal(signal.SIGALRM, previous)
        assert _gone_within(pids)
        # a stage that ends but leaves a background process: the process goes with it
        proc = launch("sleep 60 & echo $! > bg.pid", str(tmp_path), dict(os.environ), out)
        assert wait_and_end_group(proc) == 0
        assert _gone_within(_pids(tmp_path, "bg.pid"))
