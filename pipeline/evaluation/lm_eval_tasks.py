"""Any lm-evaluation-harness task on a model the pipeline wrote (`evaluate.lm_eval`), run by lm-eval itself.

`simple_evaluate` runs the named tasks (built-in ones such as gsm8k or mmlu, or the user's YAMLs under
`include_path`) with lm-eval's own HF model class, HFLM, wrapped around the model the evaluation has already
loaded; lm-eval loads the tokenizer from the model's directory, as its CLI does. So the numbers are the harness's by
construction, for one copy of the weights, on the evaluation's device and dtype.

Why in process and not in a subprocess: a subprocess would load the weights a second time (twice the GPU memory,
and the reload), and it would isolate nothing that needs isolating: the `lmeval` extra only adds packages to this
environment, it changes none of the pinned ones (docs/evaluation.md). lm-eval is optional and imported only when
the option is on; `simple_evaluate` seeds python's, numpy's and torch's generators with lm-eval's seeds, as its
CLI does.

Outputs: `flat_metrics` gives the summary's keys, `lmeval_<task>_<metric>[_<filter>]` and `..._stderr`, for the
top-level tasks and groups (those requested, or a tag's tasks); every subtask's numbers are under the summary's
`lm_eval.results`; `write_outputs` writes lm-eval's results.json and one samples file per task.
"""

from __future__ import annotations

import difflib
import functools
import json
import logging
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.common.errors import ParamError
from pipeline.common.params import dataclass_from_params

log = logging.getLogger(__name__)

WHERE = "evaluate.lm_eval"
EXTRA = "lmeval"                 # pyproject's [project.optional-dependencies] entry
TESTED_VERSION = "0.4.13"        # what the extra pins and tests/evaluation/test_lm_eval_tasks.py checks against
PREFIX = "lmeval_"               # the summary's keys (and the report's columns)


@dataclass(frozen=True)
class LMEvalSpec:
    """`evaluate.lm_eval`: the tasks and lm-eval's own options for them (its CLI's flags of the same names)."""

    tasks: list = field(default_factory=list)  # task, group or tag names (built-in or under include_path)
    num_fewshot: int | None = None             # null: each task's own (0 where it sets none)
    limit: int | float | None = None           # items per task: a count, or a fraction in (0, 1); for trials only
    batch_size: int | str | None = None        # an integer or "auto"; null: evaluate.mc_batch_size
    include_path: str | list | None = None     # directories of task YAMLs (relative to the working directory)

    @classmethod
    def from_params(cls, values: dict, where: str = WHERE) -> "LMEvalSpec":
        spec = dataclass_from_params(cls, values, where)
        if not spec.tasks or not all(isinstance(t, str) and t.strip() for t in spec.tasks) \
                or len(set(spec.tasks)) != len(spec.tasks):
            raise ParamError(f"{where}.tasks={spec.tasks!r}: expected a non-empty list of distinct task names, "
                             "e.g. [gsm8k, mmlu]")
        if spec.num_fewshot is not None and spec.num_fewshot < 0:
            raise ParamError(f"{where}.num_fewshot={spec.num_fewshot!r}: must be null or at least 0")
        if spec.limit is not None and not (isinstance(spec.limit, int) and spec.limit >= 1
                                           or isinstance(spec.limit, float) and 0 < spec.limit < 1):
            raise ParamError(f"{where}.limit={spec.limit!r}: must be null, a count of at least 1 or a fraction in "
                             "(0, 1)")
        if spec.batch_size is not None and not (isinstance(spec.batch_size, int) and spec.batch_size >= 1
                                                or spec.batch_size == "auto"):
            raise ParamError(f"{where}.batch_size={spec.batch_size!r}: must be null, at least 1 or 'auto'")
        paths = spec.include_path if isinstance(spec.include_path, list) else [spec.include_path] \
            if spec.include_path is not None else []
        if not all(isinstance(p, str) and p for p in paths):
            raise ParamError(f"{where}.include_path={spec.include_path!r}: expected a directory or a list of them")
        return spec

    @property
    def include_paths(self) -> tuple[str, ...]:
        paths = self.include_path if isinstance(self.include_path, list) else [self.include_path] \
            if self.include_path is not None else []
        return tuple(str(Path(p).resolve()) for p in paths)


