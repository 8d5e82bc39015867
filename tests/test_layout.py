"""The library's layout: data flows one way (data → attribution → training → evaluation → studies), the common ground
imports none of the stages, and every subpackage says what it is for."""

import ast
from pathlib import Path

import pytest

from tests.conftest import REPO

ORDER = ["common", "data", "attribution", "training", "evaluation", "studies"]
# What each package may import (its docstring says the same): never a package after it; evaluation reads models
# and results from disk, so it needs neither stage one nor the trainer.
MAY_USE = {
    "common": {"common"},
    "data": {"common", "data"},
    "attribution": {"common", "data", "attribution"},
    "training": {"common", "data", "attribution", "training"},
    "evaluation": {"common", "data", "evaluation"},
    "studies": {"common", "data", "attribution", "training", "evaluation", "studies"},
}
# Beside the flow: the sweep runs the stages' commands (never their code) and records them with DVC.
BESIDE = {"sweep": {"common", "sweep"}}
PACKAGES = sorted(p.name for p in (REPO / "pipeline").iterdir() if (p / "__init__.py").is_file())


def pipeline_imports(path: Path) -> set[str]:
    """The `pipeline.X` subpackages a module imports, at any depth of the module (lazy imports count)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{path}: relative import; the library uses absolute `pipeline.` imports")
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        for name in names:
            parts = name.split(".")
            if parts[0] == "pipeline" and len(parts) > 1:
                found.add(parts[1])
    return found


# Above the flow, one module: the Python API (a notebook's entry), which calls every stage's functions and which
# no package imports.
API = "api.py"


def test_the_library_has_exactly_the_stage_packages():
    assert PACKAGES == sorted(ORDER + list(BESIDE))
    assert sorted(p.name for p in (REPO / "pipeline").glob("*.py")) == ["__init__.py", API]


def test_the_api_sits_above_the_flow():
    assert pipeline_imports(REPO / "pipeline" / API) <= set(ORDER)  # the stages' functions, never the sweep
    importers = [m.relative_to(REPO).as_posix() for m in sorted((REPO / "pipeline").rglob("*.py"))
                 if "api" in pipeline_imports(m)]
    assert not importers, f"the library never imports its API: {importers}"


@pytest.mark.parametrize("package", ORDER + list(BESIDE))
def test_data_flows_one_way(package):
    allowed = MAY_USE.get(package) or BESIDE[package]
    assert package in BESIDE or allowed <= set(ORDER[: ORDER.index(package) + 1])
    wrong = {}
    for module in sorted((REPO / "pipeline" / package).rglob("*.py")):  # subpackages too (training/methods)
        bad = pipeline_imports(module) - allowed
        if bad:
            wrong[module.relative_to(REPO).as_posix()] = sorted(bad)
    assert not wrong, f"imports against the flow {ORDER} (allowed: {sorted(allowed)}): {wrong}"


@pytest.mark.parametrize("package", ORDER + list(BESIDE))
def test_each_package_says_what_it_is_for_and_what_it_may_use(package):
    doc = ast.get_docstring(ast.parse((REPO / "pipeline" / package / "__init__.py").read_text()))
    assert doc and "May use" in doc, f"pipeline/{package}/__init__.py needs a docstring with 'May use: ...'"


def module_imports(path: Path, modules: set[str]) -> set[str]:
    """The library modules `path` imports, lazy imports included (`from pipeline.x import y` counts as module
    pipeline.x.y where that is a module, else pipeline.x)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                      for a in node.names}
    return found & modules


def import_cycles(root: Path) -> list[list[str]]:
    """The import circles among the modules of `root`/pipeline: each strongly connected set of two or more."""
    files = {".".join(f.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): f
             for f in (root / "pipeline").rglob("*.py")}
    graph = {name: module_imports(f, set(files)) - {name} for name, f in files.items()}
    cycles, reaches = [], {}

    def reach(start: str) -> set[str]:  # every module `start` imports, directly or not
        if start not in reaches:
            seen, todo = set(), [start]
            while todo:
                for nxt in graph[todo.pop()] - seen:
                    seen.add(nxt)
                    todo.append(nxt)
            reaches[start] = seen
        return reaches[start]

    for name in sorted(graph):
        circle = sorted(m for m in reach(name) if name in reach(m))
        if name in circle and circle not in cycles:
            cycles.append(circle)
    return cycles


