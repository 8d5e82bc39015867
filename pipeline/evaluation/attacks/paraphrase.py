"""The paraphrase probe: the forget and retain answers asked with TOFU's paraphrased questions, as per-item
`para_*` columns of the sets' items, the sets' means and `forget_para_es`, `forget_para_rouge` (retain_ too) beside
forget_es. A method that broke only the questions it was trained on shows it here (`probes.py`)."""

from __future__ import annotations

import logging
import statistics

from pipeline.evaluation.config import EvalConfig
from pipeline.evaluation.evaluator import Context, Evaluator, Part
from pipeline.evaluation.probes import PROBED_SETS, paraphrase_items
from pipeline.evaluation.registry import PARAPHRASE

log = logging.getLogger(__name__)


class Paraphrase(Evaluator):
    name, benchmark = "paraphrase", PARAPHRASE

    def enabled(self, cfg: EvalConfig) -> bool:
        return cfg.paraphrase

    def run(self, model, ctx: Context) -> Part:
        cfg, summary = ctx.cfg, {}
        for name in PROBED_SETS:
            if name not in ctx.inputs.tofu:
                continue
            split, rows = ctx.inputs.tofu[name]
            para = paraphrase_items(model, ctx.tokenizer, ctx.template, rows, cfg, f"{cfg.source}/{split}")
            for record, columns in zip(ctx.items[name], para):
                record.update(columns)
            es = round(statistics.fmean(p["para_extraction_strength"] for p in para), 6)
            rouge = round(statistics.fmean(p["para_rouge_l_recall"] for p in para), 6)
            summary[name] = {"para_extraction_strength": es, "para_rouge_l_recall": rouge}
            summary[f"{name}_para_es"], summary[f"{name}_para_rouge"] = es, rouge
        probed = [f"{name} ES {summary[f'{name}_para_es']:.3f}, ROUGE-L {summary[f'{name}_para_rouge']:.3f}"
                  for name in PROBED_SETS if f"{name}_para_es" in summary]
        if probed:
            log.info("paraphrased questions: %s", "; ".join(probed))
        return Part(summary)
