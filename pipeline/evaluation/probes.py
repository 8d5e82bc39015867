"""Probes of whether knowledge is gone or only hidden: the forget answers asked another way (TOFU's paraphrased
questions), and the cheap evaluation repeated after each attack (quantization here, relearning in its own stage).

A method that broke only one surface form shows it here: its forget ES falls on the questions it was trained on
but not on their paraphrases, or its multiple-choice accuracy falls in one scoring and not the other.
"""

from __future__ import annotations

import logging
from typing import Sequence

import numpy as np

from pipeline.common.errors import DataError
from pipeline.data.mc_items import MCItem
from pipeline.data.templates import PromptTemplate
from pipeline.evaluation.config import EvalConfig
from pipeline.evaluation.generation import greedy_answers
from pipeline.evaluation.mc_scoring import evaluate_mc
from pipeline.evaluation.tofu_metrics import answer_statistics, rouge_references, rouge_scores

log = logging.getLogger(__name__)

PROBED_SETS = ("forget", "retain")  # the TOFU sets whose rows have paraphrased questions


def answer_metrics(model, tokenizer, template: PromptTemplate, questions: Sequence[str], answers: Sequence[str],
                   cfg: EvalConfig) -> dict[str, np.ndarray | list]:
    """Per item: extraction strength and exact memorization of the answer given each question, and the ROUGE-L
    recall of the greedy answer, as the TOFU metrics compute them."""
    stats = answer_statistics(model, tokenizer, template, questions, answers, cfg.batch_size, cfg.es_definition,
                              cfg.loss_dtype)
    generated = greedy_answers(model, tokenizer, template, list(questions), max_new_tokens=cfg.max_new_tokens,
                               batch_size=cfg.batch_size)
    truths = rouge_references(tokenizer, template, questions, answers)[1]
    rouge = np.array([rouge_scores(g, t)["rougeL_recall"] for g, t in zip(generated, truths)])
    return {"extraction_strength": stats.extraction_strength, "exact_memorization": stats.exact_memorization,
            "rouge_l_recall": rouge, "generated": generated}


def paraphrased_questions(rows: Sequence[dict], where: str) -> list[str]:
    for i, row in enumerate(rows, start=1):
        if not isinstance(row.get("paraphrased_question"), str) or not row["paraphrased_question"].strip():
            raise DataError(f"{where}: row {i}: no 'paraphrased_question' (evaluate.paraphrase needs TOFU's "
                            "paraphrased questions; set it false for data without them)")
    return [r["paraphrased_question"] for r in rows]


def paraphrase_items(model, tokenizer, template: PromptTemplate, rows: Sequence[dict], cfg: EvalConfig,
                     where: str) -> list[dict]:
    """Per row, the answer's ES, EM and ROUGE when the question is its paraphrase (columns `para_*` of the items)."""
    m = answer_metrics(model, tokenizer, template, paraphrased_questions(rows, where), [r["answer"] for r in rows],
                       cfg)
    return [{"para_extraction_strength": float(m["extraction_strength"][i]),
             "para_exact_memorization": None if np.isnan(m["exact_memorization"][i])
             else float(m["exact_memorization"][i]),
             "para_rouge_l_recall": float(m["rouge_l_recall"][i]), "para_generated": m["generated"][i]}
            for i in range(len(rows))]


def _mean(values) -> float | None:
    """The mean over the values present, rounded; None where there are none (EM of answers without tokens): the
    summary is JSON, which has no NaN."""
    values = np.asarray(values, dtype=np.float64)
    values = values[~np.isnan(values)]
    return round(float(values.mean()), 6) if values.size else None


def probe(model, tokenizer, template: PromptTemplate, tofu: dict[str, tuple[str, list[dict]]],
          mc: dict[str, tuple[dict, list[MCItem]]], cfg: EvalConfig) -> dict[str, float]:
    """The cheap evaluation repeated after an attack, on the sets of `evaluate.probe_sets` (all when empty): forget
    ES, EM and ROUGE-L recall (`forget_es`, `forget_em`, `forget_rouge`; with evaluate.paraphrase also
    `forget_para_es` and `forget_para_rouge`), retain ES and EM (did the attack break the model?), and each
    multiple-choice set's accuracy (`mc_<set>`)."""
    wanted = set(cfg.probe_sets or [*PROBED_SETS, *mc])
    out: dict[str, float] = {}
    if "forget" in tofu and "forget" in wanted:
        split, rows = tofu["forget"]
        m = answer_metrics(model, tokenizer, template, [r["question"] for r in rows], [r["answer"] for r in rows],
                           cfg)
        out |= {"forget_es": _mean(m["extraction_strength"]), "forget_em": _mean(m["exact_memorization"]),
                "forget_rouge": _mean(m["rouge_l_recall"])}
        if cfg.paraphrase:  # does the knowledge come back in another form
            para = paraphrase_items(model, tokenizer, template, rows, cfg, f"{cfg.source}/{split}")
            out |= {"forget_para_es": _mean([p["para_extraction_strength"] for p in para]),
                    "forget_para_rouge": _mean([p["para_rouge_l_recall"] for p in para])}
    if "retain" in tofu and "retain" in wanted:  # teacher forcing only: no generation
        rows = tofu["retain"][1]
        stats = answer_statistics(model, tokenizer, template, [r["question"] for r in rows],
                                  [r["answer"] for r in rows], cfg.batch_size, cfg.es_definition, cfg.loss_dtype)
        out |= {"retain_es": _mean(stats.extraction_strength), "retain_em": _mean(stats.exact_memorization)}
    for set_name, (spec, items) in mc.items():
        if set_name not in wanted:
            continue
        result = evaluate_mc(model, tokenizer, items, batch_size=cfg.mc_batch_size,
                             scoring=spec.get("scoring", "letter"), template=template,
                             add_bos_token=spec.get("add_bos_token"), max_length=spec.get("max_length"),
                             desc=f"multiple choice {set_name}")
        out[f"mc_{set_name}"] = round(result["accuracy"], 6)
    return out
