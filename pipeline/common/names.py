"""Names that become parts of paths (runs, models, groups, requests, experiments): one rule, checked where a name
is parsed (the CLI's arguments, the params' keys), so that no name can point outside the directory it names a
thing in (`../../elsewhere`, `/tmp/x`, `a/b`)."""

from __future__ import annotations

import re

from pipeline.common.errors import ParamError

# Letters, digits, '_', '.', '-', starting with a letter or digit: one path component, never '.', '..' or hidden.
NAME = re.compile(r"[A-Za-z0-9][\w.-]{0,99}")
NAME_RULE = "letters, digits, '_', '.' and '-', starting with a letter or digit, at most 100 characters"

# The params whose keys are names (unlearn.runs.NAME, ...) and those that list names (seeds.runs: [NAME, ...]).
NAMED_KEYS = ("unlearn.runs", "finetune.models", "tune.groups")
NAMED_LISTS = ("seeds.runs", "tune.groups.*")


def check_name(value, what: str) -> str:
    """`value` if it is a name (see NAME_RULE), else a ParamError naming `what` it was given as."""
    if not isinstance(value, str) or not NAME.fullmatch(value):
        raise ParamError(f"{what}={value!r}: not a name ({NAME_RULE}); names become parts of paths")
    return value


def check_param_names(params: dict, where: str = "params") -> None:
    """Every name the params define or list (NAMED_KEYS, NAMED_LISTS), checked once, after the overlays and
    overrides are merged, so a name from any of them is caught with the key it sits at."""
    def at(dotted: str):
        node = params
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
        return node

    for dotted in NAMED_KEYS:
        keyed = at(dotted)
        for key in keyed if isinstance(keyed, dict) else ():
            check_name(key, f"{where}: {dotted} key")
    for dotted in NAMED_LISTS:
        parent, _, leaf = dotted.rpartition(".")
        if leaf == "*":  # every list under parent: tune.groups.GROUP
            under = at(parent)
            lists = [(f"{parent}.{k}", v) for k, v in under.items()] if isinstance(under, dict) else []
        else:
            lists = [(dotted, at(dotted))]
        for key, names in lists:
            for name in names if isinstance(names, list) else ():
                check_name(name, f"{where}: {key} entry")
