"""The experiments' DVC pipelines, rendered from one definition of each stage kind.

The experiments' pipelines (experiments/NAME/dvc.yaml) share their stage kinds, unlearning, evaluation,
attribution and the rest, with small differences: the params file and overlays, the artifacts folder, where the
inputs come from, an option more or less. DVC 3 has no stage templates across files, so the pipelines are
generated, as the code deps are (code_deps.py): each kind is defined once, in experiments/stages.yaml, and each
experiment says what is its own in experiments/NAME/pipeline.yaml; `render_pipeline` writes its dvc.yaml from the
two, `stale_pipelines` names those that differ from their rendering.

A kind is a DVC stage body (cmd as a list of options, deps, params, outs, metrics, plots) whose text holds slots,
`<root>`, filled from, last wins: the kinds' `slots`, the kind's `with`, the pipeline's `with`, the pipeline's
`kinds: KIND: with` and the stage's `with`; a slot's value may hold slots. An entry whose slot is null (an option,
a dep, a params key, an output) is left out. A stage, or the pipeline for every stage of a kind, may also `drop`
entries of its kind (an option by its flag, `--headline` or `-S unlearn.model`; a dep, a params key or an output by
its text), add deps, params, outs, metrics and plots, and `order` options. A kind's bare params keys are keys of
the params file that `--params` names in `<config>` (params.yaml where none does). A stage without a kind is
written as given. Every stage runs in experiments/ (`wdir: ..`) and lists the code manifest that `tokenunlearn
code-deps` wants, so that the two generators agree.
"""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import yaml

from pipeline.common.errors import DataError
from pipeline.sweep.code_deps import CodeDeps, StageDeps

KINDS = Path("experiments/stages.yaml")
SPEC = "pipeline.yaml"  # experiments/NAME/pipeline.yaml, rendered into experiments/NAME/dvc.yaml
WIDTH = 118
OUTPUTS = ("outs", "metrics", "plots")
KIND_STAGE_KEYS = {"kind", "note", "foreach", "matrix", "with", "drop", "order", "deps", "params", *OUTPUTS}
PIPELINE_KEYS = {"vars", "with", "kinds", "stages", "plots"}
_SLOT = re.compile(r"<(\w+)>")
_PARAMS_FILE = re.compile(r"(?:^|\s)--params\s+(\S+)")


