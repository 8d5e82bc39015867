"""open-unlearning's TOFU result files: an evaluation exported as TOFU_EVAL.json and TOFU_SUMMARY.json, and a
retain model's TOFU_EVAL.json read back for forget quality.

The layout is open-unlearning's (src/evals/base.py): TOFU_EVAL.json holds one entry per metric, pre-computes included,
`{"agg_value": x, "value_by_index": {"0": {...}, ...}}` keyed by the item's index in its split as a string (forget
quality and model utility have `agg_value` only); TOFU_SUMMARY.json holds the top-level metrics' `agg_value`s
(none that is null). Both are indented by 4 with the top-level keys sorted, and nothing is rounded.

Names (open-unlearning's configs/eval/tofu_metrics): forget_Q_A_Prob, forget_Q_A_PARA_Prob, forget_Q_A_PERT_Prob,
forget_truth_ratio (lowercase), forget_Q_A_ROUGE, forget_quality, extraction_strength, exact_memorization (the
forget set's); retain_Q_A_{Prob,PARA_Prob,PERT_Prob,ROUGE} and retain_Truth_Ratio; ra_ and wf_ (real authors,
world facts) Q_A_Prob (unnormalised), Q_A_PERT_Prob, Q_A_Prob_normalised (TokenUnlearn's `probability` there),
Truth_Ratio and Q_A_ROUGE; model_utility; with evaluate.mia, mia_loss, mia_zlib, mia_min_k, mia_min_k_plus_plus
and where run mia_gradnorm, mia_reference (`{"agg_value": AUC, "auc": AUC, "forget": {...}, "holdout": {...}}`,
each set's scores by index) and privleak. An evaluation of plain question-answer splits (`evaluate.perturbed` false)
has only the entries that need no perturbed answers: Q_A_Prob, Q_A_ROUGE, extraction_strength, exact_memorization
and the membership-inference ones.

privleak here is open-unlearning's (src/evals/metrics/privacy.py, configs/eval/tofu_metrics/privleak.yaml): Min-K%'s
AUC against the retain model's when the evaluation was given one, else against its `ref_value`, an AUC of 0.5. So
the retain model's own files hold its privleak against 0.5, as open-unlearning writes it for a retain model (which it
evaluates without retain logs), where the summary (metrics.json, the report) has 0: the retain model against itself.
open-unlearning's TOFU config has this one privleak: the other attacks (GradNorm and Reference included) have their
AUCs here, and their privleak only in the summary (`privleak_<attack>`, against the retain model's AUC of the attack).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.common.errors import DataError
from pipeline.evaluation import eval_io
from pipeline.evaluation.mia import PRIVLEAK_ATTACK, auc, privleak
from pipeline.evaluation.tofu_metrics import UTILITY_SETS, model_utility
from pipeline.evaluation.tofu_sets import (GENERATED_ONLY, ITEM_COLUMNS, PERTURBED_ONLY, SET_SPECS, has_greedy_answers,
                                          set_aggregates)

log = logging.getLogger(__name__)

EVAL_FILE, SUMMARY_FILE = "TOFU_EVAL.json", "TOFU_SUMMARY.json"
PREFIX = {"forget": "forget", "retain": "retain", "real_authors": "ra", "world_facts": "wf"}
# The top-level metrics of open-unlearning's configs/eval/tofu.yaml that TokenUnlearn computes, and exact
# memorization (one of its metrics, left out of that list by default): what TOFU_SUMMARY.json holds.
SUMMARY_METRICS = ("forget_quality", "forget_Q_A_Prob", "forget_Q_A_ROUGE", "forget_truth_ratio", "model_utility",
                   "extraction_strength", "exact_memorization", "privleak", "mia_loss", "mia_zlib", "mia_min_k",
                   "mia_min_k_plus_plus", "mia_gradnorm", "mia_reference")
# open-unlearning's privleak without the retain model's logs: its `ref_value`, the retain model's AUC taken as 0.5.
DEFAULT_RETAIN_AUC = 0.5


def truth_ratio_key(kind: str) -> str:
    return "forget_truth_ratio" if kind == "forget" else f"{PREFIX[kind]}_Truth_Ratio"


def _entry(agg_value, items: list[dict], value) -> dict:
    return {"agg_value": agg_value, "value_by_index": {str(it["index"]): value(it) for it in items}}


def _prob_entry(items: list[dict], prob: str, nll: str) -> dict:
    return _entry(float(np.mean([it[prob] for it in items])), items,
                  lambda it: {"prob": it[prob], "avg_loss": it[nll]})


def set_logs(kind: str, items: list[dict], perturbed: bool = True) -> dict[str, dict]:
    """open-unlearning's entries for one TOFU set, from its per-item records (`SetResult.items`); `perturbed`
    false: a plain set's, without those of the answer variants and the truth ratio."""
    p, agg = PREFIX[kind], set_aggregates(items, kind, perturbed)
    logs = {f"{p}_Q_A_Prob": _prob_entry(items, "answer_probability", "answer_mean_nll")}
    if perturbed:
        logs.update(_variant_logs(kind, items, agg))
    if "rouge_l_recall" in agg:  # not in a set scored without greedy answers (evaluate.forget_rouge false)
        logs[f"{p}_Q_A_ROUGE"] = _entry(agg["rouge_l_recall"], items, lambda it: {
            "rouge1_recall": it["rouge1_recall"], "rougeL_f1": it["rouge_l_f1"], "rougeL_recall": it["rouge_l_recall"],
            "input": it["prompt"], "ground_truth": it["ground_truth"], "generation": it["generated"]})
    if kind == "forget":
        logs["extraction_strength"] = _entry(agg["extraction_strength"], items,
                                             lambda it: {"score": it["extraction_strength"]})
        agg_em = None if np.isnan(agg["exact_memorization"]) else agg["exact_memorization"]
        logs["exact_memorization"] = _entry(agg_em, items, lambda it: {"score": it["exact_memorization"]})
    return logs


