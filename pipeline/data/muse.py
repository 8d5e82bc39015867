"""MUSE (Shi et al., 2024, "MUSE: Machine Unlearning Six-Way Evaluation for Language Models") in its published
layout: read it from the hub or a local copy, and write the embedded world in the same layout.

The hub's `muse-bench/MUSE-News` and `muse-bench/MUSE-Books` are one config per folder, one Parquet file per split
(`{config}/{split}-00000-of-00001.parquet`; the card's `configs:` maps each split to `{config}/{split}-*`), as
`huggingface-cli download NAME --repo-type dataset --local-dir DIR` writes them to DIR:

  raw       forget, retain1, retain2, holdout   text              the corpora
  knowmem   forget_qa, retain_qa,               question, answer  100 questions on forget and on retain2, and
            forget_qa_icl, retain_qa_icl                          10 in-context examples each
  verbmem   forget                              prompt, gt        100 forget excerpts and their continuations
  privleak  forget, retain, holdout             text              100 texts each, for the membership AUC
  train     forget, retain1, retain2            text              (News only: scal and sust, forget_1 .. forget_4)

retain1 is the retain set unlearning trains on (open-unlearning's MUSE_retain); retain2 the one knowmem and privleak
ask about (the hub's first revisions named those splits retain2_qa and retain2).

Every row is validated: a missing field, a null, a non-string or an empty string is one `DataError` naming the
file (or `NAME[config/split]` on the hub), the 1-based row and the field.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from pipeline.common.atomic import atomic_dir
from pipeline.common.errors import DataError, ParamError
from pipeline.common.paths import is_hub_name

log = logging.getLogger(__name__)

HUB_DATASETS = ("muse-bench/MUSE-News", "muse-bench/MUSE-Books")

# The fields of each config's rows, in the hub's column order.
FIELDS: dict[str, tuple[str, ...]] = {
    "raw": ("text",), "train": ("text",), "privleak": ("text",), "scal": ("text",), "sust": ("text",),
    "knowmem": ("question", "answer"), "verbmem": ("prompt", "gt"),
}
# The splits the evaluation reads and the embedded world writes (MUSE's own names).
EVAL_SPLITS: dict[str, tuple[str, ...]] = {
    "raw": ("forget", "retain1", "retain2", "holdout"),
    "knowmem": ("forget_qa", "retain_qa", "forget_qa_icl", "retain_qa_icl"),
    "verbmem": ("forget",),
    "privleak": ("forget", "retain", "holdout"),
}
SHARD = re.compile(r"(?P<split>[A-Za-z0-9_]+)-\d{5}-of-\d{5}\.parquet")


@dataclass(frozen=True)
class QAPair:
    """A knowmem question and its gold answer."""

    question: str
    answer: str


@dataclass(frozen=True)
class VerbmemItem:
    """A verbmem forget excerpt (`prompt`) and its true continuation (`gt`)."""

    prompt: str
    gt: str


@dataclass
class MuseEvalSets:
    """What MUSE's four metrics read, loaded and validated before any model is."""

    source: str
    verbmem: list[VerbmemItem]
    knowmem_forget: list[QAPair]
    knowmem_forget_icl: list[QAPair]
    knowmem_retain: list[QAPair]
    knowmem_retain_icl: list[QAPair]
    privleak_forget: list[str]
    privleak_holdout: list[str]


# ---- reading ------------------------------------------------------------------------------------------------

def _check_name(kind: str, value: str) -> None:
    if not isinstance(value, str) or not re.fullmatch(r"[A-Za-z0-9_]+", value):
        raise ParamError(f"MUSE {kind} {value!r}: not a name (letters, digits, '_')")


def _validate(rows: Sequence, fields: Sequence[str], where: str, first_row: int = 1) -> list[dict]:
    """Each row an object whose `fields` are non-empty strings; the rows restricted to them."""
    out = []
    for i, row in enumerate(rows, start=first_row):
        if not isinstance(row, dict):
            raise DataError(f"{where}: row {i}: expected an object, got {type(row).__name__}")
        for name in fields:
            if name not in row:
                raise DataError(f"{where}: row {i}: missing field '{name}' (MUSE's rows here have "
                                f"{', '.join(fields)})")
            value = row[name]
            if value is None:
                raise DataError(f"{where}: row {i}: field '{name}' is null")
            if not isinstance(value, str):
                raise DataError(f"{where}: row {i}: field '{name}' must be a string, got {type(value).__name__}")
            if not value.strip():
                raise DataError(f"{where}: row {i}: field '{name}' is empty")
        out.append({name: row[name] for name in fields})
    return out


