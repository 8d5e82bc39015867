"""Where timings go. Wall-clock seconds and throughput differ on every run, so they stay out of the outputs DVC
hashes into dvc.lock: a rerun of the same code and params then changes no tracked file, and `git status` stays
clean. They go to an untracked log instead, `artifacts/logs/timing/` mirroring the output they belong to
(`artifacts/plots/unlearn/npo/seed0.csv` -> `artifacts/logs/timing/plots/unlearn/npo/seed0.csv`); an output
elsewhere (a trial's `--out /tmp/run`) keeps its timings beside it (`seed0.timing.csv`). An output directory's
timings go beside it, never in it (`artifacts/eval/npo` -> `artifacts/logs/timing/eval/npo.json`), so that the
directory's atomic replacement never removes them."""

from __future__ import annotations

from pathlib import Path

from pipeline.common.atomic import write_json

TIMING_KEYS = ("step_seconds", "tokens_per_second", "eval_seconds")  # a history row's timings
LOG_ROOT = Path("artifacts", "logs", "timing")


def timing_path(output: str | Path) -> Path:
    """The untracked file for the timings of `output` (a file path; its suffix is kept)."""
    path = Path(output)
    if not path.is_absolute() and path.parts[:1] == ("artifacts",) and path.parts[1:2] != ("logs",):
        return LOG_ROOT.joinpath(*path.parts[1:])
    return path.with_name(f"{path.stem}.timing{path.suffix}")


def split_timings(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """History rows -> (rows without timings, `step` and the timings of the rows that have any)."""
    kept = [{k: v for k, v in row.items() if k not in TIMING_KEYS} for row in rows]
    timed = [{"step": row.get("step"), **{k: row[k] for k in TIMING_KEYS if k in row}}
             for row in rows if any(k in row for k in TIMING_KEYS)]
    return kept, timed


def write_seconds(output_dir: str | Path, seconds: float) -> Path:
    """Record how long making `output_dir` took, beside it (see the module); returns the file."""
    file = timing_path(Path(f"{output_dir}.json"))
    write_json(file, {"seconds": round(seconds, 1)})
    return file