def _lm_eval():
    """The lm_eval package, or a ParamError that says how to install it."""
    try:
        import lm_eval
    except ImportError as e:
        raise ParamError(f"{WHERE}: needs lm-evaluation-harness, which is not installed here ({e}): install the "
                         f"extra, `pip install -e '.[{EXTRA}]'` (lm-eval[hf]=={TESTED_VERSION}), or switch it off "
                         f"with {WHERE}: null") from None
    if lm_eval.__version__ != TESTED_VERSION:
        log.warning("lm-eval %s is installed; %s is what the `%s` extra pins and the tests check", lm_eval.__version__,
                    TESTED_VERSION, EXTRA)
    return lm_eval


@functools.lru_cache(maxsize=None)  # the index of lm-eval's ~15k built-in YAMLs takes seconds: built once
def _task_manager(include_paths: tuple[str, ...], include_defaults: bool):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=list(include_paths) or None, include_defaults=include_defaults)


def _self_contained(index: dict, names) -> bool:
    """Whether every name, and every task a group names (at any depth), is in `index`: then lm-eval's built-in
    tasks need not be indexed."""
    todo, seen = list(names), set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        entry = index.get(name)
        if entry is None:
            return False
        cfg = getattr(entry, "cfg", None) or {}
        if "group" in cfg and isinstance(cfg.get("task"), list):  # a group's children: names or inline configs
            todo += [child for child in cfg["task"] if isinstance(child, str)]
    return True


def task_manager(spec: LMEvalSpec):
    """lm-eval's TaskManager for the spec's tasks, each checked to exist: the include path's YAMLs alone where they
    hold every task (seconds faster), else with lm-eval's built-in tasks. An unknown name is a ParamError."""
    _lm_eval()
    missing = [p for p in spec.include_paths if not Path(p).is_dir()]
    if missing:
        raise ParamError(f"{WHERE}.include_path: {missing} is not a directory (of lm-eval task YAMLs)")
    if spec.include_paths:
        local = _task_manager(spec.include_paths, False)
        if _self_contained(local.task_index, spec.tasks):
            return local
    manager = _task_manager(spec.include_paths, True)
    unknown = [t for t in spec.tasks if t not in manager.task_index]
    if unknown:
        hints = [f"{t}: did you mean {', '.join(close)}?" for t in unknown
                 if (close := difflib.get_close_matches(t, manager.all_tasks, n=3))]
        raise ParamError(f"{WHERE}.tasks: {unknown} are not lm-eval tasks, groups or tags ({'; '.join(hints + [''])}"
                         "`lm-eval ls tasks` lists them; a YAML under include_path that lm-eval cannot parse is "
                         "skipped, so its task is unknown)")
    return manager


@dataclass
class LMEvalRun:
    """One model's lm-eval results: the flat metrics for the summary, the nested summary, and what is written."""

    metrics: dict[str, float]    # lmeval_<task>_<metric>[_<filter>][_stderr] -> value, the top-level tasks
    summary: dict                # the summary's `lm_eval`: version, options, n-shot, n, every task's numbers
    results: dict                # lm-eval's output without its samples (its results.json)
    samples: dict[str, list]     # task -> lm-eval's per-item records, slimmed