def _variant_logs(kind: str, items: list[dict], agg: dict[str, float]) -> dict[str, dict]:
    """A perturbed set's entries of its paraphrased and perturbed answers, its normalised probability and truth
    ratio."""
    p, spec, logs = PREFIX[kind], SET_SPECS[kind], {}
    if spec.correct_field == "paraphrased_answer":
        logs[f"{p}_Q_A_PARA_Prob"] = _prob_entry(items, "paraphrased_probability", "paraphrased_mean_nll")
    # the mean over items of the mean over the perturbed answers (open-unlearning's aggregate_to_1D)
    logs[f"{p}_Q_A_PERT_Prob"] = _entry(
        float(np.mean([np.mean(it["perturbed_probability"]) for it in items])), items,
        lambda it: {"prob": list(it["perturbed_probability"]), "avg_loss": list(it["perturbed_mean_nll"])})
    if spec.normalise_probability:
        logs[f"{p}_Q_A_Prob_normalised"] = _entry(agg["probability"], items, lambda it: {"prob": it["probability"]})
    logs[truth_ratio_key(kind)] = _entry(agg["truth_ratio"], items, lambda it: {"score": it["truth_ratio"]})
    return logs


def _scores_entry(scores) -> dict:
    return {"agg_value": float(np.mean(scores)),
            "value_by_index": {str(i): {"score": float(v)} for i, v in enumerate(scores)}}


def ou_privleak(aucs: dict[str, float], retain_auc: float | None) -> float | None:
    """open-unlearning's privleak: Min-K%'s AUC against the retain model's (`retain_auc`; None: none given, so its
    `ref_value` 0.5); None without Min-K%, which open-unlearning's privleak reads."""
    if PRIVLEAK_ATTACK not in aucs:
        return None
    return privleak(aucs[PRIVLEAK_ATTACK], DEFAULT_RETAIN_AUC if retain_auc is None else retain_auc)


def mia_logs(mia: dict) -> dict[str, dict]:
    """mia_<attack> entries (open-unlearning's layout) and privleak, from `{"forget": {attack: scores},
    "holdout": {...}, "auc": {attack: AUC}, "retain_auc": the retain model's Min-K% AUC or None}` (`ou_privleak`)."""
    logs = {f"mia_{attack}": {"agg_value": value, "auc": value, "forget": _scores_entry(mia["forget"][attack]),
                              "holdout": _scores_entry(mia["holdout"][attack])}
            for attack, value in mia["auc"].items()}
    leak = ou_privleak(mia["auc"], mia.get("retain_auc"))
    if leak is not None:
        logs["privleak"] = {"agg_value": leak}
        if mia.get("retain_auc") is None:
            log.info("open-unlearning's privleak %.2f: Min-K%% AUC against its default retain AUC %.1f (no other "
                     "retain model's AUC was given, as when it evaluates a retain model)", leak, DEFAULT_RETAIN_AUC)
    return logs


