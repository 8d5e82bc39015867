"""Every stage on every model family: attribute → unlearn (every method; uniform, hard and soft) → evaluate, on the
micro world with the small random-weight models of tests/families.py.

    python -m tests.family_matrix                 # every family; prints docs/real-models.md's families × stages table
    python -m tests.family_matrix qwen3 gemma2    # some of them

tests/test_families.py runs the same function, one family per test.
"""

from __future__ import annotations

import logging
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from tests.families import FAMILIES, build_family

# The unlearning runs of each family: every method once, each weighting at least once, and RMU under all three.
RUNS = {
    "ga": {"method": "ga", "weighting": "uniform"},
    "t_wga": {"method": "wga", "weighting": "hard"},
    "s_npo": {"method": "npo", "weighting": "soft"},
    "graddiff": {"method": "graddiff", "weighting": "uniform"},
    "rmu": {"method": "rmu", "weighting": "uniform"},
    "t_rmu": {"method": "rmu", "weighting": "hard"},
    "s_rmu": {"method": "rmu", "weighting": "soft"},
    "s_simnpo": {"method": "simnpo", "weighting": "soft"},
    "t_satimp": {"method": "satimp", "weighting": "hard"},
    "ceu": {"method": "ceu", "weighting": "uniform"},          # the whole next-token distribution
    "t_idkdpo": {"method": "idkdpo", "weighting": "hard"},     # the alternative answers of stage one
    "s_altpo": {"method": "altpo", "weighting": "soft"},
    "idknll": {"method": "idknll", "weighting": "uniform"},
    "s_undial": {"method": "undial", "weighting": "soft"},     # θ_o's top-k of stage one
    "t_pdu": {"method": "pdu", "weighting": "hard"},           # a dual variable, θ_o's retain loss measured first
}
STAGES = ("load", "attribute", *(f"unlearn {r}" for r in RUNS), "evaluate")
TRAIN = {"max_steps": 2, "lr": 1e-3, "micro_batch_size": 2, "warmup_ratio": 0.0, "seed": 0}


@dataclass
class Cell:
    ok: bool
    seconds: float
    error: str = ""


def world_texts_of(world_dir: Path) -> list[str]:
    from pipeline.data.world import world_texts

    return list(world_texts(world_dir))


EVAL_SPLITS = ("forget10_perturbed", "retain_perturbed", "real_authors_perturbed", "world_facts_perturbed",
               "world_facts")


def small_eval_world(world_dir: Path, out: Path, rows: int = 6) -> Path:
    """A copy of the world whose evaluation splits keep their first `rows` rows: evaluation runs every code path
    of a family in seconds (the general-knowledge sets are the micro world's largest)."""
    import shutil

    shutil.copytree(world_dir, out)
    for split in EVAL_SPLITS:
        path = out / f"{split}.json"
        path.write_text("".join(path.read_text().splitlines(keepends=True)[:rows]))
    return out


def run_family(name: str, world_dir: Path, work: Path, texts: list[str] | None = None) -> dict[str, Cell]:
    """Run every stage for family `name` in `work`; a failed stage is recorded, and the stages after it that need
    its output are recorded as not run."""
    from pipeline.attribution.run import AttributionConfig, run_attribution
    from pipeline.common.modeling import load_model, load_tokenizer
    from pipeline.data.config import DataConfig
    from pipeline.evaluation.config import EvalConfig
    from pipeline.evaluation.evaluate import evaluate_path
    from pipeline.training.engine import TrainConfig
    from pipeline.training.unlearn import UnlearnConfig, run_unlearn

    family = FAMILIES[name]
    data = DataConfig(source=str(world_dir), template=family.template, max_length=256)
    model_dir, shards = work / "model", work / "attribution"
    cells: dict[str, Cell] = {}

    def stage(key: str, fn, needs: tuple[str, ...] = ()) -> None:
        if any(not cells[n].ok for n in needs):
            cells[key] = Cell(False, 0.0, f"not run: needs {', '.join(n for n in needs if not cells[n].ok)}")
            return
        start = time.perf_counter()
        try:
            fn()
            cells[key] = Cell(True, time.perf_counter() - start)
        except Exception as e:  # recorded, and shown by the test that reads the cell
            cells[key] = Cell(False, time.perf_counter() - start,
                              f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-4)}")

    def load():
        build_family(name, texts if texts is not None else world_texts_of(world_dir), model_dir)
        load_tokenizer(model_dir)
        load_model(model_dir)

    stage("load", load)
    stage("attribute", lambda: run_attribution(
        AttributionConfig(model=str(model_dir), split="forget10", tagger="spacy", batch_size=4, rows_per_shard=4,
                          alternatives=["idk", "perturbed"], teacher_top_k=8),  # what every method reads
        data, shards, None), ("load",))
    for run, spec in RUNS.items():
        def unlearn(run=run, spec=spec):
            cfg = UnlearnConfig.from_params({**spec, "rmu_layer": 2, "rmu_update_layers": [0, 1]}, f"runs.{run}")
            run_unlearn(run, cfg, TrainConfig.from_params(TRAIN, "train"), data, str(model_dir), shards,
                        work / "unlearn" / run, work / "ckpt" / run, work / "plots" / f"{run}.csv", resume=False)
        stage(f"unlearn {run}", unlearn, ("attribute",))

    def evaluate():
        small = small_eval_world(world_dir, work / "eval_world")
        cfg = EvalConfig.from_params({"source": str(small), "template": family.template, "max_new_tokens": 8,
                                      "batch_size": 16, "multiple_choice": {"world": {
                                          "format": "world", "source": str(small), "scoring": "cloze"}}},
                                     "evaluate")
        retain = work / "eval" / "target"
        evaluate_path(str(model_dir), cfg, retain, retain)                  # the retain role: FQ against itself
        evaluate_path(str(work / "unlearn" / "t_wga" / "model"), cfg, work / "eval" / "t_wga", retain)
    stage("evaluate", evaluate, ("load", "unlearn t_wga"))
    return cells


def markdown_table(results: dict[str, dict[str, Cell]]) -> str:
    """Families × stages: ✓ passed, ✗ failed; the family's config class, tokenizer behaviour and template."""
    header = "| family | config class | tokenizer, template | " + " | ".join(STAGES) + " |"
    lines = [header, "|" + " --- |" * (len(STAGES) + 3)]
    for name, cells in results.items():
        family = FAMILIES[name]
        template = family.template if isinstance(family.template, str) else "custom"
        marks = [("✓" if cells[s].ok else "✗") for s in STAGES]
        lines.append(f"| {name} | {family.config_class} | {family.style}, `{template}` | " + " | ".join(marks) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING)
    from pipeline.data.world import WorldConfig, WorldSpec, generate_world, write_world

    from tests.conftest import MICRO_WORLD, REPO

    names = argv or list(FAMILIES)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        world_dir = Path(tmp) / "world"
        write_world(generate_world(WorldSpec.load(REPO / "data" / "world"), WorldConfig(**MICRO_WORLD)), world_dir)
        texts = world_texts_of(world_dir)
        for name in names:
            start = time.perf_counter()
            results[name] = run_family(name, world_dir, Path(tmp) / name, texts)
            failed = {k: c.error.splitlines()[0] for k, c in results[name].items() if not c.ok}
            print(f"{name}: {time.perf_counter() - start:.1f} s, {'all stages pass' if not failed else failed}",
                  file=sys.stderr)
    print(markdown_table(results))
    return 0 if all(c.ok for cells in results.values() for c in cells.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
