"""The plan of a sweep: the chosen stages of a DVC pipeline, each with its command, working directory, the chosen
stages it waits for, and the resources its kind needs. Written as JSON, it runs where DVC is not installed."""

from __future__ import annotations

import fnmatch
import json
import os
from dataclasses import dataclass
from pathlib import Path

from pipeline.common.atomic import write_json
from pipeline.common.errors import DataError, ParamError
from pipeline.common.params import at_least, check_rules, dataclass_from_params

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


def plan_from_dvc(pipeline: str, patterns: list[str], root: Path, table: dict[str, Resources]) -> list[dict]:
    """The stages of `pipeline` whose names match `patterns`, in file order: name, DVC address, command, working
    directory (relative to `root`), the chosen stages each waits for (one's dependency is another's output) and
    its resources."""
    from dvc.exceptions import DvcException
    from dvc.repo import Repo

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
                        and any(_under(d, o) or _under(o, d) for d in deps for o in paths)})
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


def write_plan(plan: list[dict], path: Path) -> None:
    write_json(path, plan, indent=1)


def read_plan(path: Path) -> list[dict]:
    """A plan file, checked entry by entry: a bad one is an error naming the file and the entry."""
    try:
        plan = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: not a readable plan (JSON list of stages): {e}") from None
    if not isinstance(plan, list):
        raise DataError(f"{path}: a plan is a JSON list of stages")
    names = set()
    for i, entry in enumerate(plan):
        missing = PLAN_KEYS - set(entry) if isinstance(entry, dict) else PLAN_KEYS
        if missing:
            raise DataError(f"{path}: entry {i} lacks {sorted(missing)}")
        if entry["name"] in names:
            raise DataError(f"{path}: entry {i}: stage '{entry['name']}' is planned twice")
        names.add(entry["name"])
    return plan
