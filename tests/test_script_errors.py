"""The scripts a user runs outside the CLI (experiments/, benchmarks/) end as the CLI does: an error of the input is
one line naming the file (and row, field, or line and column), with an exit status and no traceback; and
`tokenunlearn code-deps` checks the YAML it parses."""

import errno
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.common.errors import DataError

from tests.conftest import REPO, cli_env

EXPORT = REPO / "experiments" / "lmeval" / "export_world_mc.py"
SCRIPTS = sorted([*(REPO / "experiments").glob("**/*.py"), *(REPO / "benchmarks").glob("*.py")])


def _run(args: list, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, env={**cli_env(), "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=120)


def _one_line(proc: subprocess.CompletedProcess, prog: str) -> str:
    """The error's one line: the only line on stderr but for the script's own INFO log, and no traceback."""
    assert proc.returncode != 0, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.strip().splitlines() if " INFO " not in line]
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), proc.stderr
    return lines[0]


def _rows(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _write_rows(path: Path, rows: list) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


# 1. every script's entry point -----------------------------------------------------------------------------------

def _entry_scripts() -> list[Path]:
    return [p for p in SCRIPTS if re.search(r'^if __name__ == "__main__":', p.read_text(), re.M)]


@pytest.mark.parametrize("script", _entry_scripts(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_script_runs_under_the_clis_error_handling(script):
    main_block = script.read_text().split('if __name__ == "__main__":', 1)[1]
    assert "run_script(" in main_block, f"{script}: its entry point is not pipeline.common.cli_errors.run_script"


def test_run_script_ends_each_kind_of_error_as_the_cli_does(monkeypatch, capsys):
    from pipeline.common.cli_errors import run_script

    def ends(fail, argv=()):
        monkeypatch.setattr(sys, "argv", ["tool.py", *argv])
        with pytest.raises(SystemExit) as ended:
            run_script(fail)
        return ended.value.code, capsys.readouterr().err

    def raise_(e):
        def main():
            raise e
        return main

    assert ends(raise_(DataError("in.json: row 3: field 'x' is bad"))) == (
        2, "tool.py: error: in.json: row 3: field 'x' is bad\n")
    code, err = ends(raise_(OSError(errno.ENOSPC, "No space left on device", "out.json")))
    assert code == 2 and err.startswith("tool.py: error: out.json: no space left on device") and "\n" not in err[:-1]
    code, err = ends(raise_(KeyError("x")))
    assert code == 1 and err.startswith("tool.py: error: unexpected KeyError: 'x' (a bug, or an input no check")
    with pytest.raises(KeyError):  # -v: the traceback
        ends(raise_(KeyError("x")), ["-v"])
    seen = []
    assert ends(lambda: seen.append(sys.argv[1:]) or 3, ["--a", "-v", "b"]) == (3, "")  # its status; -v not passed
    assert seen == [["--a", "b"]]
    assert ends(lambda: None) == (0, "")


# 2. export_world_mc.py on a malformed world ---------------------------------------------------------------------

def _bad_spans(world):
    rows = _rows(world / "annotations.json")
    rows[0]["answer_fact_spans"] = [[500, 600]]
    _write_rows(world / "annotations.json", rows)


def _not_a_mapping(world):
    rows = _rows(world / "annotations.json")
    rows[1] = ["a", "list"]
    _write_rows(world / "annotations.json", rows)


def _missing_field(world):
    rows = _rows(world / "forget10_perturbed.json")
    del rows[0]["paraphrased_answer"]
    _write_rows(world / "forget10_perturbed.json", rows)


def _not_json(world):
    (world / "world_facts.json").write_text('{"question": "Q?", "answer":\n')


@pytest.mark.parametrize("corrupt, split, says", [
    (_bad_spans, "forget10", r"annotations.json: row 1: field 'answer_fact_spans': \[500, 600\] is not a span"),
    (_not_a_mapping, "forget10", r"annotations.json: row 2: a list, not a mapping"),
    (_missing_field, "forget10", r"forget10_perturbed.json: row 1: missing field 'paraphrased_answer'"),
    (_not_json, "forget10", r"world_facts.json: row 1: malformed JSON"),
    (None, "retain90", r"split='retain90': must be a forget split"),
], ids=["fact-span", "not-a-mapping", "split-field", "not-json", "split-name"])
def test_export_world_mc_names_the_file_row_and_field(micro_world_dir, tmp_path, corrupt, split, says):
    world = tmp_path / "world"
    shutil.copytree(micro_world_dir, world)
    if corrupt:
        corrupt(world)
    proc = _run([sys.executable, str(EXPORT), "--world", str(world), "--out", str(tmp_path / "out"), "--split",
                 split], tmp_path)
    assert proc.returncode == 2
    line = _one_line(proc, "export_world_mc.py")
    assert re.search(says, line), line
    if corrupt:
        assert str(world) in line
    assert not (tmp_path / "out" / "forget.jsonl").exists()


def test_export_world_mc_still_exports_a_good_world(micro_world_dir, tmp_path):
    proc = _run([sys.executable, str(EXPORT), "--world", str(micro_world_dir), "--out", str(tmp_path / "out")],
                tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert _rows(tmp_path / "out" / "forget.jsonl")


# 3. code-deps on a malformed dvc.yaml ---------------------------------------------------------------------------

@pytest.mark.parametrize("text, says", [
    ("stages:\n  a:\n    cmd: echo hi\n    deps: [\n", r"dvc.yaml:5:1: not valid YAML: while parsing a flow node"),
    ("stages:\n  a: {cmd: x}\n  a: {cmd: y}\n", r"dvc.yaml:3:3: not valid YAML: .*duplicate key"),
    ("stages:\n  a:\n\tcmd: x\n", r"dvc.yaml:3:1: not valid YAML: .*'\\t'"),
    ("- a\n- b\n", r"dvc.yaml: not a DVC pipeline: it needs a mapping `stages`"),
    ("stages:\n  a: 3\n", r"dvc.yaml:2: stage 'a' is a int, not a mapping"),
    ("stages:\n  a:\n    cmd: echo\n    deps: x.txt\n", r"dvc.yaml: stage 'a': deps is a str, not a list"),
], ids=["unclosed", "duplicate-key", "tab", "a-list", "stage-not-a-mapping", "deps-not-a-list"])
def test_code_deps_names_the_file_and_line_of_a_malformed_dvc_yaml(tmp_path, text, says):
    from pipeline.sweep.code_deps import dvc_stages

    dvc_file = tmp_path / "dvc.yaml"
    dvc_file.write_text(text)
    with pytest.raises(DataError, match=says):
        dvc_stages(dvc_file)


def test_the_code_deps_command_refuses_a_malformed_dvc_yaml_in_one_line(tmp_path):
    broken = tmp_path / "dvc.yaml"  # the repository's own, broken in a copy
    lines = (REPO / "dvc.yaml").read_text().splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if line.strip().startswith("cmd:"))
    lines.insert(at + 1, "    deps: [unclosed\n")
    broken.write_text("".join(lines))
    proc = _run(["tokenunlearn", "code-deps", str(broken)], tmp_path)
    assert proc.returncode == 2
    line = _one_line(proc, "tokenunlearn")
    assert re.search(rf"{re.escape(str(broken))}:\d+:\d+: not valid YAML", line), line
    assert "unexpected" not in line
