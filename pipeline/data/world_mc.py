"""The embedded world's multiple-choice sets, the analogues of the benchmarks: `forget` (facts of the forget
authors, as WMDP: the knowledge to remove), `retain` (as many facts of retained authors) and `world_facts` (as MMLU:
general knowledge that should survive). The distractors are the world's own perturbed values of each fact.
"""

from __future__ import annotations

import random
import re
from dataclasses import replace
from pathlib import Path

from pipeline.common.errors import DataError, ParamError
from pipeline.data.mc_items import LETTERS, MCItem
from pipeline.data.tofu import load_split, read_json_records

WORLD_FACTS_SUBJECT = "world facts"
AUTHORS_SUBJECT = "fictitious authors"


def _balanced(items: list[MCItem], rng: random.Random) -> list[MCItem]:
    """Reorder each item's choices: the answer's positions are A, B, C, D equally often (±1), in shuffled order,
    and the distractors are shuffled around it. `items` have the answer first."""
    positions = [i % len(LETTERS) for i in range(len(items))]
    rng.shuffle(positions)
    out = []
    for item, pos in zip(items, positions):
        wrong = [c for i, c in enumerate(item.choices) if i != item.answer]
        rng.shuffle(wrong)
        wrong.insert(pos, item.choices[item.answer])
        out.append(replace(item, choices=wrong, answer=pos))
    return out


def _fact_index(world_dir: Path) -> dict[tuple[str, str], dict]:
    """(question, answer) -> the annotation of an author question (its author, attribute and fact span)."""
    path = world_dir / "annotations.json"
    if not path.exists():
        raise DataError(f"{path}: file not found (the world's MC sets need a generated world's annotations)")
    return {(a["question"], a["answer"]): a for a in read_json_records(path) if a.get("author")}


def _perturbed_values(paraphrased: str, perturbed: list[str], value: str) -> list[str] | None:
    """The values in the perturbed answers: each is the paraphrased answer's sentence with `value` swapped, so
    strip the text around the value's occurrence that every perturbed answer shares. None if none fits."""
    start = paraphrased.find(value)
    while start >= 0:
        prefix, suffix = paraphrased[:start], paraphrased[start + len(value):]
        if all(p.startswith(prefix) and p.endswith(suffix) and len(p) > len(prefix) + len(suffix) for p in perturbed):
            return [p[len(prefix): len(p) - len(suffix)] for p in perturbed]
        start = paraphrased.find(value, start + 1)
    return None


def _author_items(world_dir: Path, split: str, facts: dict, rng: random.Random) -> list[tuple[str, MCItem]]:
    """(author, item with the answer first) per question of a `*_perturbed` split: the true fact value and three
    of its perturbed values, drawn by the world from the same attribute's word list; the stem is the answer's text
    before the fact."""
    rows, where, out = load_split(world_dir, split), str(world_dir / f"{split}.json"), []
    for i, row in enumerate(rows, start=1):
        note = facts.get((row["question"], row["answer"]))
        if note is None or not note.get("answer_fact_spans"):
            raise DataError(f"{where}: row {i}: no fact span for this question in annotations.json")
        s, e = note["answer_fact_spans"][0]
        value = row["answer"][s:e]
        wrong = _perturbed_values(row["paraphrased_answer"], row["perturbed_answer"], value)
        if wrong is None:
            raise DataError(f"{where}: row {i}: field 'perturbed_answer': the answers do not differ from the "
                            f"paraphrased answer only in the fact {value!r}")
        wrong = list(dict.fromkeys(w for w in wrong if w != value))
        if len(wrong) < len(LETTERS) - 1:
            raise DataError(f"{where}: row {i}: field 'perturbed_answer': {len(wrong)} distinct perturbed values, "
                            f"need {len(LETTERS) - 1}")
        author = note["author"]
        # Name the author in the header only where the question does: never give the answer away.
        subject = f"the fictitious author {author}" if author in row["question"] else AUTHORS_SUBJECT
        choices = [value, *rng.sample(wrong, len(LETTERS) - 1)]
        out.append((author, MCItem(row["question"], choices, 0, subject, stem=row["answer"][:s], index=i - 1)))
    return out


def _world_fact_items(world_dir: Path) -> list[MCItem]:
    rows, where, out = load_split(world_dir, "world_facts"), str(world_dir / "world_facts.json"), []
    for i, row in enumerate(rows, start=1):
        options = [row[f"option{k}"] for k in range(1, len(LETTERS) + 1)]
        if row["answer"] not in options or len(set(options)) != len(options):
            raise DataError(f"{where}: row {i}: field 'answer' must be exactly one of four distinct options")
        wrong = [o for o in options if o != row["answer"]]
        out.append(MCItem(row["question"], [row["answer"], *wrong], 0, WORLD_FACTS_SUBJECT, index=i - 1))
    return out


def world_mc_sets(world_dir: str | Path, split: str = "forget10", seed: int = 0) -> dict[str, list[MCItem]]:
    """The world's three MC sets: `forget` (every question of the `split` authors), `retain` (as many questions
    of the retained authors in `retain_perturbed`, drawn by `seed`) and `world_facts`; choice order from `seed`.
    Each item's index is its row in its split's file (0-based)."""
    if not re.fullmatch(r"forget\d\d", split):
        raise ParamError(f"split='{split}': must be a forget split such as forget10")
    world_dir = Path(world_dir)
    facts = _fact_index(world_dir)
    rng = random.Random(seed)
    forget = _author_items(world_dir, f"{split}_perturbed", facts, rng)
    forgotten = {author for author, _ in forget}
    pool = [item for author, item in _author_items(world_dir, "retain_perturbed", facts, rng)
            if author not in forgotten]
    keep = sorted(rng.sample(range(len(pool)), min(len(forget), len(pool))))
    sets = {
        "forget": [item for _, item in forget],
        "retain": [pool[i] for i in keep],
        "world_facts": _world_fact_items(world_dir),
    }
    return {name: _balanced(items, rng) for name, items in sets.items()}
