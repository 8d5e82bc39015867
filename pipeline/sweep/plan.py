"""The plan of a sweep: the chosen stages of a DVC pipeline, each with its command, working directory, the chosen
stages it waits for, and the resources its kind needs. Written as JSON, it runs where DVC is not installed; its run's
outcome (sweep.json) is then recorded where DVC is (`record_outcome`)."""

from __future__ import annotations

import fnmatch
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from pipeline.common.atomic import write_json
from pipeline.common.errors import DataError, ParamError
from pipeline.common.params import at_least, check_rules, dataclass_from_params

log = logging.getLogger(__name__)

PLAN_KEYS = {"stage", "name", "cmd", "wdir", "after", "cpus", "gpus"}


@dataclass(frozen=True)
class Resources:
    cpus: float = 1.0   # the stage's threads (OMP_NUM_THREADS): Ray runs as many stages at once as the CPUs allow
    gpus: float = 0.0   # GPUs the stage sees (Ray sets CUDA_VISIBLE_DEVICES); a fraction shares one GPU


def resources_table(values: dict | None, where: str = "sweep.resources") -> dict[str, Resources]:
    """`sweep.resources`: stage kind (the stage's name before `@`: unlearn, evaluate, ...) -> {cpus, gpus}; the kind
    `default` serves every other stage."""
    if values is not None and not isinstance(values, dict):
        raise ParamError(f"{where}: a mapping of stage kind -> {{cpus, gpus}}")
    values = {"default": {}, **(values or {})}
    table = {}
    for kind, spec in values.items():
        res = dataclass_from_params(Resources, spec or {}, f"{where}.{kind}")
        check_rules(res, {"cpus": at_least(0), "gpus": at_least(0)}, f"{where}.{kind}")
        table[kind] = res
    return table


def resources_for(name: str, table: dict[str, Resources]) -> Resources:
    return table.get(name.split("@")[0], table["default"])


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix.rstrip("/") + "/")


def overlaps(path: str, other: str) -> bool:
    """One path is the other or inside it: a dependency on a directory depends on the outputs written in it."""
    return _under(path, other) or _under(other, path)


def check_same_project(pipeline: str, root: Path) -> None:
    """A pipeline of another DVC project (experiments/NAME/dvc.yaml from the repository root: experiments/ is a
    project of its own) is swept from that project's directory, where its stages' paths hold."""
    start = (root / pipeline).resolve().parent
    project = next((d for d in (start, *start.parents) if (d / ".dvc").is_dir()), None)
    if project is not None and project != root.resolve():
        inner = os.path.relpath(root / pipeline, project)
        raise ParamError(f"{pipeline} belongs to the DVC project {os.path.relpath(project, root)}/: sweep it from "
                         f"there (cd {os.path.relpath(project, root)} && tokenunlearn sweep {inner} ...)")


def plan_from_dvc(pipeline: str, patterns: list[str], root: Path, table: dict[str, Resources]) -> list[dict]:
    """The stages of `pipeline` whose names match `patterns`, in file order: name, DVC address, command, working
    directory (relative to `root`), the chosen stages each waits for (one's dependency is another's output) and
    its resources."""
    from dvc.exceptions import DvcException
    from dvc.repo import Repo

    check_same_project(pipeline, root)

    try:
        with Repo(str(root)) as repo:
            return _plan(repo, pipeline, patterns, table)
    except DvcException as e:  # a broken dvc.yaml, a missing params file: DVC's own one-line message
        raise DataError(f"{pipeline}: {e}") from None


def _plan(repo, pipeline: str, patterns: list[str], table: dict[str, Resources]) -> list[dict]:
    stages = repo.stage.collect(str(Path(repo.root_dir, pipeline)))
    wanted = [s for s in stages if any(fnmatch.fnmatchcase(s.name, p) for p in patterns)]
    if not wanted:
        raise ParamError(f"{pipeline}: no stage matches {list(patterns)} (it has {[s.name for s in stages]})")
    rel = lambda p: os.path.relpath(p, repo.root_dir)  # noqa: E731
    outs = {s.name: [rel(o.fs_path) for o in s.outs] for s in wanted}
    plan = []
    for s in wanted:
        deps = [rel(d.fs_path) for d in s.deps]
        after = sorted({other for other, paths in outs.items() if other != s.name
                        and any(overlaps(d, o) for d in deps for o in paths)})
        res = resources_for(s.name, table)
        plan.append({"stage": s.addressing, "name": s.name, "cmd": s.cmd if isinstance(s.cmd, str)
                     else " && ".join(s.cmd), "wdir": rel(s.wdir), "after": after, "cpus": res.cpus, "gpus": res.gpus})
    return plan


