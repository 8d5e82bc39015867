"""Each DVC stage's code dependencies, generated from the imports its command runs, never kept by hand.

A stage's command is `tokenunlearn COMMAND ...` (the module of that click command) or `python SCRIPT.py ...`. Its
code is that module and every project module it imports, at any depth, lazy imports included: `stages/*.py` and
`pipeline/**.py` (a package's `__init__.py` only where it holds code). `write_code_deps` rewrites the `pipeline/`
and `stages/` entries of every stage's `deps` to exactly that list, in place, leaving every other line of the
file as it was; `stale_code_deps` says which stages differ. So an edit reruns only the stages whose code imports
the edited file.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

from pipeline.common.atomic import atomic_file
from pipeline.common.errors import DataError

CODE_ROOTS = ("pipeline", "stages")
_SCRIPT = re.compile(r"^python3?\s+(?!-)(\S+\.py)\b")


def module_file(repo: Path, name: str) -> Path | None:
    """The file of a project module (`pipeline.common.params`, `stages.options`), or None if it is not one."""
    if name.split(".")[0] not in CODE_ROOTS:
        return None
    path = repo / Path(*name.split("."))
    if path.with_suffix(".py").is_file():
        return path.with_suffix(".py")
    return path / "__init__.py" if (path / "__init__.py").is_file() else None


def imported_modules(path: Path, package: str = "") -> list[str]:
    """The dotted names a module of `package` imports, anywhere in it (lazy imports too); `from a import b` gives
    `a` and `a.b`, since b may be a module; `from .b import c` (a command's `.options`) is resolved in `package`."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]) if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            names += [module, *(f"{module}.{a.name}" for a in node.names)]
    return names


def _has_code(path: Path) -> bool:
    """A module with more than a docstring (an empty package `__init__.py` is not worth a dependency)."""
    body = ast.parse(path.read_text(encoding="utf-8")).body
    return any(not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)) for n in body)


def code_closure(repo: Path, start: Path) -> list[str]:
    """The project files `start` runs, as sorted repository paths: itself and every project module it imports."""
    seen, todo = set(), [start]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        package = ".".join(path.relative_to(repo).parent.parts)
        todo += [f for name in imported_modules(path, package) if (f := module_file(repo, name)) is not None]
    return sorted(p.relative_to(repo).as_posix() for p in seen if p.name != "__init__.py" or _has_code(p))


def command_entry(repo: Path, cmd: str, commands: dict[str, Path]) -> Path | None:
    """The file a stage's command starts in: the module of `tokenunlearn COMMAND`, or the script of `python X.py`;
    None for any other command (it has no project code to track)."""
    words = cmd.split()
    if len(words) >= 2 and words[0] == "tokenunlearn":
        if words[1] not in commands:
            raise DataError(f"stage command {cmd.split(' --')[0]!r}: no tokenunlearn command {words[1]!r}")
        return commands[words[1]]
    script = _SCRIPT.match(cmd.strip())
    return repo / script.group(1) if script else None


@dataclass
class StageDeps:
    """One stage of a dvc.yaml: its name, its command, and its deps list (a ruamel sequence that knows its lines)."""

    name: str
    cmd: str
    deps: object  # ruamel.yaml CommentedSeq


def dvc_stages(dvc_file: Path) -> tuple[list[str], list[StageDeps]]:
    """The file's lines and its stages (a foreach's `do:` and a matrix stage alike)."""
    from ruamel.yaml import YAML

    text = dvc_file.read_text(encoding="utf-8")
    document = YAML(typ="rt").load(text)
    stages = []
    for name, stage in (document.get("stages") or {}).items():
        body = stage.get("do", stage)
        if isinstance(body, dict) and isinstance(body.get("cmd"), str):
            stages.append(StageDeps(name, " ".join(body["cmd"].split()), body.get("deps")))
    return text.splitlines(keepends=True), stages


def wanted_code_deps(repo: Path, stage: StageDeps, commands: dict[str, Path]) -> list[str] | None:
    entry = command_entry(repo, stage.cmd, commands)
    if entry is None:
        return None
    return [d for d in code_closure(repo, entry) if d.split("/")[0] in CODE_ROOTS]


def _is_code(dep) -> bool:
    return isinstance(dep, str) and dep.split("/")[0] in CODE_ROOTS


def stale_code_deps(repo: Path, dvc_file: Path, commands: dict[str, Path]) -> dict[str, tuple[list, list]]:
    """{stage: (code deps it lists, code deps it runs)} for each stage of `dvc_file` where the two differ."""
    _, stages = dvc_stages(dvc_file)
    stale = {}
    for stage in stages:
        wanted = wanted_code_deps(repo, stage, commands)
        have = sorted(d for d in (stage.deps or []) if _is_code(d))
        if wanted is not None and have != wanted:
            stale[stage.name] = (have, wanted)
    return stale


def write_code_deps(repo: Path, dvc_file: Path, commands: dict[str, Path]) -> list[str]:
    """Rewrite the code entries of each stage's deps in `dvc_file` (after its other deps); return the stages
    changed. Only those lines change: comments, order and every other entry stay as they are."""
    lines, stages = dvc_stages(dvc_file)
    changed, edits = [], []  # edits: (first line, last line, new lines), applied bottom-up
    for stage in stages:
        wanted = wanted_code_deps(repo, stage, commands)
        if wanted is None or stage.deps is None:
            if wanted:
                raise DataError(f"{dvc_file}: stage '{stage.name}' has no deps list to write its code deps into")
            continue
        if sorted(d for d in stage.deps if _is_code(d)) == wanted:
            continue
        rows = [stage.deps.lc.item(i)[0] for i in range(len(stage.deps))]
        indent = " " * stage.deps.lc.item(0)[1]
        kept = [lines[row] for row, dep in zip(rows, stage.deps) if not _is_code(dep)]
        if any(not lines[row].lstrip().startswith("- ") for row in rows):
            raise DataError(f"{dvc_file}: stage '{stage.name}': write its deps one `- path` a line")
        new = kept + [f"{indent[:-2]}- {path}\n" for path in wanted]
        edits.append((rows[0], rows[-1], new))
        changed.append(stage.name)
    for first, last, new in sorted(edits, reverse=True):
        lines[first:last + 1] = new
    if changed:
        with atomic_file(dvc_file) as f:
            f.write("".join(lines))
    return changed
