"""The embedded world's forget and world-facts multiple-choice sets as WMDP-format JSON Lines (and the forget set's
questions with a stem, for cloze scoring), the files both the
project's scorer (`format: wmdp`) and lm-eval's task YAMLs in `tasks/` read, so the two score the same items.

    python experiments/lmeval/export_world_mc.py --world artifacts/paper/world --out artifacts/lmeval/items
"""

from __future__ import annotations

import logging
from pathlib import Path

import click

from pipeline.common.errors import DataError
from pipeline.data.tofu import read_json_records
from pipeline.data.wmdp import write_wmdp_json
from pipeline.data.world_mc import world_mc_sets

log = logging.getLogger(__name__)


def _fact_span_error(span, answer: str) -> str | None:
    """What is wrong with one `[start, end]` of `answer_fact_spans`, or None."""
    if not (isinstance(span, list) and len(span) == 2 and all(type(x) is int for x in span)):
        return f"{span!r} is not a pair [start, end] of character offsets"
    if not 0 <= span[0] < span[1] <= len(answer):
        return f"{span!r} is not a span of the answer (0 to {len(answer)} characters)"
    return None


def check_annotations(world: Path) -> None:
    """The fields of the world's annotations.json that the MC sets read, row by row: each author question's text,
    answer and fact spans. The sets' own checks name a split's bad row; a bad annotation would reach them only as
    a question with no fact, or a fact that is not one."""
    path = world / "annotations.json"
    if not path.exists():
        return  # world_mc_sets says which file the sets need
    for i, row in enumerate(read_json_records(path), start=1):
        if not isinstance(row, dict):
            raise DataError(f"{path}: row {i}: a {type(row).__name__}, not a mapping (question, answer, author, ...)")
        if not row.get("author"):
            continue  # not an author's question: the sets do not read it
        for field in ("author", "question", "answer", "answer_fact_spans"):
            if field not in row:
                raise DataError(f"{path}: row {i}: missing field '{field}'")
        for field in ("author", "question", "answer"):
            if not isinstance(row[field], str):
                raise DataError(f"{path}: row {i}: field '{field}' must be a string, got {type(row[field]).__name__}")
        spans = row["answer_fact_spans"]
        if not isinstance(spans, list) or not spans:
            raise DataError(f"{path}: row {i}: field 'answer_fact_spans' must be a non-empty list of [start, end] "
                            f"pairs, got {spans!r}")
        wrong = next((e for e in (_fact_span_error(s, row["answer"]) for s in spans) if e), None)
        if wrong:
            raise DataError(f"{path}: row {i}: field 'answer_fact_spans': {wrong}")


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--world", type=click.Path(exists=True, file_okay=False, path_type=Path), required=True,
              help="A generated world (artifacts/paper/world).")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Directory for forget.jsonl, world_facts.jsonl and forget_cloze.jsonl.")
@click.option("--split", default="forget10", show_default=True, help="The forget split whose authors are asked.")
def main(world: Path, out: Path, split: str) -> None:
    """Write the world's `forget` and `world_facts` MC sets (choice order as the evaluation's, seed 0), and the
    forget questions with a stem for cloze scoring."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    check_annotations(world)
    sets = world_mc_sets(world, split)
    out.mkdir(parents=True, exist_ok=True)
    # cloze: the forget questions whose answer has text before the fact (the stem), each choice its continuation
    sets["forget_cloze"] = [item for item in sets["forget"] if item.stem.strip() and item.stem[-1].isspace()]
    for name in ("forget", "world_facts", "forget_cloze"):
        write_wmdp_json(sets[name], out / f"{name}.jsonl")
        log.info("%s: %d items", out / f"{name}.jsonl", len(sets[name]))


if __name__ == "__main__":
    from pipeline.common.cli_errors import run_script  # the CLI's error handling: one line, an exit status, -v for a traceback
    run_script(main)
