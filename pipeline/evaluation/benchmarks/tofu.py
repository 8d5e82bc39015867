"""TOFU's benchmark: each set's per-item metrics and aggregates, forget and retain ES and EM, forget quality against
the retain model's truth ratios, and model utility (the formulas: `tofu_metrics.py`).

On plain question-answer splits (`evaluate.perturbed` false) the forget and retain sets' ES, EM, ROUGE-L recall and
probability, with forget_rouge and retain_rouge at the top; what needs perturbed answers is in `EvalConfig.skipped`."""

from __future__ import annotations

import logging
import math

from pipeline.evaluation import open_unlearning
from pipeline.evaluation.config import EvalConfig
from pipeline.evaluation.evaluator import Context, Evaluator, Part
from pipeline.evaluation.registry import TOFU
from pipeline.evaluation.tofu_metrics import UTILITY_SETS, forget_quality, model_utility, rouge_references
from pipeline.evaluation.tofu_sets import SetResult, evaluate_set

log = logging.getLogger(__name__)


class TofuSets(Evaluator):
    name, benchmark = "tofu", TOFU

    def enabled(self, cfg: EvalConfig) -> bool:
        return bool(cfg.set_splits)

    def prepare(self, ctx: Context) -> None:
        """The retain model's forget prompts (open-unlearning's file, where it has them) against this evaluation's,
        before the model loads: a mismatch fails in seconds."""
        logs = ctx.inputs.retain_logs
        if logs is not None and logs.prompts and "forget" in ctx.inputs.tofu:
            rows = ctx.inputs.tofu["forget"][1]
            open_unlearning.check_prompts(logs, rouge_references(
                ctx.tokenizer, ctx.template, [r["question"] for r in rows], [r["answer"] for r in rows])[0])
            log.info("forget quality: the %d prompts of %s are this evaluation's", len(rows), logs.file)

    def run(self, model, ctx: Context) -> Part:
        cfg, summary, results = ctx.cfg, {}, {}
        for name, (split, rows) in ctx.inputs.tofu.items():
            result = evaluate_set(model, ctx.tokenizer, ctx.template, rows, name, cfg.batch_size,
                                  cfg.max_new_tokens, name=f"{cfg.source}/{split}", es_definition=cfg.es_definition,
                                  loss_dtype=cfg.loss_dtype, perturbed=cfg.perturbed,
                                  generate=cfg.forget_rouge or name != "forget")
            results[name] = result
            ctx.items[name] = item_records(rows, result)
            ctx.item_meta[name] = {"split": split, "questions_hash": ctx.inputs.questions_hash[name]}
            if not cfg.perturbed:  # the items' readers (open-unlearning's export) expect no truth ratio then
                ctx.item_meta[name]["perturbed"] = False
            summary[name] = {"n": len(rows), **{k: rounded(k, v) for k, v in result.aggregates.items()}}
            log.info("%s: %s", split, set_line(summary[name]))
            log.debug("%s: %s", split, summary[name])
        if "forget" in results:
            summary["forget_es"] = summary["forget"]["extraction_strength"]
            summary["forget_em"] = summary["forget"]["exact_memorization"]
            if not cfg.perturbed and cfg.forget_rouge:  # no truth ratio: ROUGE is the generation-side measure left
                summary["forget_rouge"] = summary["forget"]["rouge_l_recall"]
            if ctx.has_retain and cfg.perturbed:
                reference = results["forget"].truth_ratios if ctx.own_retain else ctx.inputs.retain_truth_ratios
                fq = forget_quality(results["forget"].truth_ratios, reference)
                ctx.found["forget_quality"] = fq.pvalue  # open-unlearning's layout has it
                summary["forget_quality"], summary["log10_forget_quality"] = fq.pvalue, round(fq.log10_pvalue, 4)
        if "retain" in results:
            summary["retain_es"] = summary["retain"]["extraction_strength"]
            summary["retain_em"] = summary["retain"]["exact_memorization"]
            if not cfg.perturbed:  # the utility measure left without model utility's sets
                summary["retain_rouge"] = summary["retain"]["rouge_l_recall"]
        if all(s in results for s in UTILITY_SETS):
            summary["model_utility"] = round(model_utility({k: v.aggregates for k, v in results.items()}), 6)
        return Part(summary)


def item_records(rows: list[dict], result: SetResult) -> list[dict]:
    return [{"question": r["question"], "answer": r["answer"], **item} for r, item in zip(rows, result.items)]


def rounded(metric: str, value: float) -> float | None:
    """A set aggregate for the summary, rounded. Exact memorization's mean over no token is NaN: null, as
    open-unlearning writes it (JSON has no NaN). Any other NaN stays, and `write_strict_json` names it."""
    return None if metric == "exact_memorization" and math.isnan(value) else round(value, 6)


def set_line(aggregates: dict) -> str:
    """A TOFU set's headline numbers, for the log."""
    tr = f", truth ratio {aggregates['truth_ratio']:.3f}" if "truth_ratio" in aggregates else ""
    rouge = f", ROUGE-L {aggregates['rouge_l_recall']:.3f}" if "rouge_l_recall" in aggregates else ""
    return (f"ES {aggregates['extraction_strength']:.3f}{rouge}, prob {aggregates['probability']:.3f}{tr}, "
            f"n {aggregates['n']}")
