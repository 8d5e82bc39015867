"""The library's layout: data flows one way (data → attribution → training → evaluation), the common ground
imports none of the stages, and every subpackage says what it is for."""

import ast
from pathlib import Path

import pytest

from .conftest import REPO

ORDER = ["common", "data", "attribution", "training", "evaluation"]
# What each package may import (its docstring says the same): never a package after it; evaluation reads models
# and results from disk, so it needs neither stage one nor the trainer.
MAY_USE = {
    "common": {"common"},
    "data": {"common", "data"},
    "attribution": {"common", "data", "attribution"},
    "training": {"common", "data", "attribution", "training"},
    "evaluation": {"common", "data", "evaluation"},
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


def test_the_library_has_exactly_the_stage_packages():
    assert PACKAGES == sorted(ORDER + list(BESIDE))
    assert sorted(p.name for p in (REPO / "pipeline").glob("*.py")) == ["__init__.py"]


@pytest.mark.parametrize("package", ORDER + list(BESIDE))
def test_data_flows_one_way(package):
    allowed = MAY_USE.get(package) or BESIDE[package]
    assert package in BESIDE or allowed <= set(ORDER[: ORDER.index(package) + 1])
    wrong = {}
    for module in sorted((REPO / "pipeline" / package).glob("*.py")):
        bad = pipeline_imports(module) - allowed
        if bad:
            wrong[module.relative_to(REPO).as_posix()] = sorted(bad)
    assert not wrong, f"imports against the flow {ORDER} (allowed: {sorted(allowed)}): {wrong}"


@pytest.mark.parametrize("package", ORDER + list(BESIDE))
def test_each_package_says_what_it_is_for_and_what_it_may_use(package):
    doc = ast.get_docstring(ast.parse((REPO / "pipeline" / package / "__init__.py").read_text()))
    assert doc and "May use" in doc, f"pipeline/{package}/__init__.py needs a docstring with 'May use: ...'"


def test_stages_are_thin():
    """Commands read params, call the library and write: no stage module holds more than a screenful or two."""
    long = {p.name: n for p in (REPO / "stages").glob("*.py") if (n := len(p.read_text().splitlines())) > 90}
    assert not long, f"stage modules over 90 lines (move the logic into pipeline/): {long}"


COMMAND_MODULES = {"make-world": "world", "train-tokenizer": "tokenizer", "finetune": "finetune", "relearn": "relearn",
                   "check-models": "check_models", "attribute": "attribute", "reference": "reference",
                   "unlearn": "unlearn",
                   "evaluate": "evaluate", "report": "report", "report-seeds": "report_seeds", "tune": "tune",
                   "compare-attribution": "compare_attribution", "sweep": "sweep"}


def module_file(name: str) -> Path | None:
    path = REPO / Path(*name.split("."))
    if path.with_suffix(".py").is_file():
        return path.with_suffix(".py")
    return path / "__init__.py" if (path / "__init__.py").is_file() else None


def library_closure(start: Path) -> set[str]:
    """The library files a module needs, following every import (lazy ones too), as repository paths."""
    seen, todo = set(), [start]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module, *(f"{node.module}.{a.name}" for a in node.names)] \
                if isinstance(node, ast.ImportFrom) and node.module else []
            todo += [f for n in names if n.startswith("pipeline") and (f := module_file(n))]
    return {p.relative_to(REPO).as_posix() for p in seen
            if p.parts[-2] != "stages" and p.name != "__init__.py"}


def dvc_stages():
    import yaml

    for dvc_file in [REPO / "dvc.yaml", *sorted((REPO / "experiments").glob("*/dvc.yaml"))]:
        for name, stage in yaml.safe_load(dvc_file.read_text())["stages"].items():
            stage = stage.get("do", stage)
            yield f"{dvc_file.relative_to(REPO)}:{name}", stage["cmd"], stage.get("deps", [])


@pytest.mark.parametrize("where,cmd,deps", list(dvc_stages()), ids=[where for where, _, _ in dvc_stages()])
def test_every_dvc_stage_depends_on_all_the_code_it_runs(where, cmd, deps):
    """A code change reruns every stage that runs it: each stage's deps cover the library files its command
    imports (a directory dep covers its files), and no dep names a file that does not exist."""
    if not cmd.startswith("tokenunlearn "):
        return  # an experiment's own script (its file is a dep of its own)
    command = cmd.split()[1]
    needed = library_closure(REPO / "stages" / f"{COMMAND_MODULES[command]}.py")
    code_deps = [d for d in deps if d.startswith("pipeline")]
    missing = sorted(f for f in needed if not any(f == d or f.startswith(d.rstrip("/") + "/") for d in code_deps))
    assert not missing, f"{where}: deps lack {missing}"
    assert all((REPO / d).exists() for d in code_deps), f"{where}: deps name missing files"