def test_no_module_imports_itself_round_a_circle():
    """A circle hidden by an import inside a function is a circle still: every import counts."""
    assert import_cycles(REPO) == []


def test_a_circle_through_a_lazy_import_is_found(tmp_path):
    files = {"pipeline/__init__.py": "", "pipeline/a.py": "from pipeline.b import f\n",
             "pipeline/b.py": "def f():\n    from pipeline import a\n", "pipeline/c.py": "import pipeline.a\n"}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert import_cycles(tmp_path) == [["pipeline.a", "pipeline.b"]]
    (tmp_path / "pipeline/b.py").write_text("def f():\n    pass\n")
    assert import_cycles(tmp_path) == []


def test_no_library_module_is_over_400_lines():
    """A module that grows past a few screens does more than one job: split it by job (evaluation/benchmarks/,
    training/run_config.py, ...)."""
    long = {p.relative_to(REPO).as_posix(): n for p in (REPO / "pipeline").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 400}
    assert not long, f"modules over 400 lines: {long}"


def test_stages_are_thin():
    """Commands read params, call the library and write: no stage module holds more than a screenful or two."""
    long = {p.name: n for p in (REPO / "stages").glob("*.py") if (n := len(p.read_text().splitlines())) > 90}
    assert not long, f"stage modules over 90 lines (move the logic into pipeline/): {long}"


@pytest.mark.slow
def test_every_dvc_stage_lists_exactly_the_code_it_runs(monkeypatch):
    """A code change reruns every stage that runs it, and only those: each stage depends on its command's code
    manifest, and each project's `code` stage on every file of the manifests it writes (`tokenunlearn code-deps
    --write` writes them; no one keeps them by hand)."""
    from click.testing import CliRunner

    from stages.cli import cli

    monkeypatch.chdir(REPO)
    result = CliRunner().invoke(cli, ["code-deps"])
    assert result.exit_code == 0, f"stale code deps (run `tokenunlearn code-deps --write`):\n{result.output}"


FILES = {"pipeline/a.py": "from pipeline.b import f\n", "pipeline/b.py": "def f():\n    import pipeline.c\n",
         "pipeline/c.py": "", "pipeline/__init__.py": '"""docstring only"""\n', "pipeline/unused.py": "",
         "stages/cmd.py": "from pipeline import a\nfrom .options import o\n", "stages/options.py": "o = 1\n",
         "scripts/s.py": "import pipeline.c\n"}


