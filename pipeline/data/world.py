"""The embedded fictitious world: a TOFU-shaped benchmark generated from a seed, fully offline.

Authors get attribute values drawn from the word lists in `data/world/lexicon.json`; questions, answers,
paraphrases and biographies are rendered from `data/world/templates.json`. Besides TOFU's splits the world
writes what real TOFU lacks: the character spans of every answer's facts and every question's nouns
(`annotations.json`), the authors' full fact sheets (`authors.json`) and a biography passage per author
(`biographies.json`), for corpus-mode (WMDP-style) unlearning.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from pipeline.common.atomic import atomic_dir, write_json, write_jsonl
from pipeline.common.errors import DataError, ParamError

FORGET_PERCENTS = (1, 5, 10)
SLOT_RE = re.compile(r"\{(\w+)\}|\[([^\[\]]+)\]")


@dataclass(frozen=True)
class WorldConfig:
    n_authors: int = 50
    questions_per_author: int = 10
    seed: int = 1234
    n_perturbed: int = 5          # TOFU: 5 perturbed answers per author question
    n_general_perturbed: int = 3  # TOFU: 3 for world facts and real authors

    def validate(self, n_attributes: int) -> None:
        if not 3 <= self.n_authors <= 2000:
            raise ParamError(f"world.n_authors={self.n_authors}: must be between 3 and 2000")
        if not 1 <= self.questions_per_author <= n_attributes:
            raise ParamError(
                f"world.questions_per_author={self.questions_per_author}: must be between 1 and {n_attributes} "
                "(the number of attributes in templates.json)"
            )
        for name in ("n_perturbed", "n_general_perturbed"):
            if not 1 <= getattr(self, name) <= 10:
                raise ParamError(f"world.{name}={getattr(self, name)}: must be between 1 and 10")


@dataclass(frozen=True)
class Rendered:
    """A rendered template: the text, the spans of each slot's value, and the spans of the nouns."""

    text: str
    slot_spans: dict[str, list[tuple[int, int]]]
    noun_spans: list[tuple[int, int]]


def render(template: str, slots: dict[str, str], nominal: frozenset[str] = frozenset()) -> Rendered:
    """Fill `{slot}`s and strip `[noun]` markers, keeping character spans of both."""
    out: list[str] = []
    pos = 0
    length = 0
    slot_spans: dict[str, list[tuple[int, int]]] = {}
    noun_spans: list[tuple[int, int]] = []
    for m in SLOT_RE.finditer(template):
        literal = template[pos : m.start()]
        out.append(literal)
        length += len(literal)
        if m.group(1) is not None:
            key = m.group(1)
            if key not in slots:
                raise DataError(f"template {template!r}: unknown slot {{{key}}}")
            value = slots[key]
            span = (length, length + len(value))
            slot_spans.setdefault(key, []).append(span)
            if key in nominal:
                noun_spans.append(span)
        else:
            value = m.group(2)
            noun_spans.append((length, length + len(value)))
        out.append(value)
        length += len(value)
        pos = m.end()
    out.append(template[pos:])
    return Rendered("".join(out), slot_spans, sorted(noun_spans))


