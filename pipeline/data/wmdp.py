"""WMDP (bio, cyber, chem): the hub's `cais/wmdp`, or a local JSON, JSON Lines or Parquet file of its records
{question, choices, answer}; and the writer of that format (the world's multiple-choice sets, as files).

The prompt's subject ("about biology") is lm-evaluation-harness's description of each `wmdp_*` task
(`lm_eval/tasks/wmdp/wmdp_{bio,cyber,chem}.yaml`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from pipeline.common.atomic import write_jsonl
from pipeline.common.errors import DataError, ParamError
from pipeline.common.paths import is_hub_name
from pipeline.data.mc_items import MCItem, item_from_record, load_hub, nonempty, own_subject, read_records

WMDP_HUB = "cais/wmdp"
# The harness's descriptions of the WMDP tasks (lm_eval/tasks/wmdp/wmdp_{bio,cyber,chem}.yaml).
WMDP_SUBJECTS = {"wmdp-bio": "biology", "wmdp-cyber": "cybersecurity", "wmdp-chem": "chemistry"}


def wmdp_config_of(path: Path) -> str | None:
    """The WMDP set a local file is, by its name or its folder's (the hub's layout: wmdp-bio/test-*.parquet);
    `wmdp_bio` (the harness's task name) counts too. None if neither names one."""
    for name in (path.stem, path.parent.name):
        if name.replace("_", "-") in WMDP_SUBJECTS:
            return name.replace("_", "-")
    return None


def load_wmdp(source: str | Path, config: str | None = None, subject: str | None = None,
              key: str = "the set's spec") -> list[MCItem]:
    """WMDP records {question, choices, answer} from a local .json (array or JSON Lines) / .jsonl / .parquet
    file, or from the hub (`cais/wmdp` with `config` wmdp-bio, wmdp-cyber or wmdp-chem, split test).

    The prompt's subject, first found: `subject`; the harness's for `config` ("biology" for wmdp-bio); a record's
    own `subject` field (as `write_wmdp_json` writes); the harness's for a file or folder named like a config
    (`wmdp-bio.json`). Nothing found is an error: a subject guessed from a file name would silently change every
    prompt. `key` names the set's spec in messages."""
    if config is not None and config not in WMDP_SUBJECTS:
        raise ParamError(f"{key}.config: '{config}' is not a WMDP set (choose from {sorted(WMDP_SUBJECTS)}); "
                         "for other questions set `subject:` instead")
    path = Path(source)
    if path.is_file():
        rows, where, named = read_records(path), str(path), wmdp_config_of(path)
    elif is_hub_name(source):
        if config is None:
            raise ParamError(f"{key}: '{source}' from the hub needs `config:`, one of {sorted(WMDP_SUBJECTS)}")
        rows, where, named = load_hub(str(source), config), f"{source}[{config}]", None
    else:
        raise DataError(f"WMDP source '{source}': no such file (and not a hub dataset name like {WMDP_HUB})")
    fixed = subject or WMDP_SUBJECTS.get(config)
    items = []
    for i, row in enumerate(rows, start=1):
        item = item_from_record(row, where, i, fixed or own_subject(row) or WMDP_SUBJECTS.get(named, ""), i - 1)
        if not item.subject:
            raise DataError(
                f"{where}: row {i}: the prompt's subject is unknown (no 'subject' field; the file is not named like "
                f"a WMDP set; {key} sets neither `subject:` nor `config:`): set `config:` (one of "
                f"{', '.join(WMDP_SUBJECTS)}) or `subject:` (the prompt's 'about ...' phrase, e.g. biology)")
        items.append(item)
    return nonempty(items, where)


def write_wmdp_json(items: Iterable[MCItem], path: str | Path) -> None:
    """WMDP-format records (JSON Lines), with each item's subject (and stem, if any), atomically; `load_wmdp`
    reads them back."""
    write_jsonl(path, ({"question": it.question, "choices": list(it.choices), "answer": it.answer,
                        "subject": it.subject, **({"stem": it.stem} if it.stem else {})} for it in items))
