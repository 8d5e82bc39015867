"""A user's own forget and retain data (and an optional holdout set), checked together and written as the splits
the existing loaders read.

`write_splits` reads `data.forget`, `data.retain` and `data.holdout` (pipeline/data/own_files.py reads each file),
checks them across files (no question twice in the forget or holdout set, none in two sets) and in tokens, and
writes `forget.json`, `retain.json`, `holdout.json` (JSON Lines of {question, answer}, what `tofu.load_split`
reads) or, for passages, `forget_corpus.jsonl`, `retain_corpus.jsonl`, `holdout_corpus.jsonl` ({text}), with a
manifest of what was read.

A passage request is evaluated on verbatim memorization: each passage is cut once, at the sentence boundary nearest
its middle (a one-sentence passage at the space nearest it), and its first part prompts its rest, so the QA
evaluation's probes (extraction strength, exact memorization, ROUGE-L, probability, sampling, membership inference)
read the rest as the "answer" (`passage_probe`; the probes go to `forget.json` etc. beside the corpora, read with
the `passage` template: no tags, so prompt and answer are the passage's own text), as MUSE's VerbMem prompts with a
passage's first part. The probe adds an end-of-text token after the passage, which corpus training never sees.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from pathlib import Path
from typing import Iterator

from pipeline.common.atomic import atomic_dir, write_json, write_jsonl
from pipeline.common.errors import DataError, ParamError
from pipeline.data.config import DataConfig
from pipeline.data.own_files import SETS, DataFile, is_set, read_file, read_records, short
from pipeline.data.templates import encode_qa, encode_text, get_template

__all__ = ["DataFile", "read_records", "data_files", "check_unique", "check_disjoint", "check_lengths",
           "passage_probe", "write_splits"]

log = logging.getLogger(__name__)

OUTPUTS = {"qa": "{name}.json", "text": "{name}_corpus.jsonl"}
PROBES = "{name}.json"           # a passage set's probes: {question: its first part, answer: its rest}
SENTENCE_BOUNDARY = re.compile(r"(?<=[.!?])\s+")
KINDS = {"qa": "question-answer pairs", "text": "passages"}
WRITTEN_BY = "tokenunlearn own-data"  # the manifest's mark: only a directory carrying it is ever replaced


def data_files(cfg: DataConfig) -> dict[str, DataFile]:
    """The files `data.forget`, `data.retain` and `data.holdout` name (those set); an error unless forget and
    retain are both set."""
    given = {name: getattr(cfg, name) for name in SETS if is_set(getattr(cfg, name))}
    if "forget" not in given or "retain" not in given:
        missing = [f"data.{n}" for n in ("forget", "retain") if n not in given]
        raise ParamError(f"{' and '.join(missing)}: not set; your own data is a file of what to forget "
                         "(data.forget) and a file of what to keep (data.retain), each a path or {path, fields}")
    return {name: DataFile.from_params(value, f"data.{name}") for name, value in given.items()}


# ---- checks across rows and files ------------------------------------------------------------------------------

def _same(text: str) -> str:
    """Two questions (or passages) are the same when they differ only in case and spacing."""
    return " ".join(text.split()).casefold()


def _key_field(kind: str) -> str:
    return "text" if kind == "text" else "question"


def check_unique(records: list[dict], kind: str, where: str) -> None:
    """No question (passage) twice: a forget or holdout set counts each once."""
    name, first = _key_field(kind), {}
    for i, row in enumerate(records, start=1):
        seen = first.setdefault(_same(row[name]), i)
        if seen != i:
            raise DataError(f"{where}: row {i} repeats the {name} of row {seen} ({short(row[name])}); remove one of "
                            "them")


def check_disjoint(a: list[dict], where_a: str, b: list[dict], where_b: str, kind: str, why: str) -> None:
    """No question (passage) in both `a` and `b`."""
    name = _key_field(kind)
    rows = {}
    for i, row in enumerate(a, start=1):
        rows.setdefault(_same(row[name]), i)
    for j, row in enumerate(b, start=1):
        i = rows.get(_same(row[name]))
        if i is not None:
            raise DataError(f"{where_a} row {i} and {where_b} row {j}: the same {name} ({short(row[name])}); {why}")


def check_lengths(records: list[dict], tokenizer, template, max_length: int, where: str,
                  skip_too_long: bool = False) -> tuple[list[dict], list[int]]:
    """The records whose encoded sample (prompt and answer as training encodes them, or the passage) fits
    `max_length`, and the rows (1-based) skipped; a longer one is an error naming its row and token count, unless
    `skip_too_long`. Each row is tokenized once."""
    kept, skipped = [], []
    with _quiet_logger("transformers.tokenization_utils_base"):  # its "longer than the maximum": ours names the row
        for i, row in enumerate(records, start=1):
            sample = encode_text(tokenizer, row["text"]) if "text" in row else \
                encode_qa(tokenizer, template, row["question"], row["answer"])
            if len(sample) <= max_length:
                kept.append(row)
            elif skip_too_long:
                skipped.append(i)
            else:
                what = "the passage" if "text" in row else "prompt and answer"
                raise DataError(f"{where}: row {i}: {len(sample)} tokens ({what}) exceed data.max_length="
                                f"{max_length}; shorten it, raise data.max_length, or set data.skip_too_long: true "
                                "to skip and count such rows")
    return kept, skipped


@contextlib.contextmanager
def _quiet_logger(name: str) -> Iterator[None]:
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def passage_probe(text: str, where: str) -> dict:
    """A passage as a verbatim probe: {question: its text up to the cut, answer: the rest}, so that question +
    answer is the passage itself (trailing whitespace aside). The cut is the sentence end nearest the middle when
    one lies in the middle third of the passage (an abbreviation near the start does not pull it there), else the
    whitespace nearest the middle. The whitespace goes with the answer (" word", a token of its own in byte-level
    BPE) unless it holds a line break, which stays with the prompt (tokenizers merge ".\n\n"). A passage with no
    whitespace inside cannot be probed."""
    body = text.rstrip()
    middle, third = len(body) / 2, len(body) / 6

    def cut_at(m: re.Match) -> int:
        return m.end() if "\n" in m.group() else m.start()

    ends = [cut_at(m) for m in SENTENCE_BOUNDARY.finditer(body) if abs(m.start() - middle) <= third]
    cuts = ends or [cut_at(m) for m in re.finditer(r"\s+", body) if m.start() > 0]
    if not cuts:
        raise DataError(f"{where}: a passage of one word ({short(text)}): its first part prompts its rest in the "
                        "evaluation, so it needs at least two words; make it longer or remove it")
    cut = min(cuts, key=lambda c: (abs(c - middle), c))
    return {"question": body[:cut], "answer": body[cut:]}


# ---- writing ---------------------------------------------------------------------------------------------------

def _check_replaceable(out_dir: Path) -> None:
    """The output replaces `out_dir` whole: refuse a directory this command did not write (data.source left at
    the embedded world's directory, say)."""
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise DataError(f"{out_dir}: a file, not a directory; write your data to a new directory (data.source, or "
                        "--out)")
    if not any(out_dir.iterdir()):
        return
    try:
        mark = json.loads((out_dir / "manifest.json").read_text(encoding="utf-8")).get("written_by")
    except (OSError, ValueError, AttributeError):
        mark = None
    if mark != WRITTEN_BY:
        raise DataError(f"{out_dir}: a directory that own-data did not write (no own-data manifest.json in it), "
                        "which writing would replace; write your data to a new directory (data.source, or --out)")


def write_splits(cfg: DataConfig, out_dir: str | Path, tokenizer) -> dict:
    """Read and validate `data.forget`, `data.retain` and (if set) `data.holdout`, and write them into `out_dir`
    (atomically, the whole directory) as the loaders' splits with a manifest; returns the manifest."""
    out_dir = Path(out_dir)
    specs = data_files(cfg)
    for name, spec in specs.items():
        if out_dir.resolve() in Path(spec.path).resolve().parents:  # replacing the directory would delete it
            raise DataError(f"{spec.path} (data.{name}): inside the output directory {out_dir}, which is replaced "
                            "whole; keep your files elsewhere, or write to another directory (data.source, or --out)")
    _check_replaceable(out_dir)
    read = {name: read_file(spec, f"data.{name}") for name, spec in specs.items()}
    where = {name: f"{spec.path} (data.{name})" for name, spec in specs.items()}
    forget = read["forget"]
    if "holdout" in read and read["holdout"].spec.kind != forget.spec.kind:
        raise DataError(f"{where['holdout']}: holds {KINDS[read['holdout'].spec.kind]} but data.forget holds "
                        f"{KINDS[forget.spec.kind]}; the holdout set is of the forget set's kind (membership "
                        "inference compares them)")
    if forget.spec.kind == "text" and cfg.template != "passage":  # else its probes would be read as QA pairs
        raise ParamError(f"{where['forget']}: holds passages, and data.template is {cfg.template!r}; a passage request "
                         "reads them in corpus mode and probes them with the passage template: add --overlay "
                         "configs/own-passages.yaml after configs/own-data.yaml")
    if read["retain"].spec.kind != forget.spec.kind:  # one template probes both sets (the passages': no tags)
        raise DataError(f"{where['retain']}: holds {KINDS[read['retain'].spec.kind]} but data.forget holds "
                        f"{KINDS[forget.spec.kind]}; a request is of one kind, since the evaluation probes both sets "
                        "the same way: give what to keep as " + KINDS[forget.spec.kind])
    for name in ("forget", "holdout"):
        if name in read:
            check_unique(read[name].records, read[name].spec.kind, where[name])
    pairs = [("forget", "retain", "remove it from one of them: what is forgotten cannot also be kept"),
             ("forget", "holdout", "remove it from one of them: the holdout set is never unlearned"),
             ("retain", "holdout", "remove it from one of them: the holdout set is never trained on")]
    for a, b, why in pairs:
        if a in read and b in read and read[a].spec.kind == read[b].spec.kind:
            check_disjoint(read[a].records, where[a], read[b].records, where[b], read[a].spec.kind, why)

    template = get_template(cfg.template)
    sets, kept, probes = {}, {}, {}
    for name, r in read.items():
        kept[name], skipped = check_lengths(r.records, tokenizer, template, cfg.max_length, where[name],
                                            cfg.skip_too_long)
        if not kept[name]:
            raise DataError(f"{where[name]}: every row is longer than data.max_length={cfg.max_length}; raise it")
        if skipped:
            log.warning("%s: skipped %d row(s) longer than data.max_length=%d (rows %s)", where[name], len(skipped),
                        cfg.max_length, ", ".join(map(str, skipped[:10])) + (", ..." if len(skipped) > 10 else ""))
        sets[name] = {"path": r.spec.path, "sha256": r.sha256, "fields": r.spec.field_map, "kind": r.spec.kind,
                      "file": OUTPUTS[r.spec.kind].format(name=name), "rows": len(kept[name]),
                      "rows_skipped": len(skipped), "skipped_rows": skipped}
        if r.spec.kind == "text":
            sets[name]["probes"] = PROBES.format(name=name)
            probe = {id(row): passage_probe(row["text"], f"{where[name]}: row {i}")  # the file's row numbers
                     for i, row in enumerate(r.records, start=1)}
            probes[name] = [probe[id(row)] for row in kept[name]]
    manifest = {"written_by": WRITTEN_BY, "schema_version": 1, "max_length": cfg.max_length,
                "skip_too_long": cfg.skip_too_long, "template": cfg.template,
                "tokenizer": str(getattr(tokenizer, "name_or_path", "")), "sets": sets}
    with atomic_dir(out_dir) as tmp:
        for name, s in sets.items():
            write_jsonl(tmp / s["file"], kept[name])
        for name, rows in probes.items():
            write_jsonl(tmp / sets[name]["probes"], rows)
        write_json(tmp / "manifest.json", manifest)
    return manifest
