"""The layout of an unlearning run's directory, written by training and read by evaluation:

    RUN/seed{S}/model/            the unlearned model of seed S (safetensors)
    RUN/seed{S}/run.json          which run and params made it, written with the model (atomically)
    RUN/complete.json             written last, once every seed of the run is done: the seeds, and their params'
                                  fingerprints
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from pipeline.common.errors import DataError

SEED_RECORD = "run.json"
COMPLETE_RECORD = "complete.json"


def seed_dir(run_dir: Path, seed: int) -> Path:
    return Path(run_dir) / f"seed{seed}"


def finished_seeds(run_dir: Path) -> list[int]:
    """The seeds whose model was written, whether or not the run is complete."""
    found = []
    for d in Path(run_dir).glob("seed*"):
        m = re.fullmatch(r"seed(\d+)", d.name)
        if m and (d / SEED_RECORD).is_file() and (d / "model").is_dir():
            found.append(int(m.group(1)))
    return sorted(found)


def is_run_dir(path: Path) -> bool:
    """An unlearning run's directory (seed directories or a completion record), not a model directory."""
    path = Path(path)
    return path.is_dir() and not (path / "config.json").is_file() and (
        (path / COMPLETE_RECORD).is_file() or any(re.fullmatch(r"seed\d+", d.name) for d in path.iterdir()))


def complete_seeds(run_dir: Path, name: str = "NAME") -> dict[int, Path]:
    """{seed: model directory} of a complete run; a run without its completion record (killed, or still running)
    is an error naming what is missing."""
    run_dir = Path(run_dir)
    record = run_dir / COMPLETE_RECORD
    if not record.is_file():
        done = finished_seeds(run_dir)
        raise DataError(f"{run_dir}: the unlearning run is incomplete (no {COMPLETE_RECORD}; seeds finished: "
                        f"{done or 'none'}): finish it with `tokenunlearn unlearn {name}` (finished seeds are skipped)")
    try:
        seeds = json.loads(record.read_text())["seeds"]
    except (ValueError, KeyError) as e:
        raise DataError(f"{record}: malformed ({e}); rerun `tokenunlearn unlearn {name}`") from None
    models = {int(s): seed_dir(run_dir, s) / "model" for s in seeds}
    missing = [s for s, m in models.items() if not m.is_dir()]
    if missing:
        raise DataError(f"{run_dir}: {COMPLETE_RECORD} lists seeds {missing} whose model is missing; rerun "
                        f"`tokenunlearn unlearn {name}`")
    return models