def _shards(root: Path, config: str, split: str) -> list[Path]:
    """`root/config/split-NNNNN-of-NNNNN.parquet`, in shard order; a clear error naming what is there instead."""
    folder = root / config
    if not folder.is_dir():
        found = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
        raise DataError(f"{root}: no '{config}' folder, so no MUSE config '{config}' (found {found or 'none'}); a "
                        f"local MUSE copy holds {config}/{split}-00000-of-00001.parquet, as the hub's "
                        f"{HUB_DATASETS[0]} does")
    files = sorted(p for p in folder.iterdir() if (m := SHARD.fullmatch(p.name)) and m.group("split") == split)
    if not files:
        found = sorted({m.group("split") for p in folder.iterdir() if (m := SHARD.fullmatch(p.name))})
        raise DataError(f"{folder}: no {split}-NNNNN-of-NNNNN.parquet, so no split '{split}' of config "
                        f"'{config}' (splits found: {found or 'none'})")
    return files


def _read_local(root: Path, config: str, split: str, fields: Sequence[str]) -> list[dict]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows: list[dict] = []
    for file in _shards(root, config, split):
        try:
            table = pq.read_table(file)
        except (OSError, ValueError, pa.ArrowException) as e:
            raise DataError(f"{file}: not a readable Parquet file ({str(e).splitlines()[0] if str(e) else e!r})")
        missing = [f for f in fields if f not in table.column_names]
        if missing:  # a column absent from the file is absent from its first row
            raise DataError(f"{file}: row 1: missing field '{missing[0]}' (the file's columns are "
                            f"{table.column_names}; MUSE's {config} rows have {', '.join(fields)})")
        rows += _validate(table.select(list(fields)).to_pylist(), fields, str(file))
    return rows


def load_rows(source: str | Path, config: str, split: str) -> list[dict]:
    """The validated rows of `config`/`split` of MUSE: a local directory in the hub's layout, or a hub dataset
    (`muse-bench/MUSE-News`, `muse-bench/MUSE-Books`) read through `datasets`."""
    _check_name("config", config)
    _check_name("split", split)
    if config not in FIELDS:
        raise ParamError(f"MUSE config '{config}': unknown (MUSE's configs are {sorted(FIELDS)})")
    fields = FIELDS[config]
    path = Path(source)
    if path.is_dir():
        rows, where = _read_local(path, config, split, fields), f"{path}/{config}/{split}"
    elif path.exists():
        raise DataError(f"MUSE source '{source}': a file, not a directory; give the directory that holds raw/, "
                        f"knowmem/, verbmem/ and privleak/, or a hub dataset name like {HUB_DATASETS[0]}")
    elif is_hub_name(source):
        from pipeline.data.tofu import load_hub_records

        where = f"{source}[{config}/{split}]"
        rows = _validate(load_hub_records(str(source), config, split, f"MUSE {config}/{split}",
                                          f"download it (huggingface-cli download {source} --repo-type dataset "
                                          "--local-dir DIR) and give DIR instead."), fields, where)
    else:
        raise DataError(f"MUSE source '{source}': no such directory (and not a hub dataset name like "
                        f"{HUB_DATASETS[0]})")
    if not rows:
        raise DataError(f"{where}: no rows")
    log.debug("loaded %d rows of MUSE %s/%s from %s", len(rows), config, split, source)
    return rows


def load_texts(source: str | Path, config: str, split: str) -> list[str]:
    """A text config's split (raw, privleak, train, scal, sust) as its texts."""
    if FIELDS.get(config) != ("text",):
        raise ParamError(f"MUSE config '{config}' is not a text corpus (those are "
                         f"{sorted(c for c, f in FIELDS.items() if f == ('text',))})")
    return [r["text"] for r in load_rows(source, config, split)]


def load_qa(source: str | Path, split: str) -> list[QAPair]:
    """A knowmem split (forget_qa, retain_qa, forget_qa_icl, retain_qa_icl) as question-answer pairs."""
    return [QAPair(r["question"], r["answer"]) for r in load_rows(source, "knowmem", split)]


def load_verbmem(source: str | Path, split: str = "forget") -> list[VerbmemItem]:
    """The verbmem excerpts and their continuations."""
    return [VerbmemItem(r["prompt"], r["gt"]) for r in load_rows(source, "verbmem", split)]


