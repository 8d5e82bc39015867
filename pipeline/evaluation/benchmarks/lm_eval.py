"""lm-evaluation-harness's own tasks (`evaluate.lm_eval`) on the loaded model: `lmeval_<task>_<metric>` keys, every
task's numbers under `lm_eval`, and lm-eval's results and samples in `lm_eval/` (`lm_eval_tasks.py`)."""

from __future__ import annotations

from pipeline.evaluation import lm_eval_tasks
from pipeline.evaluation.config import EvalConfig
from pipeline.evaluation.evaluator import Context, Evaluator, Part
from pipeline.evaluation.registry import LM_EVAL


class LMEval(Evaluator):
    name, benchmark = "lm_eval", LM_EVAL

    def enabled(self, cfg: EvalConfig) -> bool:
        return cfg.lm_eval_spec is not None

    def run(self, model, ctx: Context) -> Part:
        cfg = ctx.cfg
        run = lm_eval_tasks.run_tasks(model, ctx.model_path, cfg.lm_eval_spec, cfg.mc_batch_size,
                                      cfg.trust_remote_code)
        return Part({**run.metrics, "lm_eval": run.summary},
                    {"lm_eval": lambda path: lm_eval_tasks.write_outputs(path, run)})
