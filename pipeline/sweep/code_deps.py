"""Each DVC stage's code as one dependency: the manifest of the files its command runs, generated, never kept by
hand.

A stage's command is `tokenunlearn COMMAND ...` (the module of that click command) or `python SCRIPT.py ...`. The
code it runs is that module and every project module it imports, at any depth, lazy imports included:
`stages/*.py` and `pipeline/**.py` (a package's `__init__.py` only where it holds code). Listing those files in
every stage put about 40 paths, each with its hash, into dvc.lock for every stage. Instead each DVC project has
one stage `code` (`tokenunlearn code-manifests`) that depends on every code file and writes, for each command
module and script, a manifest `artifacts/code/stages/unlearn.md5`: the md5 and path of every file that entry runs,
in md5sum's format (`md5sum -c` checks it from the repository root). Each stage depends on its entry's manifest
alone. An edit rewrites the manifests of the entries that import the edited file, and only their stages rerun;
the others see the same manifest, byte for byte.

`write_code_deps` keeps dvc.yaml so, in place, leaving every other line of the file as it was: each stage's code
dependency is its manifest, and the `code` stage's deps are the files of every manifest; `stale_code_deps` says
which stages differ.
"""

from __future__ import annotations

import ast
import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from pipeline.common.atomic import atomic_dir, atomic_file
from pipeline.common.errors import DataError

CODE_ROOTS = ("pipeline", "stages")
MANIFESTS = "artifacts/code"  # the `code` stage's output, in its DVC project
MANIFEST_COMMAND = "code-manifests"
_SCRIPT = re.compile(r"^python3?\s+(?!-)(\S+\.py)\b")
_SCRIPT_OPTION = re.compile(r"--script[ =](\S+)")


def code_repo(start: Path | None = None) -> Path:
    """The repository whose code the stages run: the nearest directory from `start` (the working directory) up that
    holds the `pipeline` package (the repository root from experiments/ too), else the installed package's."""
    here = Path(start or Path.cwd()).resolve()
    for directory in (here, *here.parents):
        if (directory / "pipeline" / "__init__.py").is_file() and (directory / "stages").is_dir():
            return directory
    import pipeline

    return Path(pipeline.__file__).resolve().parent.parent


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


def entry_code(repo: Path, entry: Path) -> list[str]:
    """The `pipeline/` and `stages/` files an entry (a command's module, a script) runs."""
    return [f for f in code_closure(repo, entry) if f.split("/")[0] in CODE_ROOTS]


def manifest_name(repo: Path, entry: Path) -> str:
    """`stages/unlearn.md5` for stages/unlearn.py: the entry's repository path, `.md5` for `.py`."""
    return Path(entry).resolve().relative_to(repo).with_suffix(".md5").as_posix()


def manifest_text(repo: Path, files: list[str]) -> str:
    """md5sum's lines for `files` (repository paths, in order): what the manifest of an entry holds."""
    return "".join(f"{hashlib.md5((repo / f).read_bytes()).hexdigest()}  {f}\n" for f in files)


def write_manifests(repo: Path, entries: list[Path], out_dir: Path) -> list[str]:
    """Write the manifest of each entry that runs project code into `out_dir` (replacing it whole); return
    their names."""
    written = {}
    for entry in entries:
        files = entry_code(repo, entry)
        if files:
            written[manifest_name(repo, entry)] = manifest_text(repo, files)
    with atomic_dir(out_dir) as tmp:
        for name, text in written.items():
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp / name).write_text(text, encoding="utf-8")
    return sorted(written)


def command_entry(repo: Path, cmd: str, commands: dict[str, Path], where: Path) -> Path | None:
    """The file a stage's command starts in: the module of `tokenunlearn COMMAND`, or the script of `python X.py`
    (relative to the stage's directory `where`); None for any other command (it has no project code to track)."""
    words = cmd.split()
    if len(words) >= 2 and words[0] == "tokenunlearn":
        if words[1] not in commands:
            raise DataError(f"stage command {cmd.split(' --')[0]!r}: no tokenunlearn command {words[1]!r}")
        return commands[words[1]]
    script = _SCRIPT.match(cmd.strip())
    return Path(os.path.normpath(where / script.group(1))) if script else None


def manifest_entries(repo: Path, cmd: str, commands: dict[str, Path], where: Path) -> list[Path]:
    """What a `code-manifests` command writes manifests for: every command's module, and each `--script`."""
    scripts = [Path(os.path.normpath(where / s)) for s in _SCRIPT_OPTION.findall(cmd)]
    return sorted(set(commands.values())) + scripts


