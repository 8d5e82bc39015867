"""The sampling attack (`evaluate.sampling`): a model that no longer says the answer greedily may still say it in 1 of
20 samples. For each forget question, max(k) answers are sampled (temperature and top-p of the spec, no top-k cut);
a sample leaks when it says the fact: on data with fact annotations (the embedded world's annotations.json) when it
contains every fact span of the answer (case and spacing aside); elsewhere (TOFU) when its ROUGE-L recall of the
answer is at least `rouge_threshold`. leak@k is the share of questions where one of the first k samples leaks,
`leak_at_<k>` in the summary, each question's samples and verdicts in `sampling/forget.parquet`."""

from __future__ import annotations

import logging
import re

import pyarrow.parquet as pq

from pipeline.data.annotations import qa_facts
from pipeline.evaluation import eval_io
from pipeline.evaluation.config import EvalConfig
from pipeline.evaluation.evaluator import Context, Evaluator, Part
from pipeline.evaluation.generation import sampled_answers
from pipeline.evaluation.registry import SAMPLING
from pipeline.evaluation.tofu_metrics import rouge_l_recall

log = logging.getLogger(__name__)


def _normal(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def says_facts(sample: str, facts: list[str]) -> bool:
    """Whether `sample` contains every fact (case and runs of whitespace aside)."""
    said = _normal(sample)
    return all(_normal(f) in said for f in facts)


def leaks(sample: str, answer: str, facts: list[str] | None, rouge_threshold: float) -> bool:
    """A sample says the answer's facts: every annotated fact span's text where there are some, else ROUGE-L
    recall of the answer ≥ `rouge_threshold`."""
    if facts:
        return says_facts(sample, facts)
    return rouge_l_recall(sample, answer) >= rouge_threshold


def leak_at(leaked: list[list[bool]], k: int) -> float:
    """The share of questions where one of the first k samples leaks."""
    return sum(any(row[:k]) for row in leaked) / len(leaked)


class Sampling(Evaluator):
    name, benchmark = "sampling", SAMPLING

    def enabled(self, cfg: EvalConfig) -> bool:
        return bool(cfg.sampling)

    def prepare(self, ctx: Context) -> None:
        """The forget answers' fact texts, where the data has annotations (else the ROUGE rule)."""
        spans = qa_facts(ctx.cfg.source)  # None: a source without annotations.json (TOFU, a hub name)
        rows = ctx.inputs.tofu["forget"][1]
        self.facts = [[r["answer"][a:b] for a, b in spans[r["question"]]] if spans and r["question"] in spans
                      else None for r in rows]

    def run(self, model, ctx: Context) -> Part:
        cfg, spec = ctx.cfg, ctx.cfg.sampling_spec
        split, rows = ctx.inputs.tofu["forget"]
        n = max(spec.k)
        samples = sampled_answers(model, ctx.tokenizer, ctx.template, [r["question"] for r in rows], n,
                                  spec.temperature, spec.top_p, spec.max_new_tokens or cfg.max_new_tokens,
                                  cfg.batch_size, spec.seed)
        leaked = [[leaks(s, r["answer"], facts, spec.rouge_threshold) for s in row_samples]
                  for r, facts, row_samples in zip(rows, self.facts, samples)]
        rule = "fact" if any(self.facts) else "rouge"
        summary = {f"leak_at_{k}": round(leak_at(leaked, k), 6) for k in sorted(spec.k)}
        summary["sampling"] = {"k": sorted(spec.k), "temperature": spec.temperature, "top_p": spec.top_p,
                               "seed": spec.seed, "rule": rule,
                               **({"rouge_threshold": spec.rouge_threshold} if rule == "rouge" else {})}
        records = [{"question": r["question"], "answer": r["answer"], "facts": facts, "samples": s, "leaked": lk}
                   for r, facts, s, lk in zip(rows, self.facts, samples, leaked)]
        table = eval_io.item_table(records, {"split": split, **summary["sampling"]})
        log.info("sampling attack (%s, %d samples at T=%g): %s", rule, n, spec.temperature,
                 ", ".join(f"leak@{k} {summary[f'leak_at_{k}']:.3f}" for k in sorted(spec.k)))
        return Part(summary, {"sampling/forget.parquet": lambda path: pq.write_table(table, path,
                                                                                        compression="zstd")})