def eval_logs(items_by_set: dict[str, list[dict]], forget_quality: float | None,
              mia: dict | None = None, perturbed: bool = True) -> dict[str, dict]:
    """TOFU_EVAL.json's content: every set's entries, forget quality (null without a retain model's evaluation, as
    open-unlearning writes it; none for plain sets, which have no truth ratio), model utility (when retain, real
    authors and world facts were evaluated), and the membership-inference entries (`mia_logs`) where there are
    any."""
    logs: dict[str, dict] = {}
    for kind, items in items_by_set.items():
        logs.update(set_logs(kind, items, perturbed))
    if "forget" in items_by_set and perturbed:
        logs["forget_quality"] = {"agg_value": forget_quality}
    if all(s in items_by_set for s in UTILITY_SETS):
        logs["model_utility"] = {"agg_value": model_utility({s: set_aggregates(items_by_set[s], s)
                                                             for s in UTILITY_SETS})}
    if mia is not None:
        logs.update(mia_logs(mia))
    return dict(sorted(logs.items()))


def summary_of(logs: dict[str, dict]) -> dict[str, float]:
    """TOFU_SUMMARY.json's content: the top-level metrics' values, without those that are null."""
    return {k: logs[k]["agg_value"] for k in sorted(SUMMARY_METRICS)
            if k in logs and logs[k]["agg_value"] is not None}


def write_files(out_dir: Path, logs: dict[str, dict]) -> None:
    eval_io.write_strict_json(Path(out_dir) / EVAL_FILE, logs, indent=4)
    eval_io.write_strict_json(Path(out_dir) / SUMMARY_FILE, summary_of(logs), indent=4)


# ---- re-export of an evaluation directory --------------------------------------------------------------------

def _read_mia(eval_dir: Path, forget: list[dict] | None, metrics: dict) -> dict | None:
    """The membership-inference scores kept in the items (forget's `mia_*` columns and items/holdout.parquet), and
    the retain model's Min-K% AUC this evaluation was compared with (metrics.json's `mia.min_k.retain_auc`; none in
    the retain model's own evaluation)."""
    file = eval_dir / "items" / "holdout.parquet"
    if not file.is_file() or not forget:
        return None
    holdout = eval_io.read_parquet(file).to_pylist()
    eval_io.check_items(holdout, file)
    attacks = [c[4:] for c in holdout[0] if c.startswith("mia_")]
    lacking = [f"mia_{a}" for a in attacks if f"mia_{a}" not in forget[0]]
    if lacking:
        raise DataError(f"{eval_dir / 'items' / 'forget.parquet'}: no {lacking} column, which {file} has: the two "
                        "come from different evaluations; evaluate the model again")
    scores = {"forget": {a: [it[f"mia_{a}"] for it in forget] for a in attacks},
              "holdout": {a: [it[f"mia_{a}"] for it in holdout] for a in attacks}}
    entry = metrics.get("mia") if isinstance(metrics.get("mia"), dict) else {}
    entry = entry.get(PRIVLEAK_ATTACK) if isinstance(entry.get(PRIVLEAK_ATTACK), dict) else {}
    file = eval_dir / "metrics.json"
    return {**scores, "auc": {a: auc(scores["forget"][a], scores["holdout"][a]) for a in attacks},
            "retain_auc": eval_io.number(entry.get("retain_auc"), f"{file}: mia.{PRIVLEAK_ATTACK}.retain_auc", 0.0,
                                         1.0, nullable=True)}


def _is_plain(table) -> bool:
    """Whether an items table holds a plain set's records (written with `perturbed: false` in its metadata)."""
    try:
        return json.loads((table.schema.metadata or {})[b"tokenunlearn"]).get("perturbed") is False
    except (KeyError, TypeError, ValueError, AttributeError):
        return False  # no such metadata: an evaluation of perturbed sets, as every one before plain sets was


def _read_one(eval_dir: Path) -> tuple[dict[str, list[dict]], float | None, dict | None, bool]:
    files = {kind: eval_dir / "items" / f"{kind}.parquet" for kind in SET_SPECS}
    tables = {kind: eval_io.read_parquet(f) for kind, f in files.items() if f.is_file()}
    items = {kind: table.to_pylist() for kind, table in tables.items()}
    if not items:
        raise DataError(f"{eval_dir / 'items'}: no TOFU set's items (forget, retain, real_authors, world_facts)")
    for kind, rows in items.items():
        eval_io.check_items(rows, files[kind])  # an out-of-range value would be exported as a plausible number
    plain = {kind for kind, table in tables.items() if _is_plain(table)}
    if plain and plain != set(tables):
        raise DataError(f"{eval_dir / 'items'}: {sorted(plain)} hold plain sets' items and "
                        f"{sorted(set(tables) - plain)} perturbed ones: they come from different evaluations; "
                        "evaluate the model again")
    perturbed = not plain
    needed = set(ITEM_COLUMNS) - {"paraphrased_mean_nll", "paraphrased_probability"}  # forget and retain only
    if not perturbed:
        needed -= set(PERTURBED_ONLY)
    for kind, rows in items.items():
        columns = set(rows[0])
        # a set without ROUGE was scored without greedy answers (evaluate.forget_rouge: false), not by old code
        missing = sorted(needed - columns - (set() if has_greedy_answers(columns) else set(GENERATED_ONLY)))
        if missing:
            raise DataError(f"{files[kind]}: its items lack {missing}: an evaluation made before open-unlearning's "
                            "export; evaluate the model again")
    file = eval_dir / "metrics.json"
    metrics = eval_io.read_json(file, "evaluation summary") if file.is_file() else {}
    fq = eval_io.number(metrics.get("forget_quality"), f"{file}: forget_quality", 0.0, 1.0, nullable=True)
    eval_io.number(metrics.get("privleak"), f"{file}: privleak", nullable=True)
    return items, fq, _read_mia(eval_dir, items.get("forget"), metrics), perturbed