def run_tasks(model, model_path: str, spec: LMEvalSpec, batch_size: int, trust_remote_code: bool = False
              ) -> LMEvalRun:
    """The spec's tasks on `model` (already loaded, in eval mode) through lm-eval's simple_evaluate; `model_path`
    is where lm-eval loads the tokenizer from; `batch_size` where the spec sets none."""
    lm_eval = _lm_eval()
    from lm_eval.models.huggingface import HFLM

    manager = task_manager(spec)
    if spec.limit is not None:
        log.warning("%s.limit=%s: each task on part of its items, for trials: not comparable with full runs",
                    WHERE, spec.limit)
    start = time.perf_counter()
    batch_size = spec.batch_size or batch_size
    lm = HFLM(pretrained=model, tokenizer=str(model_path), batch_size=batch_size, trust_remote_code=trust_remote_code)
    out = lm_eval.simple_evaluate(model=lm, tasks=list(spec.tasks), num_fewshot=spec.num_fewshot, limit=spec.limit,
                                  task_manager=manager, log_samples=True,
                                  batch_size=batch_size, device=str(model.device))  # these two: for its record only
    samples = {task: [_slim(s) for s in rows] for task, rows in (out.pop("samples", None) or {}).items()}
    # rounded to 6 digits as the rest of the summary; results.json keeps lm-eval's own values
    metrics = {k: round(v, 6) for k, v in flat_metrics(out).items()}
    summary = {"version": lm_eval.__version__, "tasks": list(spec.tasks), "num_fewshot": spec.num_fewshot,
               "limit": spec.limit, "n_shot": out.get("n-shot", {}),
               "n": {t: n.get("effective") for t, n in out.get("n-samples", {}).items() if isinstance(n, dict)},
               "results": {task: {k: round(v, 6) for k, v in _finite(values).items()}
                           for task, values in out["results"].items()}}
    log.info("lm-eval (%.0f s): %s", time.perf_counter() - start,
             ", ".join(f"{k.removeprefix(PREFIX)} {v:.3f}" for k, v in metrics.items() if not k.endswith("_stderr")))
    return LMEvalRun(metrics, summary, out, samples)


def _finite(values: dict) -> dict:
    """A task's numbers (lm-eval's `metric,filter` keys), the finite ones: "N/A" stderrs and NaNs are not JSON."""
    return {k: v for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
            and math.isfinite(v)}


def _part(text: str) -> str:
    """A name as part of a summary key: runs of anything but letters and digits become one underscore."""
    return re.sub(r"[^0-9A-Za-z]+", "_", text).strip("_")


def top_level(out: dict) -> list[str]:
    """The tasks and groups of lm-eval's results that no group holds: those requested, or a tag's tasks."""
    children = {c for subtasks in (out.get("group_subtasks") or {}).values() for c in subtasks}
    return [task for task in out["results"] if task not in children]


def flat_metrics(out: dict) -> dict[str, float]:
    """lm-eval's results of the top-level tasks as summary keys: `acc,none` of mmlu is `lmeval_mmlu_acc`,
    `exact_match,strict-match` of gsm8k `lmeval_gsm8k_exact_match_strict_match`, each stderr `..._stderr`.
    Non-finite values and "N/A" stderrs are left out; two results that would share a key are an error."""
    flat: dict[str, float] = {}
    origin: dict[str, str] = {}
    for task in top_level(out):
        for name, value in _finite(out["results"][task]).items():
            if "," not in name:
                continue  # not a metric (sample counts and the like)
            metric, filter_name = name.split(",", 1)
            metric, stderr = (metric.removesuffix("_stderr"), "_stderr") if metric.endswith("_stderr") else (metric, "")
            key = PREFIX + "_".join(_part(p) for p in (task, metric, "" if filter_name == "none" else filter_name)
                                    if _part(p)) + stderr
            if key in flat:
                raise ParamError(f"{WHERE}: {task}'s {name} and {origin[key]} would both be the summary's {key}; "
                                 "rename one of the tasks")
            flat[key], origin[key] = float(value), f"{task}'s {name}"
    return flat


# The fields of lm-eval's per-item records kept in samples_<task>.jsonl: the docs and full prompts are left out
# (the task's data has them; 5-shot MMLU's prompts alone are hundreds of MB); the hashes identify them.
SAMPLE_FIELDS = ("doc_id", "filter", "target", "filtered_resps", "doc_hash", "prompt_hash", "target_hash")


def _slim(sample: dict) -> dict:
    return {**{k: sample[k] for k in SAMPLE_FIELDS if k in sample},
            **{m: sample[m] for m in sample.get("metrics", ()) if m in sample}}


def write_outputs(out_dir: Path, run: LMEvalRun) -> None:
    """`out_dir/results.json` (lm-eval's layout, as its CLI writes it) and `samples_<task>.jsonl`, one line per
    item and filter (inside an evaluation's atomic directory)."""
    from lm_eval.utils import handle_non_serializable

    out_dir.mkdir(parents=True)
    (out_dir / "results.json").write_text(json.dumps(run.results, indent=2, default=handle_non_serializable,
                                                     ensure_ascii=False), encoding="utf-8")
    for task, rows in run.samples.items():
        with open(out_dir / f"samples_{task}.jsonl", "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, default=handle_non_serializable, ensure_ascii=False) + "\n")