def downstream_closure(plan: list[dict], names: set[str]) -> set[str]:
    """`names` and every planned stage that waits on one of them, directly or not."""
    found = set(names)
    grew = True
    while grew:
        grew = False
        for entry in plan:
            if entry["name"] not in found and found & set(entry["after"]):
                found.add(entry["name"])
                grew = True
    return found


def find_cycle(plan: list[dict]) -> list[str] | None:
    """A chain of planned stages, each waiting on the next and the last on the first (a stage waiting on itself is
    one), or None. A cycle never becomes ready: the sweep would wait for it forever."""
    names = {e["name"] for e in plan}
    after = {e["name"]: {a for a in e["after"] if a in names} for e in plan}
    # Peel off the stages that could start (all they wait on peeled); what is left waits on a cycle or is in one.
    left = dict(after)
    peeled = True
    while peeled:
        ready = [n for n, ups in left.items() if not ups & left.keys()]
        peeled = bool(ready)
        for n in ready:
            del left[n]
    if not left:
        return None
    # Every stage left waits on another one left: walk upstream until a stage comes round again.
    walk = [next(iter(left))]
    while True:
        up = min(left[walk[-1]] & left.keys())
        if up in walk:
            return walk[walk.index(up):] + [up]
        walk.append(up)


def check_acyclic(plan: list[dict], where: str) -> None:
    cycle = find_cycle(plan)
    if cycle:
        raise DataError(f"{where}: the stages wait on each other in a cycle, each waiting on the next "
                        f"({' -> '.join(cycle)}); none of them "
                        "could ever start: remove one of these dependencies")


def write_plan(plan: list[dict], path: Path) -> None:
    write_json(path, plan, indent=1)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# What each key of a plan entry holds: a check and what the check wants, for the error.
_ENTRY_TYPES = {
    "stage": (lambda v: isinstance(v, str) and v != "", "a DVC stage address (text)"),
    "name": (lambda v: isinstance(v, str) and v != "", "a stage name (text)"),
    "cmd": (lambda v: isinstance(v, str), "a command line (text)"),
    "wdir": (lambda v: isinstance(v, str), "a directory relative to the repository (text)"),
    "after": (lambda v: isinstance(v, list) and all(isinstance(a, str) for a in v), "a list of stage names"),
    "cpus": (lambda v: _is_number(v) and v >= 0, "a number at least 0"),
    "gpus": (lambda v: _is_number(v) and v >= 0, "a number at least 0"),
    "fingerprint": (lambda v: v is None or isinstance(v, str), "the stage's fingerprint (text) or null"),
}
OPTIONAL_KEYS = {"fingerprint"}  # written by --write-plan, so that --record can tell the stage has not changed


def check_entry(entry, i: int, path: Path) -> None:
    if not isinstance(entry, dict):
        raise DataError(f"{path}: entry {i} is a {type(entry).__name__}, not a mapping of {sorted(PLAN_KEYS)}")
    missing = PLAN_KEYS - set(entry)
    if missing:
        raise DataError(f"{path}: entry {i} lacks {sorted(missing)}")
    unknown = set(entry) - PLAN_KEYS - OPTIONAL_KEYS
    if unknown:
        raise DataError(f"{path}: entry {i} has unknown key(s) {sorted(unknown)} (known: "
                        f"{sorted(PLAN_KEYS | OPTIONAL_KEYS)})")
    for key, (ok, wanted) in _ENTRY_TYPES.items():
        if key in entry and not ok(entry[key]):
            raise DataError(f"{path}: entry {i} ('{entry.get('name')}'): {key} is {entry[key]!r}, not {wanted}")


