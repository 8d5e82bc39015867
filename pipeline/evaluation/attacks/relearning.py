"""The evaluation side of attacks that change the model: each seed's model attacked (by a function the caller
gives: the relearning attack of the training package) and probed before and after, into one summary.

Output: `out_dir/seed{S}.json` per model (every attack's rows, steps, loss and probe) and the summary (also
`metrics_file`, a DVC metrics file) with, per probe key K of `probes.probe` (forget_es, forget_rouge, mc_*):
`before_K` and `<attack>_K` (relearned on that attack's rows), as mean and `_std` over the unlearning seeds.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

from pipeline.common.atomic import atomic_dir
from pipeline.evaluation.eval_io import write_strict_json
from pipeline.common.errors import ParamError
from pipeline.common.modeling import load_tokenizer
from pipeline.common.runs import complete_seeds, is_run_dir
from pipeline.data.templates import get_template
from pipeline.evaluation.config import EvalConfig
from pipeline.evaluation.evaluate import aggregate_seeds
from pipeline.evaluation.inputs import EvalInputs, load_inputs
from pipeline.evaluation.probes import probe

log = logging.getLogger(__name__)

Probe = Callable[[object, list[int]], dict]
Attack = Callable[[str, Probe, int], dict]  # (model path, probe, number of forget rows) -> results


def forget_probe(inputs: EvalInputs, cfg: EvalConfig, tokenizer) -> Probe:
    """`probes.probe` on the chosen forget rows (the retain and multiple-choice sets whole)."""
    template = get_template(cfg.template)

    def run(model, forget_rows: list[int]) -> dict:
        tofu = dict(inputs.tofu)
        split, rows = tofu["forget"]
        tofu["forget"] = (split, [rows[i] for i in forget_rows])
        return probe(model, tokenizer, template, tofu, inputs.mc, cfg)

    return run


def flat_results(results: dict) -> dict:
    """`before_K` and `<attack>_K` of each probe key K, from one model's results."""
    flat = {f"before_{k}": v for k, v in results["before"].items()}
    for name, attack in results.items():
        if isinstance(attack, dict) and "probe" in attack:
            flat |= {f"{name}_{k}": v for k, v in attack["probe"].items()}
            flat[f"{name}_final_loss"] = attack["final_loss"]
    return flat


def evaluate_attack(model_path: str, attack: Attack, cfg: EvalConfig, out_dir: Path,
                    metrics_file: Path | None = None, name: str = "NAME") -> dict:
    """Attack and probe a model, or each seed of a complete unlearning run; write `out_dir` (atomically) and the
    summary."""
    if "forget" not in cfg.tofu_sets:
        raise ParamError("evaluate.tofu_sets: the attacks are probed on the forget set; add forget to it")
    models = complete_seeds(Path(model_path), name) if is_run_dir(Path(model_path)) else {0: Path(model_path)}
    inputs = load_inputs(cfg, None)  # every input checked before the first model loads
    per_seed = {}
    with atomic_dir(out_dir) as tmp:
        for seed, model in models.items():
            probe_fn = forget_probe(inputs, cfg, load_tokenizer(str(model), cfg.trust_remote_code))
            results = attack(str(model), probe_fn, len(inputs.tofu["forget"][1]))
            write_strict_json(tmp / f"seed{seed}.json", {"model": str(model), **results})
            per_seed[seed] = flat_results(results)
        summary = {"model": str(model_path), **aggregate_seeds(per_seed)}
        write_strict_json(tmp / "metrics.json", summary)
    if metrics_file is not None:
        write_strict_json(metrics_file, summary)
    return summary
