"""The embedded world's ground truth by question (`annotations.json` beside its splits): where each answer's facts
are. Stage one's quality measures and learned scorer read it, and the sampling attack, which asks whether a sampled
answer says them. A source without the file (real TOFU, a hub name) has none: None."""

from __future__ import annotations

from pathlib import Path

from pipeline.data.tofu import read_json_records


def qa_annotations(source: str) -> dict[str, dict] | None:
    """Ground-truth annotations by question, where the data has them (the embedded world's annotations.json)."""
    path = Path(source) / "annotations.json"
    if not path.is_file():
        return None
    return {a["question"]: a for a in read_json_records(path)}


def fact_spans(annotations: dict[str, dict]) -> dict[str, list]:
    """Each question's answer fact spans, from its annotation."""
    return {q: [tuple(s) for s in a["answer_fact_spans"]] for q, a in annotations.items()}


def qa_facts(source: str) -> dict[str, list] | None:
    """Ground-truth fact spans by question, where the data has them."""
    annotations = qa_annotations(source)
    return fact_spans(annotations) if annotations is not None else None
