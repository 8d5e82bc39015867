"""The embedded world's MUSE corpora as passage files, and its forget set split into unlearning requests.

`world-muse` writes what MUSE's evaluation reads; this writes what training reads, from the same partition
(`muse.world_parts`): the biographies of each of MUSE's corpora (forget, retain1, retain2, holdout) as JSON Lines,
the passage files that finetuning (`finetune.models.NAME.corpora`), corpus-mode attribution and the retain corpus
read. With `requests` K it also splits the forget authors into K disjoint groups, MUSE's sustainability setting
(its News `sust` has forget_1 .. forget_4, unlearned one after another) and its scalability setting (growing
forget sets): `request{k}.json` holds group k's biographies, `first{k}.json` groups 1..k together, and
`corpora.json` says which authors, texts, knowmem questions and verbmem prompts each request holds, so that an
evaluation of the whole forget set can be read per request.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from pipeline.common.atomic import atomic_dir, write_json, write_jsonl
from pipeline.common.errors import DataError, ParamError
from pipeline.data.muse import PARTS, author_questions, verbmem_item, world_parts

MANIFEST = "corpora.json"


@dataclass(frozen=True)
class Request:
    """One unlearning request: its authors, and the items of MUSE's forget-side metrics that are theirs."""

    name: str
    authors: tuple[str, ...]
    texts: tuple[str, ...]            # their biographies: raw forget, privleak forget
    questions: tuple[str, ...]        # their knowmem forget questions
    verbmem_prompts: tuple[str, ...]  # their verbmem prompts


def split_requests(items: Sequence[str], k: int, seed: int) -> list[list[str]]:
    """`items` in `k` disjoint groups that cover them, sizes differing by at most one, each group in the order of
    `items`. Which item goes where is a shuffle seeded by `seed`: the same split for the same seed."""
    if len(set(items)) != len(items):
        raise ParamError(f"requests: the forget set names an author twice ({sorted(items)}); a split needs distinct "
                         "ones")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= len(items):
        raise ParamError(f"requests={k!r}: split {len(items)} forget authors into 1 to {len(items)} requests")
    order = list(items)
    random.Random(seed).shuffle(order)
    rank = {item: i for i, item in enumerate(items)}
    return [sorted(order[g::k], key=rank.__getitem__) for g in range(k)]  # dealt round: sizes differ by at most one


def _request(name: str, bios: list[dict], notes: list[dict]) -> Request:
    prompts = [v.prompt for v in map(verbmem_item, (b["text"] for b in bios)) if v is not None]
    return Request(name, tuple(b["author"] for b in bios), tuple(b["text"] for b in bios),
                   tuple(q["question"] for q in author_questions(notes, bios)), tuple(prompts))


def write_muse_corpora(world_dir: str | Path, out_dir: str | Path, forget_split: str = "forget10", requests: int = 0,
                       seed: int = 0) -> dict:
    """Write `out_dir` (atomically): `{part}.json` for each of MUSE's corpora, and with `requests` > 0 the
    requests' files; returns the manifest (`corpora.json`)."""
    parts, notes = world_parts(world_dir, forget_split)
    groups: list[Request] = []
    if requests:
        forget = {b["author"]: b for b in parts["forget"]}
        names = split_requests(list(forget), requests, seed)
        groups = [_request(f"request{k}", [forget[a] for a in group], notes) for k, group in enumerate(names, 1)]
    manifest = {"world": str(world_dir), "forget_split": forget_split,
                "authors": {part: [b["author"] for b in parts[part]] for part in PARTS},
                "seed": seed if requests else None,
                "requests": [{"name": r.name, "authors": list(r.authors), "texts": list(r.texts),
                              "questions": list(r.questions), "verbmem_prompts": list(r.verbmem_prompts)}
                             for r in groups]}
    with atomic_dir(out_dir) as tmp:
        for part in PARTS:
            write_jsonl(tmp / f"{part}.json", parts[part])
        by_author = {b["author"]: b for b in parts["forget"]}
        for k, request in enumerate(groups, 1):
            write_jsonl(tmp / f"request{k}.json", [by_author[a] for a in request.authors])
            first = {a for r in groups[:k] for a in r.authors}  # groups 1..k, in the forget set's order
            write_jsonl(tmp / f"first{k}.json", [b for b in parts["forget"] if b["author"] in first])
        write_json(tmp / MANIFEST, manifest)
    return manifest


def load_requests(corpora_dir: str | Path) -> list[Request]:
    """The requests of a `muse-corpora --requests K` output, checked: disjoint, and each with its items."""
    file = Path(corpora_dir) / MANIFEST
    if not file.is_file():
        raise DataError(f"{corpora_dir}: no {MANIFEST}; write it with `tokenunlearn muse-corpora --requests K`")
    manifest = _read_object(file)
    rows = manifest.get("requests") if isinstance(manifest, dict) else None
    if not rows:
        raise DataError(f"{file}: no requests (written without --requests)")
    out, seen = [], set()
    for i, row in enumerate(rows, start=1):
        fields = ("name", "authors", "texts", "questions", "verbmem_prompts")
        if not isinstance(row, dict) or any(not isinstance(row.get(f), str if f == "name" else list) for f in fields):
            raise DataError(f"{file}: requests[{i}]: needs {', '.join(fields)}")
        if seen & set(row["authors"]):
            raise DataError(f"{file}: requests[{i}]: author(s) {sorted(seen & set(row['authors']))} in an earlier "
                            "request too")
        seen |= set(row["authors"])
        out.append(Request(row["name"], *(tuple(row[f]) for f in fields[1:])))
    return out


def _read_object(file: Path):
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{file}: not JSON ({e})") from None