def project_root(dvc_file: Path, repo: Path) -> Path:
    """The DVC project a dvc.yaml belongs to: its nearest directory holding `.dvc` (the repository else)."""
    start = Path(os.path.normpath(dvc_file.resolve().parent))
    for directory in (start, *start.parents):
        if (directory / ".dvc").is_dir():
            return directory
        if directory == repo:
            break
    return repo


@dataclass
class StageDeps:
    """One stage of a dvc.yaml: its name, command, the directory it runs in, and its deps list (a ruamel
    sequence that knows its lines; None where it has none)."""

    name: str
    cmd: str
    where: Path
    deps: object  # ruamel.yaml CommentedSeq


def _read_dvc_yaml(dvc_file: Path):
    """The file's text and its document (ruamel's, which knows each item's line); a file that is not readable YAML
    is an error naming it and, where the parser knows it, the line and column."""
    from ruamel.yaml import YAML, YAMLError

    try:
        text = dvc_file.read_text(encoding="utf-8")
        return text, YAML(typ="rt").load(text)
    except OSError as e:
        raise DataError(f"{dvc_file}: unable to read: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise DataError(f"{dvc_file}: not UTF-8 text (byte {e.start})") from None
    except YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{dvc_file}:{mark.line + 1}:{mark.column + 1}" if mark else str(dvc_file)
        what = "; ".join(str(p) for p in (getattr(e, "context", None), getattr(e, "problem", None)) if p)
        raise DataError(f"{where}: not valid YAML: {what or str(e).splitlines()[0]}") from None


def dvc_stages(dvc_file: Path) -> tuple[list[str], list[StageDeps]]:
    """The file's lines and its stages (a foreach's `do:` and a matrix stage alike)."""
    text, document = _read_dvc_yaml(dvc_file)
    if not isinstance(document, dict) or not isinstance(document.get("stages") or {}, dict):
        raise DataError(f"{dvc_file}: not a DVC pipeline: it needs a mapping `stages` of stage name -> stage")
    stages = []
    for name, stage in (document.get("stages") or {}).items():
        if not isinstance(stage, dict):
            line = f":{stage_line + 1}" if (stage_line := _key_line(document["stages"], name)) is not None else ""
            raise DataError(f"{dvc_file}{line}: stage '{name}' is a {type(stage).__name__}, not a mapping "
                            "(cmd, deps, outs, ...)")
        body = stage.get("do", stage)
        if isinstance(body, dict) and isinstance(body.get("cmd"), str):
            if not isinstance(body.get("deps"), (list, type(None))):
                raise DataError(f"{dvc_file}: stage '{name}': deps is a {type(body['deps']).__name__}, not a list "
                                "of paths")
            where = Path(os.path.normpath(dvc_file.resolve().parent / str(body.get("wdir", "."))))
            stages.append(StageDeps(name, " ".join(body["cmd"].split()), where, body.get("deps")))
    return text.splitlines(keepends=True), stages


def _key_line(mapping, key) -> int | None:
    """The line (from 0) where a key of a ruamel mapping is written, or None."""
    try:
        return mapping.lc.key(key)[0]
    except (AttributeError, KeyError, TypeError):
        return None


class CodeDeps:
    """What each stage of one dvc.yaml should list as its code: `wanted(stage)`, and which of its deps are code
    (a `pipeline/` or `stages/` file, or a manifest), in the paths the stage's directory sees."""

    def __init__(self, repo: Path, dvc_file: Path, commands: dict[str, Path]):
        self.repo, self.commands = repo.resolve(), commands
        self.manifests = project_root(dvc_file, self.repo) / MANIFESTS

    def _rel(self, path: Path, where: Path) -> str:
        return Path(os.path.relpath(path, where)).as_posix()

    def _scripts(self, stage: StageDeps) -> list[Path]:
        """The scripts a `code` stage writes manifests for (its deps too: their imports make the manifests)."""
        if stage.cmd.split()[:2] != ["tokenunlearn", MANIFEST_COMMAND]:
            return []
        return [e for e in manifest_entries(self.repo, stage.cmd, self.commands, stage.where)
                if e not in self.commands.values()]

    def is_code(self, dep, stage: StageDeps) -> bool:
        if not isinstance(dep, str) or "${" in dep:
            return False
        full = Path(os.path.normpath(stage.where / dep))
        inside = lambda root: full == root or root in full.parents  # noqa: E731
        return inside(self.manifests) or any(inside(self.repo / r) for r in CODE_ROOTS) or \
            full in self._scripts(stage)

    def wanted(self, stage: StageDeps) -> list[str] | None:
        """The stage's code deps: its entry's manifest (the `code` stage: every file of every manifest it writes,
        and its scripts); None for a command that runs no project code."""
        words = stage.cmd.split()
        if words[:2] == ["tokenunlearn", MANIFEST_COMMAND]:
            entries = manifest_entries(self.repo, stage.cmd, self.commands, stage.where)
            files = sorted({f for e in entries for f in entry_code(self.repo, e)})
            return sorted(self._rel(p, stage.where) for p in [*(self.repo / f for f in files), *self._scripts(stage)])
        entry = command_entry(self.repo, stage.cmd, self.commands, stage.where)
        if entry is None or not entry_code(self.repo, entry):
            return None
        return [self._rel(self.manifests / manifest_name(self.repo, entry), stage.where)]


def stale_code_deps(repo: Path, dvc_file: Path, commands: dict[str, Path]) -> dict[str, tuple[list, list]]:
    """{stage: (code deps it lists, code deps it runs)} for each stage of `dvc_file` where the two differ."""
    _, stages = dvc_stages(dvc_file)
    code, stale = CodeDeps(repo, dvc_file, commands), {}
    for stage in stages:
        wanted = code.wanted(stage)
        have = sorted(d for d in (stage.deps or []) if code.is_code(d, stage))
        if wanted is not None and have != sorted(wanted) or wanted is None and have:
            stale[stage.name] = (have, wanted or [])
    return stale


def unwritten_manifests(repo: Path, dvc_files: list[Path], commands: dict[str, Path]) -> list[str]:
    """`FILE: STAGE: MANIFEST` for each stage whose code manifest no `code` stage of its project writes (a script
    that its `--script` options lack): `dvc repro` would fail on the missing dependency."""
    written: dict[Path, set[str]] = {}
    wanted = []
    for dvc_file in dvc_files:
        _, stages = dvc_stages(dvc_file)
        code = CodeDeps(repo, dvc_file, commands)
        for stage in stages:
            if stage.cmd.split()[:2] == ["tokenunlearn", MANIFEST_COMMAND]:
                entries = manifest_entries(repo, stage.cmd, commands, stage.where)
                written.setdefault(code.manifests, set()).update(
                    manifest_name(repo, e) for e in entries if entry_code(repo, e))
                continue
            entry = command_entry(repo, stage.cmd, commands, stage.where)
            if entry is not None and entry_code(repo, entry):
                wanted.append((dvc_file, stage.name, code.manifests, manifest_name(repo, entry)))
    return [f"{f}: {name}: {m}" for f, name, root, m in wanted if m not in written.get(root, set())]


def write_code_deps(repo: Path, dvc_file: Path, commands: dict[str, Path]) -> list[str]:
    """Rewrite the code entries of each stage's deps in `dvc_file` (after its other deps); return the stages
    changed. Only those lines change: comments, order and every other entry stay as they are."""
    lines, stages = dvc_stages(dvc_file)
    code, changed, edits = CodeDeps(repo, dvc_file, commands), [], []  # edits: (first, last, new lines), bottom-up
    for stage in stages:
        wanted = code.wanted(stage) or []
        if stage.deps is None:
            if wanted:
                raise DataError(f"{dvc_file}: stage '{stage.name}' has no deps list to write its code deps into")
            continue
        if sorted(d for d in stage.deps if code.is_code(d, stage)) == sorted(wanted):
            continue
        rows = [stage.deps.lc.item(i)[0] for i in range(len(stage.deps))]
        indent = " " * stage.deps.lc.item(0)[1]
        kept = [lines[row] for row, dep in zip(rows, stage.deps) if not code.is_code(dep, stage)]
        if any(not lines[row].lstrip().startswith("- ") for row in rows):
            raise DataError(f"{dvc_file}: stage '{stage.name}': write its deps one `- path` a line")
        if not kept and not wanted:
            raise DataError(f"{dvc_file}: stage '{stage.name}' would be left with an empty deps list: remove it")
        new = kept + [f"{indent[:-2]}- {path}\n" for path in wanted]
        edits.append((rows[0], rows[-1], new))
        changed.append(stage.name)
    for first, last, new in sorted(edits, reverse=True):
        lines[first:last + 1] = new
    if changed:
        with atomic_file(dvc_file) as f:
            f.write("".join(lines))
    return changed
