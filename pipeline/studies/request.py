"""What a user gets back from a forget request: the unlearned model in `save_pretrained` layout with a model card,
and a per-item table of each forget question (and a sample of the retain ones) before and after unlearning.

The table joins two evaluations of the same split (the model before, the model after) item by item: the greedy
answer, its probability and whether it still comes out. "Comes out" is strict: the greedy answer holds the whole
reference answer (case and runs of whitespace aside). ROUGE-L recall is beside it, since a template-shaped wrong
answer ("… was born in Karvost") reaches a recall of 0.7 with the fact itself gone.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline import __version__
from pipeline.common.atomic import atomic_dir
from pipeline.common.errors import DataError
from pipeline.evaluation.tofu_sets import has_greedy_answers

log = logging.getLogger(__name__)

MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
               "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
               "merges.txt", "adapter_config.json", "adapter_model.safetensors")
COLUMNS = ("question", "answer", "before", "after", "probability_before", "probability_after", "rouge_l_before",
           "rouge_l_after", "comes_out_before", "comes_out_after")


def _normal(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def comes_out(generated: str, answer: str) -> bool:
    """The greedy answer holds the whole reference answer (case and whitespace aside)."""
    return _normal(answer) in _normal(generated)


def _items(eval_dir: Path, name: str) -> list[dict]:
    file = Path(eval_dir) / "items" / f"{name}.parquet"
    if not file.is_file():
        raise DataError(f"{file}: no per-item results of the {name} set; evaluate the model with "
                        f"evaluate.tofu_sets holding {name} (`tokenunlearn evaluate`)")
    items = pq.read_table(file).to_pylist()
    if items and not has_greedy_answers(items[0]):
        raise DataError(f"{file}: no greedy answers (an evaluation with evaluate.forget_rouge: false); evaluate the "
                        "model with it true")
    return items


def before_after(before_dir: str | Path, after_dir: str | Path, name: str = "forget") -> list[dict]:
    """Set `name`'s items of two evaluations, joined by index: each question's answer before and after."""
    before, after = _items(Path(before_dir), name), _items(Path(after_dir), name)
    by_index = {it["index"]: it for it in after}
    if sorted(by_index) != sorted(it["index"] for it in before) or any(
            by_index[it["index"]]["ground_truth"] != it["ground_truth"] for it in before):
        raise DataError(f"{before_dir} and {after_dir}: the {name} sets differ (other questions or answers); "
                        "evaluate both models on the same data")
    rows = []
    for b in sorted(before, key=lambda it: it["index"]):
        a = by_index[b["index"]]
        answer = b.get("answer") or b["ground_truth"]
        rows.append({"question": b.get("question") or b["prompt"].strip(), "answer": answer,
                     "before": b["generated"], "after": a["generated"],
                     "probability_before": b["answer_probability"], "probability_after": a["answer_probability"],
                     "rouge_l_before": b["rouge_l_recall"], "rouge_l_after": a["rouge_l_recall"],
                     "comes_out_before": comes_out(b["generated"], answer),
                     "comes_out_after": comes_out(a["generated"], answer)})
    return rows


def sample_rows(rows: list[dict], n: int) -> list[dict]:
    """`n` rows spread evenly over the set (the retain set's sample: deterministic, no seed to record)."""
    if len(rows) <= n:
        return rows
    step = len(rows) / n
    return [rows[int(i * step)] for i in range(n)]


def table_markdown(rows: list[dict], limit: int | None = None) -> str:
    lines = ["| question | answer before | answer after | p before | p after | comes out before → after |",
             "|---|---|---|---|---|---|"]
    for r in rows[:limit]:
        cell = [r["question"], r["before"], r["after"]]
        cell = [c.replace("|", "\\|").replace("\n", " ") for c in cell]
        lines.append(f"| {cell[0]} | {cell[1]} | {cell[2]} | {r['probability_before']:.3f} | "
                     f"{r['probability_after']:.3f} | {'yes' if r['comes_out_before'] else 'no'} → "
                     f"{'yes' if r['comes_out_after'] else 'no'} |")
    return "\n".join(lines) + "\n"


def counts(rows: list[dict]) -> dict:
    n = len(rows)
    return {"n": n, "comes_out_before": sum(r["comes_out_before"] for r in rows),
            "comes_out_after": sum(r["comes_out_after"] for r in rows),
            "mean_probability_before": sum(r["probability_before"] for r in rows) / n if n else None,
            "mean_probability_after": sum(r["probability_after"] for r in rows) / n if n else None}


def git_commit(repo: Path) -> str | None:
    """The checkout's commit (with `+dirty` for uncommitted changes), or None outside a git checkout."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if commit.returncode != 0:
        return None
    return commit.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def model_card(run: str, run_config: dict, data_manifest: dict | None, summary_before: dict, summary_after: dict,
               forget_rows: list[dict], retain_rows: list[dict], code: dict) -> str:
    """README.md of the unlearned model: what was forgotten, how, with which params, the before/after table and
    the code version."""
    forget, retain = counts(forget_rows), counts(retain_rows)
    sets = (data_manifest or {}).get("sets", {})
    what = [f"- {name}: `{s['path']}` ({s['rows']} {'pairs' if s['kind'] == 'qa' else 'passages'}, sha256 "
            f"`{s['sha256'][:16]}…`)" for name, s in sets.items()] or ["- (the data's manifest was not given)"]
    metric_rows = []
    for key, title in (("forget_es", "forget extraction strength ↓"), ("forget_rouge", "forget ROUGE-L recall ↓"),
                       ("retain_es", "retain extraction strength ↑"), ("retain_rouge", "retain ROUGE-L recall ↑"),
                       ("model_utility", "model utility ↑")):
        if key in summary_before or key in summary_after:
            fmt = (lambda v: "–" if not isinstance(v, (int, float)) else f"{v:.3f}")
            metric_rows.append(f"| {title} | {fmt(summary_before.get(key))} | {fmt(summary_after.get(key))} |")
    skipped = summary_after.get("skipped") or {}
    lines = [
        "---", "library_name: transformers", "tags: [unlearning, tokenunlearn]", "---", "",
        f"# Unlearned model: run `{run}`", "",
        "Made by TokenUnlearn: token-level attribution for precise unlearning. This model was asked to forget the "
        "items below and keep the retain set.", "",
        "## What was forgotten", "", *what, "",
        "## How", "",
        f"- method: `{run_config.get('method')}`, weighting: `{run_config.get('weighting')}`"
        + (f", score: `{run_config['score']}`" if run_config.get("score") else ""),
        f"- params: `{json.dumps(run_config, sort_keys=True, default=str)}`", "",
        "## Before and after", "",
        f"Forget items whose greedy answer still holds the whole answer: {forget['comes_out_before']} of "
        f"{forget['n']} before, {forget['comes_out_after']} after; retain sample: {retain['comes_out_before']} of "
        f"{retain['n']} before, {retain['comes_out_after']} after.", "",
        "| metric | before | after |", "|---|---|---|", *metric_rows, "",
        *([f"Not measured on this data: {', '.join(f'{k} ({v})' for k, v in skipped.items())}.", ""]
          if skipped else []),
        "### Forget items", "", table_markdown(forget_rows),
        "### Retain sample", "", table_markdown(retain_rows),
        "## Code", "", f"- tokenunlearn {code.get('version')}" + (f", commit `{code['commit']}`"
                                                                  if code.get("commit") else ""), ""]
    return "\n".join(lines)


# The run settings a model card states.
RUN_KEYS = ("method", "weighting", "score", "r", "tau", "retain_loss", "retain_weight", "retain_split")


def run_settings(cfg, train) -> dict:
    """A run's settings for its model card: its UnlearnConfig's RUN_KEYS and the TrainConfig's rate, epochs, seed."""
    from dataclasses import asdict
    return {**{k: v for k, v in asdict(cfg).items() if k in RUN_KEYS}, "lr": train.lr, "epochs": train.epochs,
            "seed": train.seed}


def export_request(run: str, run_config: dict, model_dir: Path, before_dir: Path, after_dir: Path, out_dir: Path,
                   data_manifest: dict | None = None, retain_sample: int = 20, repo: Path | None = None) -> dict:
    """Write `out_dir` atomically: the unlearned model's files (`save_pretrained` layout) with its model card
    README.md, and `before_after/forget.parquet`, `before_after/retain.parquet` (a sample), `before_after.md`.
    Returns the counts."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise DataError(f"{model_dir}: no config.json: not a model directory (an unlearning run's seed{{S}}/model)")
    summaries = []
    for d in (before_dir, after_dir):
        file = Path(d) / "metrics.json"
        if not file.is_file():
            raise DataError(f"{file}: no evaluation summary; evaluate the model first (`tokenunlearn evaluate`)")
        summaries.append(json.loads(file.read_text()))
    forget_rows = before_after(before_dir, after_dir, "forget")
    retain_rows = sample_rows(before_after(before_dir, after_dir, "retain"), retain_sample)
    code = {"version": __version__, "commit": git_commit(repo or Path.cwd())}
    card = model_card(run, run_config, data_manifest, *summaries, forget_rows, retain_rows, code)
    with atomic_dir(out_dir) as tmp:
        for name in MODEL_FILES:
            if (model_dir / name).is_file():
                shutil.copy2(model_dir / name, tmp / name)
        (tmp / "README.md").write_text(card, encoding="utf-8")
        (tmp / "before_after").mkdir()
        for name, rows in (("forget", forget_rows), ("retain", retain_rows)):
            pq.write_table(pa.Table.from_pylist(rows), tmp / "before_after" / f"{name}.parquet")
        (tmp / "before_after.md").write_text("# Forget items\n\n" + table_markdown(forget_rows)
                                             + "\n# Retain sample\n\n" + table_markdown(retain_rows),
                                             encoding="utf-8")
    result = {"forget": counts(forget_rows), "retain": counts(retain_rows)}
    log.info("export %s: forget items that still come out %d of %d → %d; wrote %s", run,
             result["forget"]["comes_out_before"], result["forget"]["n"], result["forget"]["comes_out_after"],
             out_dir)
    return result
