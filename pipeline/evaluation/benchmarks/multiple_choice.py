"""Multiple choice (`evaluate.multiple_choice`: WMDP, MMLU, the world's sets): each set's accuracy as `mc_<set>`,
per subject under `multiple_choice.<set>`, and per item as `mc/<set>.parquet` (the scoring: `mc_scoring.py`)."""

from __future__ import annotations

import logging

import pyarrow.parquet as pq

from pipeline.evaluation import eval_io
from pipeline.evaluation.config import EvalConfig
from pipeline.evaluation.evaluator import Context, Evaluator, Part
from pipeline.evaluation.mc_scoring import evaluate_mc
from pipeline.evaluation.registry import MULTIPLE_CHOICE

log = logging.getLogger(__name__)


class MultipleChoice(Evaluator):
    name, benchmark = "multiple_choice", MULTIPLE_CHOICE

    def enabled(self, cfg: EvalConfig) -> bool:
        return bool(cfg.multiple_choice)

    def run(self, model, ctx: Context) -> Part:
        cfg, summary, files, accuracy = ctx.cfg, {}, {}, {}
        for set_name, (spec, items) in ctx.inputs.mc.items():
            scoring = spec.get("scoring", "letter")
            result = evaluate_mc(model, ctx.tokenizer, items, batch_size=cfg.mc_batch_size, scoring=scoring,
                                 template=ctx.template, add_bos_token=spec.get("add_bos_token"),
                                 max_length=spec.get("max_length"), desc=f"multiple choice {set_name}")
            table = eval_io.item_table(result["records"], {"scoring": scoring})
            files[f"mc/{set_name}.parquet"] = lambda path, table=table: pq.write_table(table, path,
                                                                                       compression="zstd")
            summary[f"mc_{set_name}"] = round(result["accuracy"], 6)  # overall accuracy: the report's column
            # Per subject (MMLU's 57) and how it was scored; not an `mc_` key, which the report makes a column of.
            summary.setdefault("multiple_choice", {})[set_name] = {
                "n": result["n"], "accuracy": round(result["accuracy"], 6), "scoring": scoring,
                "add_bos_token": spec.get("add_bos_token"), "max_length": result["max_length"],
                "by_subject": {s: {"n": g["n"], "accuracy": round(g["accuracy"], 6)}
                               for s, g in result["by_subject"].items()}}
            accuracy[set_name] = result["accuracy"]
            log.debug("multiple choice %s: %s", set_name, summary["multiple_choice"][set_name])
        # One line per entry of evaluate.multiple_choice, its sets named without the entry's name (world_forget: forget)
        for name, spec in cfg.multiple_choice.items():
            sets = [s for s in accuracy if ctx.inputs.mc[s][0] is spec]
            if sets:
                log.info("multiple choice %s (%s): %s", name, spec.get("scoring", "letter"), ", ".join(
                    f"{s.removeprefix(name + '_')} {accuracy[s]:.3f}" for s in sets))
        return Part(summary, files)