def read_yaml(path: Path) -> dict:
    try:
        document = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise DataError(f"{path}: unable to read: {e.strerror}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark else ""
        raise DataError(f"{path}: not YAML{where}: {getattr(e, 'problem', None) or e}") from None
    if not isinstance(document, dict):
        raise DataError(f"{path}: expected a mapping")
    return document


def fill(text: str, slots: dict, where: str, depth: int = 0) -> str | None:
    """`text` with each `<slot>` replaced by its value (filled in turn); None where a slot it needs is null."""
    if depth > 20:
        raise DataError(f"{where}: the slots in {text!r} refer to each other in a circle")
    values = {}
    for name in set(_SLOT.findall(text)):
        if name not in slots:
            raise DataError(f"{where}: no value for the slot <{name}> (in {text!r})")
        value = slots[name] if slots[name] is None else fill(str(slots[name]), slots, where, depth + 1)
        if value is None:
            return None
        values[name] = value
    return _SLOT.sub(lambda m: values[m.group(1)], text)


def flag(option: str) -> str:
    """An option's name in `drop` and `order`: its first word (`--shards`), or `-S KEY` for a -S option."""
    words = option.split()
    return f"-S {words[1].split('=')[0]}" if words[0] == "-S" and len(words) > 1 else words[0]


def _path(entry) -> str:
    """The path of a deps or output entry: `path` or `{path: flags}`."""
    return entry if isinstance(entry, str) else next(iter(entry))


def _ordered(options: list[str], order: list[str], where: str) -> list[str]:
    """The options `order` names take its order among themselves, in the places they held."""
    names = [flag(o) for o in options]
    unknown = [n for n in order if n not in names]
    if unknown:
        raise DataError(f"{where}: order names options its kind lacks: {unknown}")
    picked = iter(options[names.index(n)] for n in order)
    return [next(picked) if flag(o) in order else o for o in options]


def _params(kind_keys: list, extras: list, params_file: str | None, slots: dict, where: str) -> list:
    """The stage's params: the kind's keys and each bare extra key are the params file's, the rest as given."""
    files: dict[str | None, list | None] = {}

    def add(file, keys):
        if keys is None:  # every key of the file
            files[file] = None
            return
        if file in files and files[file] is None:
            return
        listed = files.setdefault(file, [])
        for key in keys:
            key = fill(str(key), slots, where)
            if key is not None and key not in listed:
                listed.append(key)

    add(params_file, kind_keys)
    for extra in extras:
        for file, keys in ({params_file: [extra]} if isinstance(extra, str) else extra).items():
            add(params_file if file is None else fill(file, slots, where), keys)
    bare = files.pop(None, None) or []
    return [*bare, *({file: keys} for file, keys in files.items() if keys != [])]


def _command(options: list[str], drop: list[str], order: list[str] | None, slots: dict, where: str) -> str:
    """The command line: the first line, then each option not dropped and with no null slot, in order."""
    head, *options = options
    options = [o for o in options if flag(o) not in drop]
    if order:
        options = _ordered(options, order, where)
    command = fill(head, slots, where)
    if command is None:
        raise DataError(f"{where}: the command {head!r} has a null slot")
    words = [command, *(o for o in (fill(o, slots, where) for o in options) if o is not None)]
    return " ".join(" ".join(words).split())


def render_kind_stage(spec: dict, kinds: dict, pipeline: dict, where: str) -> dict:
    """A stage of a kind: the kind's body with the pipeline's and the stage's slots and differences."""
    kind = (kinds.get("kinds") or {}).get(spec["kind"])
    if kind is None:
        raise DataError(f"{where}: no stage kind {spec['kind']!r} in {KINDS}")
    local = (pipeline.get("kinds") or {}).get(spec["kind"]) or {}  # the pipeline's, for every stage of the kind
    slots = {**(kinds.get("slots") or {}), **(kind.get("with") or {}), **(pipeline.get("with") or {}),
             **(local.get("with") or {}), **(spec.get("with") or {})}
    drop = [*(local.get("drop") or []), *(spec.get("drop") or [])]
    known = {flag(o) for o in kind["cmd"][1:]} | \
        {_path(e) for field in ("deps", "params", *OUTPUTS) for e in kind.get(field) or []}
    if set(drop) - known:
        raise DataError(f"{where}: drop names what its kind {spec['kind']!r} lacks: {sorted(set(drop) - known)}")

    def entries(field: str) -> list:
        """The kind's entries of a field less those dropped, then the pipeline's and the stage's."""
        return [e for e in kind.get(field) or [] if _path(e) not in drop] + \
            [*(local.get(field) or []), *(spec.get(field) or [])]

    body = {"cmd": _command(kind["cmd"], drop, spec.get("order", local.get("order")), slots, where)}
    outputs = {}
    for field in OUTPUTS:
        for entry in entries(field):
            path = fill(_path(entry), slots, where)
            if path is not None:
                outputs.setdefault(field, []).append(path if isinstance(entry, str) else {path: entry[_path(entry)]})
    written = {_path(e) for field in outputs.values() for e in field}
    # A stage never depends on what it writes: the retain model's evaluation writes what every other one reads.
    deps = [d for d in (fill(d, slots, where) for d in entries("deps")) if d is not None and d not in written]
    if deps:
        body["deps"] = list(dict.fromkeys(deps))
    config = fill("<config>", slots, where) if "config" in slots else None
    params_file = (m := _PARAMS_FILE.search(config or "")) and m.group(1)
    params = _params([k for k in kind.get("params") or [] if k not in drop],
                     [*(local.get("params") or []), *(spec.get("params") or [])], params_file, slots, where)
    if params:
        body["params"] = params
    return {**body, **outputs}


def render_stage(name: str, spec: dict, kinds: dict, pipeline: dict, code: CodeDeps, workdir: Path,
                 where: str, manifests: dict) -> dict:
    """A stage as dvc.yaml holds it: its loop (foreach's `do`, or matrix), `wdir: ..` and its code manifest dep."""
    if "kind" in spec:
        if set(spec) - KIND_STAGE_KEYS:
            raise DataError(f"{where}: unknown keys {sorted(set(spec) - KIND_STAGE_KEYS)}")
        body = render_kind_stage(spec, kinds, pipeline, where)
    else:
        body = {k: v for k, v in spec.items() if k not in ("note", "foreach", "matrix")}
        if not isinstance(body.get("cmd"), str):
            raise DataError(f"{where}: a stage needs a kind or a cmd")
    stage = StageDeps(name, " ".join(body["cmd"].split()), workdir, None)
    entry = (workdir, *stage.cmd.split()[:2])  # `tokenunlearn COMMAND` or `python SCRIPT`: one manifest
    if entry not in manifests:  # its imports, read once: every file of the command's code
        manifests[entry] = code.wanted(stage) or []
    deps = [d for d in body.get("deps") or [] if not code.is_code(d, stage)] + manifests[entry]
    rest = {k: v for k, v in body.items() if k not in ("cmd", "deps")}
    body = {"wdir": "..", "cmd": body["cmd"], **({"deps": deps} if deps else {}), **rest}
    if "foreach" in spec:
        return {"foreach": spec["foreach"], "do": body}
    return {"matrix": spec["matrix"], **body} if "matrix" in spec else body


def render_pipeline(repo: Path, spec_file: Path, kinds: dict, commands: dict[str, Path],
                    manifests: dict | None = None) -> str:
    """The text of experiments/NAME/dvc.yaml rendered from its spec `spec_file` and the stage `kinds`
    (`manifests`: each command's code manifest dep, kept from one pipeline to the next)."""
    manifests = {} if manifests is None else manifests
    pipeline = read_yaml(spec_file)
    if set(pipeline) - PIPELINE_KEYS or not isinstance(pipeline.get("stages"), dict):
        raise DataError(f"{spec_file}: expected {sorted(PIPELINE_KEYS)} with `stages`, "
                        f"found {sorted(pipeline)}")
    code = CodeDeps(repo, spec_file.parent / "dvc.yaml", commands)
    workdir = spec_file.resolve().parent.parent  # every stage runs in experiments/ (wdir: ..)
    document = {k: pipeline[k] for k in ("vars",) if k in pipeline}
    document["stages"] = {name: render_stage(name, spec, kinds, pipeline, code, workdir, f"{spec_file}: {name}",
                                             manifests) for name, spec in pipeline["stages"].items()}
    if "plots" in pipeline:
        document["plots"] = pipeline["plots"]
    notes = {name: spec.get("note") for name, spec in pipeline["stages"].items()}
    text = _header(repo, spec_file) + dump_dvc_yaml(document, notes)
    if yaml.safe_load(text) != document:  # the emitter's own check: DVC reads what was rendered
        raise DataError(f"{spec_file}: the rendering does not read back as written (a bug of the emitter)")
    return text


def _header(repo: Path, spec_file: Path) -> str:
    """A generated file says so, then the spec's own opening comment (what the experiment is)."""
    spec = spec_file.resolve().relative_to(repo.resolve()).as_posix()
    note = (f"Generated by `tokenunlearn pipelines --write` from {spec} and the stage kinds of {KINDS.as_posix()}: "
            "edit those, not this file (tests/test_generated_pipelines.py fails when it is out of date).")
    lines = [*textwrap.wrap(note, WIDTH, initial_indent="# ", subsequent_indent="# ", break_on_hyphens=False), "#"]
    for line in spec_file.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        lines.append(line)
    return "\n".join(lines) + "\n"


def spec_files(repo: Path) -> list[Path]:
    return sorted((repo / "experiments").glob(f"*/{SPEC}"))


def stale_pipelines(repo: Path, commands: dict[str, Path], kinds: dict | None = None) -> list[tuple[Path, str]]:
    """(dvc.yaml, its rendering) for each experiment whose dvc.yaml differs from what its spec renders."""
    kinds = read_yaml(repo / KINDS) if kinds is None else kinds
    stale, manifests = [], {}
    for spec_file in spec_files(repo):
        dvc_file = spec_file.parent / "dvc.yaml"
        text = render_pipeline(repo, spec_file, kinds, commands, manifests)
        if not dvc_file.is_file() or dvc_file.read_text(encoding="utf-8") != text:
            stale.append((dvc_file, text))
    return stale


# ---- the emitter: DVC's usual style (block mappings, folded commands, flow lists of short values) ----------------

_BLOCK_LISTS = {"stages", "deps", "params", "outs", "metrics", "plots", "vars"}


def _scalar(value, flow: bool = False) -> str:
    """A scalar as YAML: plain where it reads back as itself, else double-quoted."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    text = str(value)
    try:
        plain = bool(text) and yaml.safe_load(text) == text and text == text.strip() and "\n" not in text
    except yaml.YAMLError:
        plain = False
    if plain and (": " in text or " #" in text or (flow and any(c in text for c in ",[]{}"))):
        plain = False
    return text if plain else json.dumps(text, ensure_ascii=False)


def _lines(value, indent: int, field: str | None = None) -> list[str]:
    pad = " " * indent
    if isinstance(value, list):
        out = []
        for item in value:
            if isinstance(item, (dict, list)) and item:
                nested = _lines(item, indent + 2, field)
                out.append(f"{pad}- {nested[0][indent + 2:]}")
                out += nested[1:]
            else:
                out.append(f"{pad}- {_scalar(item)}".rstrip())
        return out
    out = []
    for key, item in value.items():
        inner = key if key in _BLOCK_LISTS else field  # within a stage's params, every list is a block
        head = f"{pad}{_scalar(key)}:"
        if isinstance(item, list) and item and all(not isinstance(i, (dict, list)) for i in item) and \
                key not in _BLOCK_LISTS and inner != "params":
            flow = f"{head} [{', '.join(_scalar(i, flow=True) for i in item)}]"
            if len(flow) <= WIDTH:
                out.append(flow)
                continue
        if isinstance(item, (dict, list)) and item:
            out.append(head)
            out += _lines(item, indent + 2, inner)
        elif key == "cmd" and len(f"{head} {item}") > WIDTH:
            out.append(f"{head} >-")
            out += _folded(item, pad + "  ")
        else:
            out.append(f"{head} {_scalar(item)}".rstrip())
    return out


def _folded(cmd: str, pad: str) -> list[str]:
    """A command's lines in a folded scalar (`>-`: read back joined by single spaces), each option kept whole on
    its line where it fits."""
    units = []
    for word in cmd.split():
        if units and not word.startswith("-"):
            units[-1] += " " + word
        else:
            units.append(word)
    lines = [pad]
    for unit in units:
        if lines[-1] != pad and len(lines[-1]) + 1 + len(unit) > WIDTH:
            lines.append(pad)
        lines[-1] += unit if lines[-1] == pad else " " + unit
    return lines


def dump_dvc_yaml(document: dict, notes: dict[str, str | None]) -> str:
    """dvc.yaml's text: the top-level keys apart, a blank line between stages, each stage's note above it."""
    parts = []
    for key, value in document.items():
        if key != "stages":
            parts.append("\n".join(_lines({key: value}, 0)))
            continue
        stages = []
        for name, stage in value.items():
            note = [f"  # {line}" for line in textwrap.wrap(notes.get(name) or "", WIDTH - 4, break_long_words=False,
                                                            break_on_hyphens=False)]
            stages.append("\n".join([*note, *_lines({name: stage}, 2)]))
        parts.append("stages:\n" + "\n\n".join(stages))
    return "\n\n".join(parts) + "\n"