def test_code_deps_are_written_from_the_imports_and_leave_the_rest_of_the_file_alone(tmp_path):
    from pipeline.sweep.code_deps import stale_code_deps, write_code_deps

    for name, text in FILES.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    dvc_file = tmp_path / "dvc.yaml"
    dvc_file.write_text(
        "stages:\n"
        "  code:\n"
        "    cmd: tokenunlearn code-manifests --out artifacts/code --script scripts/s.py\n"
        "    deps:\n"
        "      - pipeline/unused.py\n"
        "    outs:\n"
        "      - artifacts/code\n"
        "  one:  # a comment that stays\n"
        "    foreach: [x, y]\n"
        "    do:\n"
        "      cmd: tokenunlearn cmd ${item} --out o\n"
        "      deps:\n"
        "        - data/${item}\n"
        "        - pipeline/unused.py\n"
        "      outs:\n"
        "        - o\n"
        "  two:\n"
        "    cmd: python scripts/s.py\n"
        "    deps:\n"
        "      - scripts/s.py\n")
    commands = {"cmd": tmp_path / "stages" / "cmd.py", "code-manifests": tmp_path / "stages" / "options.py"}
    assert set(stale_code_deps(tmp_path, dvc_file, commands)) == {"code", "one", "two"}
    assert write_code_deps(tmp_path, dvc_file, commands) == ["code", "one", "two"]
    assert dvc_file.read_text() == (
        "stages:\n"
        "  code:\n"
        "    cmd: tokenunlearn code-manifests --out artifacts/code --script scripts/s.py\n"
        "    deps:\n"
        "      - pipeline/a.py\n"
        "      - pipeline/b.py\n"
        "      - pipeline/c.py\n"
        "      - scripts/s.py\n"
        "      - stages/cmd.py\n"
        "      - stages/options.py\n"
        "    outs:\n"
        "      - artifacts/code\n"
        "  one:  # a comment that stays\n"
        "    foreach: [x, y]\n"
        "    do:\n"
        "      cmd: tokenunlearn cmd ${item} --out o\n"
        "      deps:\n"
        "        - data/${item}\n"
        "        - artifacts/code/stages/cmd.md5\n"
        "      outs:\n"
        "        - o\n"
        "  two:\n"
        "    cmd: python scripts/s.py\n"
        "    deps:\n"
        "      - scripts/s.py\n"
        "      - artifacts/code/scripts/s.md5\n")
    assert stale_code_deps(tmp_path, dvc_file, commands) == {}
    assert write_code_deps(tmp_path, dvc_file, commands) == []


def test_an_edit_changes_only_the_manifests_of_the_code_that_imports_it(tmp_path):
    """The manifests are md5sum's lines of the files each entry runs; an edit of pipeline/b.py (imported by the
    command, not by the script) rewrites the command's manifest alone, so only its stages rerun."""
    import hashlib

    from pipeline.sweep.code_deps import write_manifests

    for name, text in FILES.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    entries = [tmp_path / "stages" / "cmd.py", tmp_path / "scripts" / "s.py"]
    out = tmp_path / "artifacts" / "code"
    assert write_manifests(tmp_path, entries, out) == ["scripts/s.md5", "stages/cmd.md5"]
    md5 = lambda text: hashlib.md5(text.encode()).hexdigest()  # noqa: E731
    assert (out / "scripts/s.md5").read_text() == f"{md5('')}  pipeline/c.py\n"
    assert (out / "stages/cmd.md5").read_text().splitlines() == [
        f"{md5(FILES[f])}  {f}" for f in ("pipeline/a.py", "pipeline/b.py", "pipeline/c.py", "stages/cmd.py",
                                          "stages/options.py")]
    before = {p.name: p.read_bytes() for p in out.rglob("*.md5")}
    (tmp_path / "pipeline/b.py").write_text(FILES["pipeline/b.py"] + "# edited\n")
    write_manifests(tmp_path, entries, out)
    after = {p.name: p.read_bytes() for p in out.rglob("*.md5")}
    assert after["s.md5"] == before["s.md5"] and after["cmd.md5"] != before["cmd.md5"]


def test_a_script_whose_manifest_no_code_stage_writes_is_named(tmp_path):
    """A stage runs `python scripts/s.py`, but the `code` stage lacks `--script scripts/s.py`: `dvc repro` would fail
    on the missing manifest, so `code-deps` names the stage and the manifest."""
    from pipeline.sweep.code_deps import unwritten_manifests

    for name, text in FILES.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    dvc_file = tmp_path / "dvc.yaml"
    dvc_file.write_text("stages:\n  code:\n    cmd: tokenunlearn code-manifests --out artifacts/code\n"
                        "  two:\n    cmd: python scripts/s.py\n  one:\n    cmd: tokenunlearn cmd\n")
    commands = {"cmd": tmp_path / "stages" / "cmd.py", "code-manifests": tmp_path / "stages" / "options.py"}
    assert unwritten_manifests(tmp_path, [dvc_file], commands) == [f"{dvc_file}: two: scripts/s.md5"]
    dvc_file.write_text(dvc_file.read_text().replace("artifacts/code", "artifacts/code --script scripts/s.py"))
    assert unwritten_manifests(tmp_path, [dvc_file], commands) == []
