"""The embedded world's forget and world-facts multiple-choice sets as WMDP-format JSON Lines (and the forget set's
questions with a stem, for cloze scoring), the files both the
project's scorer (`format: wmdp`) and lm-eval's task YAMLs in `tasks/` read, so the two score the same items.

    python experiments/lmeval/export_world_mc.py --world artifacts/paper/world --out artifacts/lmeval/items
"""

from __future__ import annotations

import logging
from pathlib import Path

import click

from pipeline.data.wmdp import write_wmdp_json
from pipeline.data.world_mc import world_mc_sets

log = logging.getLogger(__name__)


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
    sets = world_mc_sets(world, split)
    out.mkdir(parents=True, exist_ok=True)
    # cloze: the forget questions whose answer has text before the fact (the stem), each choice its continuation
    sets["forget_cloze"] = [item for item in sets["forget"] if item.stem.strip() and item.stem[-1].isspace()]
    for name in ("forget", "world_facts", "forget_cloze"):
        write_wmdp_json(sets[name], out / f"{name}.jsonl")
        log.info("%s: %d items", out / f"{name}.jsonl", len(sets[name]))


if __name__ == "__main__":
    main()