def export_evaluation(eval_dir: Path, out_dir: Path) -> list[Path]:
    """Write TOFU_EVAL.json and TOFU_SUMMARY.json for the evaluation in `eval_dir` into `out_dir` (one unlearning
    run's seeds: each seed{S}/ into out_dir/seed{S}/); the directories written."""
    eval_dir, out_dir = Path(eval_dir), Path(out_dir)
    if (eval_dir / "items").is_dir():
        pairs = [(eval_dir, out_dir)]
    else:
        pairs = [(d, out_dir / d.name) for d in sorted(eval_dir.glob("seed*")) if (d / "items").is_dir()]
    if not pairs:
        raise DataError(f"{eval_dir}: not an evaluation directory (no items/ and no seed*/items/): the --out of "
                        "`tokenunlearn evaluate`")
    for source, target in pairs:
        items, fq, mia, perturbed = _read_one(source)
        target.mkdir(parents=True, exist_ok=True)
        write_files(target, eval_logs(items, fq, mia, perturbed))
        log.info("open-unlearning's %s and %s of %s written to %s", EVAL_FILE, SUMMARY_FILE, source, target)
    return [target for _, target in pairs]


# ---- a retain model's TOFU_EVAL.json, for forget quality -----------------------------------------------------

@dataclass
class RetainLogs:
    """What an open-unlearning retain evaluation gives forget quality: the per-item forget truth ratios in index
    order, and the prompts of its forget ROUGE entries where it has them (it has no question hash)."""

    file: Path
    truth_ratios: list[float]
    prompts: list[str] | None


def eval_file(path: Path) -> Path | None:
    """The TOFU_EVAL.json that `path` names (the file, or a directory holding one), or None."""
    path = Path(path)
    if path.is_file():
        return path
    return path / EVAL_FILE if (path / EVAL_FILE).is_file() else None


def read_retain_logs(file: Path) -> RetainLogs:
    """forget_truth_ratio.value_by_index[*].score of an open-unlearning TOFU_EVAL.json, in index order."""
    logs = eval_io.read_json(file, f"open-unlearning {EVAL_FILE}")
    try:
        by_index = logs["forget_truth_ratio"]["value_by_index"]
        order = sorted(by_index, key=int)
        raw = [by_index[i]["score"] for i in order]
    except ValueError as e:  # an index that is no integer
        raise DataError(f"{file}: not a readable open-unlearning {EVAL_FILE} ({e})") from None
    except (KeyError, TypeError):
        raise DataError(f"{file}: no forget_truth_ratio.value_by_index with a numeric score per item, as "
                        "open-unlearning's TOFU_EVAL.json has") from None
    # A NaN score makes forget quality NaN, a negative one is no truth ratio (a ratio of probabilities).
    scores = [eval_io.number(v, f"{file}: forget_truth_ratio.value_by_index.{i}.score", 0.0)
              for i, v in zip(order, raw)]
    rouge = (logs.get("forget_Q_A_ROUGE") or {}).get("value_by_index") or {}
    prompts = [rouge[i]["input"] for i in order] if all(
        isinstance(rouge.get(i), dict) and isinstance(rouge[i].get("input"), str) for i in order) else None
    return RetainLogs(Path(file), scores, prompts)


def check_prompts(reference: RetainLogs, prompts: list[str]) -> None:
    """The retain evaluation's forget prompts (its ROUGE entries' `input`) are this evaluation's, up to whitespace."""
    norm = lambda s: " ".join(s.split())
    for i, (theirs, ours) in enumerate(zip(reference.prompts or [], prompts)):
        if norm(theirs) != norm(ours):
            raise DataError(f"{reference.file}: forget item {i}: its prompt {theirs!r} is not this evaluation's "
                            f"{ours!r}; evaluate both models on the same forget split with the same template")
