"""MUSE's benchmark (`evaluate.muse`; the formulas: `muse.py`): VerbMem, KnowMem on forget and retain, utility
preserved and PrivLeak against the retain model, per item as `items/<set>.parquet`. Its summary is its own (its
privleak is MUSE's, not membership inference's on TOFU's forget set), so it runs in an evaluation of its own."""

from __future__ import annotations

import logging

import pyarrow.parquet as pq

from pipeline.evaluation import eval_io
from pipeline.evaluation.config import EvalConfig
from pipeline.evaluation.evaluator import Context, Evaluator, Part
from pipeline.evaluation.muse import score_muse
from pipeline.evaluation.registry import MUSE

log = logging.getLogger(__name__)


class Muse(Evaluator):
    name, benchmark = "muse", MUSE

    def enabled(self, cfg: EvalConfig) -> bool:
        return bool(cfg.muse)

    def run(self, model, ctx: Context) -> Part:
        spec = ctx.cfg.muse_spec
        summary, tables = score_muse(model, ctx.tokenizer, ctx.inputs.muse, spec.settings(), ctx.own_retain,
                                     spec.source)
        files = {f"items/{name}.parquet": lambda path, records=records: pq.write_table(
            eval_io.item_table(records, {"source": str(spec.source)}), path, compression="zstd")
            for name, records in tables.items()}
        log.info("MUSE %s: VerbMem %.2f, KnowMem forget %.2f, KnowMem retain %.2f, PrivLeak %s (AUC %.3f)",
                 ctx.model_path, summary["verbmem_f"], summary["knowmem_f"], summary["knowmem_r"],
                 "n/a" if summary["privleak"] is None else f"{summary['privleak']:.2f}",
                 summary["auc"][spec.attack])
        return Part({"tokenizer": str(ctx.cfg.tokenizer or ctx.model_path), **summary}, files)