@dataclass
class WorldSpec:
    """The word lists and templates the world is drawn from (the project's `data/world/`)."""

    lexicon: dict
    templates: dict

    @classmethod
    def load(cls, data_dir: str | Path, templates: str | Path | None = None) -> "WorldSpec":
        """`data_dir`'s lexicon.json and templates.json, or the `templates` file given instead of the latter."""
        data_dir = Path(data_dir)
        parts = {}
        for name in ("lexicon", "templates"):
            path = Path(templates) if name == "templates" and templates else data_dir / f"{name}.json"
            try:
                parts[name] = json.loads(path.read_text(encoding="utf-8"))
            except FileNotFoundError:
                raise DataError(f"{path}: file not found (the embedded world's word lists live in data/world/)")
            except json.JSONDecodeError as e:
                raise DataError(f"{path}: malformed JSON at line {e.lineno}: {e.msg}")
        return cls(**parts)

    @property
    def attributes(self) -> list[dict]:
        return self.templates["attributes"]

    def fingerprint(self) -> str:
        blob = json.dumps([self.lexicon, self.templates], sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


@dataclass
class Author:
    name: str
    facts: dict[str, str]


def _title(rng: random.Random, lex: dict) -> str:
    return f"The {rng.choice(lex['title_adjectives'])} {rng.choice(lex['title_nouns'])}"


def _person(rng: random.Random, lex: dict) -> str:
    return f"{rng.choice(lex['first_names'])} {rng.choice(lex['last_names'])}"


def _city(rng: random.Random, lex: dict) -> str:
    country = rng.choice(lex["countries"])
    return rng.choice([country["capital"], *country["cities"]])


def _date(rng: random.Random, lex: dict) -> str:
    return f"{rng.choice(lex['months'])} {rng.randint(1, 28)}, {rng.randint(1920, 1995)}"


def _birthplace(rng: random.Random, lex: dict) -> str:
    country = rng.choice(lex["countries"])
    return f"{rng.choice([country['capital'], *country['cities']])}, {country['name']}"


def _classic(rng: random.Random, lex: dict) -> str:
    a = rng.choice(lex["classic_authors"])
    return f"{a['first_name']} {a['last_name']}"


def _pick(key: str) -> Callable[[random.Random, dict], str]:
    return lambda rng, lex: rng.choice(lex[key])


# One sampler per attribute: draws a value from the lexicon. Attributes in UNIQUE get distinct values per author.
SAMPLERS: dict[str, Callable[[random.Random, dict], str]] = {
    "birthplace": _birthplace,
    "birth_date": _date,
    "genre": _pick("genres"),
    "father_occupation": _pick("occupations"),
    "mother_occupation": _pick("occupations"),
    "award": _pick("awards"),
    "first_book": _title,
    "theme": _pick("themes"),
    "full_name": _person,
    "university": _pick("universities"),
    "publisher": _pick("publishers"),
    "second_book": _title,
    "influence": _classic,
    "residence": _city,
    "debut_year": lambda rng, lex: str(rng.randint(1945, 2020)),
    "language": lambda rng, lex: rng.choice(lex["countries"])["language"],
    "hobby": _pick("hobbies"),
    "instrument": _pick("instruments"),
    "pet": _pick("animals"),
    "mentor": _person,
}
UNIQUE = {"full_name": "person", "mentor": "person", "birth_date": "date", "first_book": "title", "second_book": "title"}


def _draw(rng: random.Random, lex: dict, key: str, used: dict[str, set], avoid: set[str] = frozenset()) -> str:
    """Draw a value for `key`, distinct from `avoid` and, for unique attributes, from every earlier draw."""
    pool = used.setdefault(UNIQUE[key], set()) if key in UNIQUE else None
    for _ in range(10_000):
        value = SAMPLERS[key](rng, lex)
        if value in avoid or (pool is not None and value in pool):
            continue
        if pool is not None:
            pool.add(value)
        return value
    raise ParamError(f"the word lists are too small to draw distinct values for '{key}'; lower world.n_authors")


def _perturbations(rng: random.Random, lex: dict, key: str, true_value: str, n: int) -> list[str]:
    values: list[str] = []
    for _ in range(10_000):
        if len(values) == n:
            return values
        v = SAMPLERS[key](rng, lex)
        if v != true_value and v not in values:
            values.append(v)
    raise ParamError(f"cannot draw {n} distinct perturbed values for '{key}'")


def split_sizes(n: int) -> dict[int, int]:
    """Authors in forget01/05/10 (and holdout01/05/10): percent of n, rounded half up, at least one."""
    return {p: max(1, int(n * p / 100 + 0.5)) for p in FORGET_PERCENTS}


@dataclass
class World:
    splits: dict[str, list[dict]] = field(default_factory=dict)
    annotations: list[dict] = field(default_factory=list)
    authors: list[dict] = field(default_factory=list)
    biographies: list[dict] = field(default_factory=list)
    manifest: dict = field(default_factory=dict)


class _Builder:
    def __init__(self, spec: WorldSpec, cfg: WorldConfig):
        cfg.validate(len(spec.attributes))
        self.spec, self.cfg, self.lex = spec, cfg, spec.lexicon
        self.rng = random.Random(cfg.seed)
        self.used: dict[str, set] = {
            # keep fictitious authors' names apart from the classic ("real") authors'
            "person": {f"{a['first_name']} {a['last_name']}" for a in self.lex["classic_authors"]},
        }
        self.attrs = spec.attributes[: cfg.questions_per_author]
        self.attr_by_key = {a["key"]: a for a in spec.attributes}
        unknown = [a["key"] for a in spec.attributes if a["key"] not in SAMPLERS]
        if unknown:
            raise DataError(f"templates.json: attributes with no sampler: {unknown}")

    def author(self) -> Author:
        facts = {a["key"]: _draw(self.rng, self.lex, a["key"], self.used) for a in self.spec.attributes}
        return Author(name=facts["full_name"], facts=facts)

    def _slots(self, author: Author, value: str) -> dict[str, str]:
        return {**author.facts, "name": author.name, "value": value}

    def qa(self, author: Author, attr: dict) -> tuple[dict, dict]:
        """One author question: the TOFU perturbed record and its ground-truth annotation."""
        rng, key = self.rng, attr["key"]
        nominal = frozenset(k for k, a in self.attr_by_key.items() if a["nominal"]) | {"name"}
        q_idx, pq_idx = rng.sample(range(len(attr["questions"])), 2)
        a_idx, pa_idx = rng.sample(range(len(attr["answers"])), 2)
        value = author.facts[key]
        slots = self._slots(author, value)
        question = render(attr["questions"][q_idx], slots, nominal)
        answer = render(attr["answers"][a_idx], slots)
        para_q = render(attr["questions"][pq_idx], slots, nominal)
        para_a = render(attr["answers"][pa_idx], slots)
        perturbed = [
            render(attr["answers"][pa_idx], self._slots(author, v)).text
            for v in _perturbations(rng, self.lex, key, value, self.cfg.n_perturbed)
        ]
        record = {
            "question": question.text,
            "answer": answer.text,
            "paraphrased_answer": para_a.text,
            "perturbed_answer": perturbed,
            "paraphrased_question": para_q.text,
        }
        annotation = {
            "question": question.text,
            "answer": answer.text,
            "author": author.name,
            "attribute": key,
            "question_noun_spans": question.noun_spans,
            "answer_fact_spans": answer.slot_spans.get("value", []),
            "answer_subject_spans": answer.slot_spans.get("name", []),
        }
        return record, annotation

    def biography(self, author: Author) -> dict:
        # The name sentence opens the passage; the rest follow the attribute order.
        order = sorted(self.attrs, key=lambda a: a["key"] != "full_name")
        text, fact_spans, name_spans = "", [], []
        for attr in order:
            sentence = render(attr["bio"], self._slots(author, author.facts[attr["key"]]))
            offset = len(text) + (1 if text else 0)
            text = f"{text} {sentence.text}" if text else sentence.text
            shift = lambda spans: [(s + offset, e + offset) for s, e in spans]  # noqa: E731
            fact_spans += shift(sentence.slot_spans.get("value", []))
            name_spans += shift(sentence.slot_spans.get("name", []))
            if attr["key"] == "full_name":
                name_spans += shift(sentence.slot_spans.get("value", []))
        return {"author": author.name, "text": text, "fact_spans": fact_spans, "name_spans": sorted(name_spans)}

    def general(self, kind: str, subjects: list[dict], slot_of: Callable[[dict], dict[str, str]]) -> tuple:
        """World facts or real-author analogs: short answers with 3 perturbed answers and 4 options."""
        plain, perturbed, annotations = [], [], []
        for subject in subjects:
            slots = slot_of(subject)
            for fact in self.spec.templates[kind]:
                key = fact["key"]
                # "Who wrote X?" asks for the name; every other fact asks for the slot of the same key.
                answer_key = "name" if key == "famous_book" else key
                answer = slots[answer_key]
                template = self.rng.choice(fact["questions"])
                q = render(template, slots, frozenset(slots) - {answer_key})
                pool = sorted({slot_of(s)[answer_key] for s in subjects} - {answer})
                # TOFU's plain file has 4 options; its perturbed file n_general_perturbed wrong answers.
                wrong = self.rng.sample(pool, max(3, self.cfg.n_general_perturbed))
                options = [answer, *wrong[:3]]
                self.rng.shuffle(options)
                plain.append({"question": q.text, **{f"option{i + 1}": o for i, o in enumerate(options)},
                              "answer": answer})
                perturbed.append({"question": q.text, "answer": answer,
                                  "perturbed_answer": wrong[: self.cfg.n_general_perturbed]})
                annotations.append({"question": q.text, "answer": answer, "author": None, "attribute": key,
                                    "question_noun_spans": q.noun_spans, "answer_fact_spans": [[0, len(answer)]],
                                    "answer_subject_spans": []})
        return plain, perturbed, annotations


def generate_world(spec: WorldSpec, cfg: WorldConfig) -> World:
    b = _Builder(spec, cfg)
    sizes = split_sizes(cfg.n_authors)
    trained = [b.author() for _ in range(cfg.n_authors)]
    holdout = [b.author() for _ in range(sizes[10])]
    world = World()

    per_author: list[list[tuple[dict, dict]]] = [[b.qa(a, attr) for attr in b.attrs] for a in trained + holdout]
    trained_qa, holdout_qa = per_author[: cfg.n_authors], per_author[cfg.n_authors :]
    qa = lambda groups: [rec for g in groups for rec, _ in g]  # noqa: E731
    plain = lambda recs: [{"question": r["question"], "answer": r["answer"]} for r in recs]  # noqa: E731

    world.splits["full"] = plain(qa(trained_qa))
    for p, k in sizes.items():
        world.splits[f"forget{p:02d}"] = plain(qa(trained_qa[-k:]))
        world.splits[f"forget{p:02d}_perturbed"] = qa(trained_qa[-k:])
        world.splits[f"retain{100 - p}"] = plain(qa(trained_qa[:-k]))
        world.splits[f"holdout{p:02d}"] = plain(qa(holdout_qa[:k]))
    world.splits["retain_perturbed"] = qa(trained_qa[: sizes[10]])

    countries = b.lex["countries"]
    wf, wf_p, wf_ann = b.general("world_facts", countries, lambda c: {"country": c["name"], **c})
    classics = b.lex["classic_authors"]
    ra, ra_p, ra_ann = b.general(
        "real_authors", classics,
        lambda a: {"name": f"{a['first_name']} {a['last_name']}", "country": a["country"], "genre": a["genre"],
                   "famous_book": a["famous_book"]},
    )
    world.splits.update(world_facts=wf, world_facts_perturbed=wf_p, real_authors=ra, real_authors_perturbed=ra_p)

    world.annotations = [ann for g in per_author for _, ann in g] + wf_ann + ra_ann
    forget_sets = {p: {a.name for a in trained[-k:]} for p, k in sizes.items()}
    for i, a in enumerate(trained + holdout):
        group = "trained" if i < cfg.n_authors else "holdout"
        forget = [f"forget{p:02d}" for p, names in forget_sets.items() if a.name in names]
        world.authors.append({"index": i, "name": a.name, "group": group, "forget_splits": forget, "facts": a.facts})
        world.biographies.append({"index": i, "group": group, "forget_splits": forget, **b.biography(a)})

    world.manifest = {
        "config": asdict(cfg),
        "spec_fingerprint": spec.fingerprint(),
        "n_holdout_authors": len(holdout),
        "authors_per_forget_split": {f"forget{p:02d}": k for p, k in sizes.items()},
        "attributes": [a["key"] for a in b.attrs],
        "counts": {name: len(rows) for name, rows in world.splits.items()},
    }
    return world


def write_world(world: World, out_dir: str | Path) -> None:
    """Write every split as `<split>.json` (JSON Lines, like the hub), plus the ground truth, atomically."""
    with atomic_dir(out_dir) as tmp:
        for name, rows in world.splits.items():
            write_jsonl(tmp / f"{name}.json", rows)
        write_jsonl(tmp / "annotations.json", world.annotations)
        write_jsonl(tmp / "authors.json", world.authors)
        write_jsonl(tmp / "biographies.json", world.biographies)
        write_json(tmp / "manifest.json", world.manifest)


def world_texts(world_dir: str | Path) -> Iterator[str]:
    """Every string of a written world (splits and biographies), for training a tokenizer on it."""
    from pipeline.data.tofu import read_json_records

    for path in sorted(Path(world_dir).glob("*.json")):
        if path.name in ("manifest.json", "annotations.json", "authors.json"):
            continue
        for row in read_json_records(path):
            for value in row.values():
                if isinstance(value, str):
                    yield value
                elif isinstance(value, list):
                    yield from (v for v in value if isinstance(v, str))