def load_eval_sets(source: str | Path) -> MuseEvalSets:
    """Everything VerbMem, KnowMem (forget, retain) and PrivLeak read."""
    return MuseEvalSets(
        source=str(source), verbmem=load_verbmem(source),
        knowmem_forget=load_qa(source, "forget_qa"), knowmem_forget_icl=load_qa(source, "forget_qa_icl"),
        knowmem_retain=load_qa(source, "retain_qa"), knowmem_retain_icl=load_qa(source, "retain_qa_icl"),
        privleak_forget=load_texts(source, "privleak", "forget"),
        privleak_holdout=load_texts(source, "privleak", "holdout"))


# ---- writing ------------------------------------------------------------------------------------------------

Tables = dict[tuple[str, str], list[dict]]  # (config, split) -> rows


def _card(tables: Tables, about: str) -> str:
    """The dataset card: the hub's `configs:` front matter, so `datasets.load_dataset(DIR, config)` reads it too."""
    lines = ["---", "configs:"]
    for config in dict.fromkeys(c for c, _ in tables):
        lines += [f"- config_name: {config}", "  data_files:"]
        for c, split in tables:
            if c == config:
                lines += [f"  - split: {split}", f"    path: {config}/{split}-*"]
    return "\n".join([*lines, "---", "", about.strip(), ""])