def read_plan(path: Path) -> list[dict]:
    """A plan file, checked entry by entry: a bad one is an error naming the file and the entry; so is a cycle."""
    try:
        plan = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: not a readable plan (JSON list of stages): {e}") from None
    if not isinstance(plan, list):
        raise DataError(f"{path}: a plan is a JSON list of stages, not a {type(plan).__name__}")
    names = set()
    for i, entry in enumerate(plan):
        check_entry(entry, i, path)
        if entry["name"] in names:
            raise DataError(f"{path}: entry {i}: stage '{entry['name']}' is planned twice")
        names.add(entry["name"])
    check_acyclic(plan, str(path))
    return plan


def refuse_unseen_changes(base: dict, params: dict, overrides, overlays, params_file, reads_params: bool) -> None:
    """-S and --overlay change the params the sweep command reads (sweep.resources), never the stages': each stage
    reads its params file itself, as dvc.yaml says, and dvc.lock records that file. A change the stages would not
    see is refused, not dropped. `base`: the params file alone; `params`: with the overlays and overrides."""
    options = [f"-S {o}" for o in overrides] + [f"--overlay {f}" for f in overlays]
    if not options:
        return
    if not reads_params:
        raise ParamError(f"{' '.join(options)}: --plan and --record read no params (a plan fixes each stage's "
                         "command and resources): drop them, or give them when the plan is written")
    changed = sorted(k for k in set(base) | set(params) if k != "sweep" and base.get(k) != params.get(k))
    if changed:
        raise ParamError(f"{' '.join(options)}: change {changed}, which the stages would not see (each reads "
                         f"{params_file} itself, and dvc.lock records that file): set them there, or use "
                         "`dvc exp run -S`; here -S and --overlay set only sweep.*")


STATUSES = ("done", "up to date", "failed", "blocked", "stopped")


def read_outcome(path: Path) -> dict[str, dict]:
    """A sweep's sweep.json, checked: its stages (name -> {stage, status, ...}); a bad one is an error naming the
    file and what is wrong."""
    try:
        outcome = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: not a readable sweep.json (a sweep's outcome): {e}") from None
    stages = outcome.get("stages") if isinstance(outcome, dict) else None
    if not isinstance(stages, dict):
        raise DataError(f"{path}: not a sweep's sweep.json: it needs a mapping 'stages' of stage name -> outcome")
    for name, info in stages.items():
        if not isinstance(info, dict):
            raise DataError(f"{path}: stages.{name} is a {type(info).__name__}, not a mapping {{stage, status}}")
        if not isinstance(info.get("stage"), str) or not info["stage"]:
            raise DataError(f"{path}: stages.{name}.stage: missing or not a DVC stage address (text)")
        if info.get("status") not in STATUSES:
            raise DataError(f"{path}: stages.{name}.status is {info.get('status')!r}, not one of {list(STATUSES)}")
        if not isinstance(info.get("fingerprint"), (str, type(None))):
            raise DataError(f"{path}: stages.{name}.fingerprint is {info['fingerprint']!r}, not text")
    return stages


def record_outcome(record: Path, ledger) -> None:
    """--record: the stages a --plan run finished, into dvc.lock, where each is still the stage its plan had (its
    fingerprint); any other is refused by name, since its outputs follow from a command, params or inputs that are
    no longer the stage's."""
    stages = read_outcome(record)
    done = {s["stage"]: s.get("fingerprint") for s in stages.values() if s["status"] == "done"}
    refused = ledger.record(list(done), expected=done, planned=[s["stage"] for s in stages.values()])
    log.info("recorded %d stages in dvc.lock", len(done) - len(refused))
    if refused:
        unmarked = [a for a in refused if done[a] is None]
        raise DataError(f"{record}: not recorded, as their command, params or inputs changed since the plan was "
                        f"written (or the plan has no fingerprint{': ' + ', '.join(unmarked) if unmarked else ''}): "
                        f"{', '.join(refused)}; run them again (tokenunlearn sweep PIPELINE STAGES)")
