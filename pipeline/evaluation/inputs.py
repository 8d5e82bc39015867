"""What an evaluation reads besides the model, loaded and checked before any model is: the TOFU sets' rows, the
multiple-choice items, the retain model's forget truth ratios (forget quality) and membership-inference AUCs
(privleak), and the reference model of the reference attack. A bad split, multiple-choice file or retain evaluation
fails in seconds, not after the first forward passes.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from pipeline.common.errors import DataError, ParamError
from pipeline.data.mc_items import MCItem
from pipeline.data.tofu import load_split
from pipeline.evaluation import eval_io, lm_eval_tasks, open_unlearning
from pipeline.evaluation.config import EvalConfig
from pipeline.evaluation.mc_sets import load_mc_sets
from pipeline.evaluation.mia import PRIVLEAK_ATTACK
from pipeline.evaluation.muse import MuseInputs, load_muse_inputs
from pipeline.evaluation.mia_reference import Reference, check_retain_settings, resolve_reference
from pipeline.evaluation.probes import PROBED_SETS

log = logging.getLogger(__name__)


def questions_hash(rows: list[dict]) -> str:
    return hashlib.sha256(json.dumps([r["question"] for r in rows]).encode()).hexdigest()[:16]


def _retain_items(retain_dir: Path) -> Path:
    file = retain_dir / "items" / "forget.parquet"
    if not file.is_file():
        raise DataError(
            f"forget quality needs the retain model's evaluation, and {file} does not exist: evaluate the retain "
            f"model first (`tokenunlearn evaluate retain --model artifacts/models/retain --out {retain_dir}`, "
            f"DVC stage evaluate_retain), or name open-unlearning's {open_unlearning.EVAL_FILE} of it")
    return file


def _questions_hash_of(table: pa.Table, file: Path) -> str:
    """The questions hash an items table was written with (its `tokenunlearn` schema metadata)."""
    try:
        theirs = json.loads((table.schema.metadata or {})[b"tokenunlearn"])["questions_hash"]
    except (KeyError, TypeError, ValueError):
        theirs = None
    if not isinstance(theirs, str):
        raise DataError(f"{file}: no questions hash in its metadata: not items written by `tokenunlearn evaluate`; "
                        "evaluate the retain model again")
    return theirs


def retain_truth_ratios(retain_dir: Path, forget_hash: str, n_forget: int | None = None) -> list[float]:
    """The retain model's per-item forget truth ratios, from its evaluation; refused if it scored other items, or
    if a truth ratio is not a finite non-negative number (a NaN would make forget quality NaN)."""
    file = _retain_items(retain_dir)
    table = eval_io.read_parquet(file)
    theirs = _questions_hash_of(table, file)
    if theirs != forget_hash:
        raise DataError(f"{file}: the retain model was evaluated on other forget questions (hash {theirs}, "
                        f"here {forget_hash}); evaluate both on the same source and forget split")
    if "truth_ratio" not in table.column_names:
        raise DataError(f"{file}: no truth_ratio column; evaluate the retain model again")
    rows = table.select(["truth_ratio"]).to_pylist()
    eval_io.check_items(rows, file, n_forget)
    return [r["truth_ratio"] for r in rows]


def load_retain_reference(retain: Path, forget_hash: str,
                          n_forget: int) -> tuple[list[float], open_unlearning.RetainLogs | None]:
    """The retain model's forget truth ratios: from its evaluation directory here (`items/forget.parquet`, checked
    by the hash of its questions), or from open-unlearning's TOFU_EVAL.json (the file, or a directory holding one),
    which has no hash: its count is checked here, and its forget ROUGE prompts, where it has them, by
    `open_unlearning.check_prompts` once the tokenizer is loaded (the RetainLogs returned)."""
    retain = Path(retain)
    file = None if (retain / "items" / "forget.parquet").is_file() else open_unlearning.eval_file(retain)
    if file is None:
        return retain_truth_ratios(retain, forget_hash, n_forget), None
    logs = open_unlearning.read_retain_logs(file)
    if len(logs.truth_ratios) != n_forget:
        raise DataError(f"{file}: {len(logs.truth_ratios)} forget truth ratios, but the forget set has {n_forget} "
                        "items: the retain model was evaluated on another forget split")
    checked = "and its forget prompts (forget_Q_A_ROUGE's inputs) once the tokenizer loads" if logs.prompts \
        else "only: it has no forget_Q_A_ROUGE inputs to compare prompts with"
    log.info("forget quality: the retain model's %d forget truth ratios from %s (open-unlearning's layout has no "
             "question hash: checked the count %s)", n_forget, file, checked)
    return logs.truth_ratios, logs


@dataclass
class EvalInputs:
    """Everything an evaluation reads besides the model, loaded and validated before any model is: a bad split,
    multiple-choice file or retain evaluation fails in seconds, not after the first forward passes."""

    tofu: dict[str, tuple[str, list[dict]]]        # set name -> (split, rows)
    questions_hash: dict[str, str]                  # set name -> hash of its questions
    mc: dict[str, tuple[dict, list[MCItem]]]        # MC set name -> (its spec, items)
    retain_truth_ratios: list[float] | None = None  # the retain model's forget truth ratios, for forget quality
    retain_logs: open_unlearning.RetainLogs | None = None  # where they come from open-unlearning's TOFU_EVAL.json
    holdout: tuple[str, list[dict]] | None = None   # membership inference's holdout split and rows
    retain_auc: dict[str, float] | None = None      # the retain model's AUC per attack, for privleak
    reference: Reference | None = None              # the reference attack's reference model and its losses
    muse: MuseInputs | None = None                  # MUSE's sets and the retain model's AUCs (evaluate.muse)


def load_inputs(cfg: EvalConfig, retain_dir: Path | None, own_retain: bool = False) -> EvalInputs:
    """The TOFU sets' rows, the multiple-choice items and the retain model's forget truth ratios (unless this is
    the retain model's own evaluation, `retain_dir` is None, or the splits are plain, without truth ratios); MUSE's
    sets and the retain model's AUCs."""
    tofu, hashes = {}, {}
    for name, split in cfg.set_splits.items():
        rows = load_split(cfg.source, split)  # a plain split's schema is question and answer (data/tofu.py)
        tofu[name], hashes[name] = (split, rows), questions_hash(rows)
    mc = load_mc_sets(cfg.multiple_choice, cfg.forget_split, cfg.seed)
    unknown = [s for s in cfg.probe_sets if s not in (*PROBED_SETS, *mc)]
    if unknown and not cfg.muse:  # MUSE's evaluation runs no probes
        raise ParamError(f"evaluate.probe_sets: {unknown} are neither forget, retain nor a multiple-choice set of "
                         f"evaluate.multiple_choice (have {sorted(mc)})")
    if cfg.lm_eval_spec is not None:
        lm_eval_tasks.task_manager(cfg.lm_eval_spec)  # lm-eval installed, its tasks found: before any model loads
    reference, retain_logs = None, None
    if retain_dir is not None and not own_retain and "forget" in tofu and cfg.perturbed:
        reference, retain_logs = load_retain_reference(Path(retain_dir), hashes["forget"], len(tofu["forget"][1]))
    holdout, retain_auc = None, None
    if cfg.mia_spec is not None:
        holdout = (cfg.mia_spec.holdout_split, load_split(cfg.source, cfg.mia_spec.holdout_split))
        if retain_dir is not None and not own_retain:
            retain_auc = load_retain_auc(Path(retain_dir), cfg.mia_spec.attacks)
    inputs = EvalInputs(tofu, hashes, mc, reference, retain_logs, holdout, retain_auc)
    if cfg.mia_spec is not None and cfg.mia_spec.reference:
        inputs.reference = resolve_reference(cfg.mia_spec.reference, retain_dir, own_retain, {
            "forget": hashes["forget"], "holdout": questions_hash(holdout[1])})
    if retain_auc is not None:
        check_retain_settings(Path(retain_dir), cfg.mia_spec.settings(
            inputs.reference.model if inputs.reference is not None else None))
    if cfg.muse_spec is not None:
        spec = cfg.muse_spec
        inputs.muse = load_muse_inputs(spec.source, spec.settings(), retain_dir, own_retain, spec.retain_auc)
    return inputs


def load_retain_auc(retain: Path, attacks: list[str]) -> dict[str, float]:
    """The retain model's AUC of each attack it has, for privleak: from its evaluation here (metrics.json's `mia`),
    or from open-unlearning's TOFU_EVAL.json of it (`mia_<attack>.agg_value`; open-unlearning's default config keeps
    only mia_min_k, privleak's). An attack it lacks gets no privleak (a warning names it), never another reference;
    none at all is an error (a retain evaluation made without membership inference)."""
    file = retain / "metrics.json" if (retain / "metrics.json").is_file() else open_unlearning.eval_file(retain)
    if file is None:
        raise DataError(f"privleak needs the retain model's membership-inference AUCs, and {retain} holds neither "
                        "metrics.json nor TOFU_EVAL.json: evaluate the retain model first (DVC stage evaluate_retain)")
    what = "evaluation summary" if file.name == "metrics.json" else f"open-unlearning {open_unlearning.EVAL_FILE}"
    data = eval_io.read_json(file, what)
    if file.name == "metrics.json":
        mia = data.get("mia") or {}
        if not isinstance(mia, dict):
            raise DataError(f"{file}: mia: {mia!r} is not an object of attacks")
        found = {a: (f"mia.{a}.auc", v["auc"]) for a, v in mia.items() if isinstance(v, dict) and "auc" in v}
    else:
        found = {a: (f"mia_{a}.agg_value", data[f"mia_{a}"].get("agg_value")) for a in attacks
                 if isinstance(data.get(f"mia_{a}"), dict)}
    missing = [a for a in attacks if a not in found]
    if not found:  # nothing to compare with at all: a retain evaluation made without evaluate.mia
        raise DataError(f"{file}: no membership-inference AUC of {missing} for the retain model: evaluate it again "
                        "with evaluate.mia (privleak compares each attack with the retain model's)")
    if missing:
        log.warning("privleak: %s has no membership-inference AUC of %s for the retain model, so those attacks get "
                    "no privleak%s (evaluate the retain model with the same evaluate.mia for all of them)", file,
                    missing, f", nor the summary's privleak ({PRIVLEAK_ATTACK}'s)" if PRIVLEAK_ATTACK in missing else "")
    # an AUC is a probability; anything else would give a plausible but meaningless privleak
    return {a: eval_io.number(found[a][1], f"{file}: {found[a][0]}", 0.0, 1.0) for a in attacks if a in found}