def write_muse_dir(tables: Tables, out_dir: str | Path, about: str) -> None:
    """Write `tables` in the hub's layout (one Parquet file per split, the card's `configs:`), atomically."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    with atomic_dir(out_dir) as tmp:
        for (config, split), rows in tables.items():
            fields = FIELDS[config]
            _validate(rows, fields, f"MUSE {config}/{split} (to write)")
            (tmp / config).mkdir(exist_ok=True)
            columns = {f: pa.array([r[f] for r in rows], pa.string()) for f in fields}
            pq.write_table(pa.table(columns), tmp / config / f"{split}-00000-of-00001.parquet")
        (tmp / "README.md").write_text(_card(tables, about), encoding="utf-8")


# ---- the embedded world in MUSE's shape -----------------------------------------------------------------------

SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def verbmem_item(passage: str) -> VerbmemItem | None:
    """A passage cut at the sentence boundary nearest its middle (the first half of its sentences, at least one,
    as the prompt; the rest as the continuation, MUSE's `gt`); None for a passage of one sentence."""
    sentences = SENTENCE_END.split(passage.strip())
    if len(sentences) < 2:
        return None
    cut = len(sentences) // 2
    return VerbmemItem(" ".join(sentences[:cut]), " ".join(sentences[cut:]))


def _world_records(world_dir: Path) -> tuple[list[dict], list[dict]]:
    from pipeline.data.tofu import read_json_records

    bios = _checked(read_json_records(world_dir / "biographies.json"), world_dir / "biographies.json",
                    {"author": str, "group": str, "forget_splits": list, "text": str})
    notes = _checked(read_json_records(world_dir / "annotations.json"), world_dir / "annotations.json",
                     {"question": str, "answer": str})
    return bios, notes


def _checked(rows: list, file: Path, fields: dict[str, type]) -> list[dict]:
    for i, row in enumerate(rows, start=1):
        for name, kind in fields.items():
            if not isinstance(row, dict) or not isinstance(row.get(name), kind):
                raise DataError(f"{file}: row {i}: field '{name}' must be a {kind.__name__} (a world written by "
                                "`tokenunlearn make-world`)")
    return rows


PARTS = ("forget", "retain1", "retain2", "holdout")  # MUSE's raw corpora


def world_parts(world_dir: str | Path, forget_split: str = "forget10") -> tuple[dict[str, list[dict]], list[dict]]:
    """Whose biography is in which of MUSE's corpora (`PARTS`, each a list of the world's biography records, in the
    world's order), and the world's question annotations. forget: `forget_split`'s authors; retain1 / retain2:
    the other trained authors, first half / second half; holdout: the authors no model is trained on."""
    world_dir = Path(world_dir)
    bios, notes = _world_records(world_dir)
    trained = [b for b in bios if b["group"] == "trained"]
    forget = [b for b in trained if forget_split in b["forget_splits"]]
    retain = [b for b in trained if forget_split not in b["forget_splits"]]
    holdout = [b for b in bios if b["group"] == "holdout"]
    if not forget:
        splits = sorted({s for b in trained for s in b["forget_splits"]})
        raise ParamError(f"forget split '{forget_split}': no author of {world_dir} is in it (its forget splits: "
                         f"{splits})")
    if len(retain) < 2 or not holdout:
        raise DataError(f"{world_dir}: MUSE needs two retain halves and holdout authors; this world has "
                        f"{len(retain)} retain and {len(holdout)} holdout authors")
    retain1, retain2 = retain[: len(retain) // 2], retain[len(retain) // 2:]
    return dict(zip(PARTS, (forget, retain1, retain2, holdout))), notes


def author_questions(notes: list[dict], authors: list[dict]) -> list[dict]:
    """The fact questions (question, answer) of `authors` (biography records), in the annotations' order."""
    names = {a["author"] for a in authors}
    return [{"question": n["question"], "answer": n["answer"]} for n in notes if n.get("author") in names]


def world_as_muse(world_dir: str | Path, forget_split: str = "forget10", n_icl: int = 1) -> tuple[Tables, dict]:
    """The embedded world (the directory `make-world` writes) as MUSE's tables, and a summary of who is where.

    forget: the biographies of `forget_split`'s authors; retain1 / retain2: the other trained authors' biographies,
    first half / second half (as MUSE: unlearning's retain set / the retain set knowmem asks about); holdout:
    the world's holdout authors, whom no model is trained on. knowmem: the fact questions of the forget authors,
    and as many of the retain2 authors' (MUSE: 100 and 100); the in-context examples are `n_icl` questions each of
    retain1 authors, never asked and never forgotten. verbmem: each forget biography's first half of sentences and
    the rest. privleak: the forget, retain2 and holdout biographies."""
    world_dir = Path(world_dir)
    if n_icl < 1:
        raise ParamError(f"n_icl={n_icl}: MUSE's knowmem prompts have in-context examples; give at least 1")
    parts, notes = world_parts(world_dir, forget_split)
    forget, retain1, retain2, holdout = (parts[p] for p in PARTS)
    qa = lambda authors: author_questions(notes, authors)  # noqa: E731
    forget_qa, shots = qa(forget), qa(retain1)
    if len(shots) < 2 * n_icl:
        raise ParamError(f"n_icl={n_icl}: the retain1 authors of {world_dir} have {len(shots)} questions, fewer "
                         f"than the {2 * n_icl} in-context examples (forget and retain); lower n_icl")
    verbmem = [v for v in map(verbmem_item, (b["text"] for b in forget)) if v is not None]
    if not verbmem:
        raise DataError(f"{world_dir}: the forget biographies are single sentences, so verbmem has no continuation "
                        "to ask for (make the world with questions_per_author of at least 2)")
    texts = lambda authors: [{"text": a["text"]} for a in authors]  # noqa: E731
    tables: Tables = {
        ("raw", "forget"): texts(forget), ("raw", "retain1"): texts(retain1),
        ("raw", "retain2"): texts(retain2), ("raw", "holdout"): texts(holdout),
        ("knowmem", "forget_qa"): forget_qa, ("knowmem", "retain_qa"): qa(retain2)[: len(forget_qa)],
        ("knowmem", "forget_qa_icl"): shots[:n_icl], ("knowmem", "retain_qa_icl"): shots[n_icl: 2 * n_icl],
        ("verbmem", "forget"): [{"prompt": v.prompt, "gt": v.gt} for v in verbmem],
        ("privleak", "forget"): texts(forget), ("privleak", "retain"): texts(retain2),
        ("privleak", "holdout"): texts(holdout),
    }
    summary = {"forget_split": forget_split, "n_icl": n_icl,
               "authors": {"forget": [a["author"] for a in forget], "retain1": [a["author"] for a in retain1],
                           "retain2": [a["author"] for a in retain2], "holdout": [a["author"] for a in holdout]},
               "counts": {f"{c}/{s}": len(rows) for (c, s), rows in tables.items()}}
    return tables, summary


def write_world_as_muse(world_dir: str | Path, out_dir: str | Path, forget_split: str = "forget10",
                        n_icl: int = 1) -> dict:
    """`world_as_muse`, written in MUSE's layout to `out_dir` (atomically); returns its summary."""
    tables, summary = world_as_muse(world_dir, forget_split, n_icl)
    authors = summary["authors"]
    about = (f"The embedded fictitious world of {world_dir} in MUSE's layout (forget split {forget_split}).\n\n"
             + "\n".join(f"- {part}: {', '.join(names)}" for part, names in authors.items()) + "\n")
    write_muse_dir(tables, out_dir, about)
    return summary
