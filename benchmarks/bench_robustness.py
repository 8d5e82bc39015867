"""The cost of each robustness evaluation against the standard TOFU evaluation of the same model, in one run.

The standard evaluation is open-unlearning's TOFU one: the forget, retain, real-author and world-fact sets
(probabilities, truth ratios, greedy answers and ROUGE, ES, EM). Against it, in interleaved order per repeat:
  mia            membership inference: the forget set and the holdout set, all four attacks' scores
  paraphrase     forget and retain answers asked with the paraphrased questions (ES, EM, greedy answers, ROUGE)
  quantize_8     the weights rounded to 8 bits, the probes (evaluate.probe_sets), the weights restored
  quantize_4     the same at 4 bits
  relearn        the whole relearning stage of one model: the probes before, and two attacks of a few
                 finetuning steps (the DeepSpeed engine, in one process) each followed by the probes
  monitor        one evaluation during training (a subsample: forget ES, retain ES, MU's retain part), and
                 `monitor_per_run`: the evaluations one unlearning run of the embedded sweep makes (its steps /
                 unlearn.monitor.every, plus the first)
The sets, probes and attack settings are those of configs/paper.yaml (the paper's sweep, `make paper`).

    cd experiments   # the paper's sweep's outputs, and configs/paper.yaml's paths, are relative to it
    python ../benchmarks/bench_robustness.py                 # the paper's target (after `make paper`'s finetune@target)
    python ../benchmarks/bench_robustness.py --repeats 5 --model artifacts/paper/unlearn/ga/seed0/model
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pipeline.common.modeling import load_model, load_tokenizer  # noqa: E402
from pipeline.common.params import load_params  # noqa: E402
from pipeline.data.config import DataConfig  # noqa: E402
from pipeline.data.templates import get_template  # noqa: E402
from pipeline.evaluation.attacks.relearning import forget_probe  # noqa: E402
from pipeline.evaluation.config import eval_config  # noqa: E402
from pipeline.evaluation.inputs import load_inputs  # noqa: E402
from pipeline.evaluation.mia import membership_inference  # noqa: E402
from pipeline.evaluation.monitor import monitor_from_params  # noqa: E402
from pipeline.evaluation.probes import paraphrase_items, probe  # noqa: E402
from pipeline.evaluation.quantize import rtn_quantized  # noqa: E402
from pipeline.evaluation.tofu_sets import evaluate_set  # noqa: E402
from pipeline.training.relearn import relearn_config, relearning_attack  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="artifacts/paper/models/target")
    ap.add_argument("--params", default="../configs/paper.yaml")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: the tiny model's fastest)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    params = load_params(args.params)
    cfg = eval_config(params)
    inputs = load_inputs(cfg, None)
    tokenizer, template = load_tokenizer(args.model), get_template(cfg.template)
    model = load_model(args.model).eval()
    mia = cfg.mia_spec
    monitor = monitor_from_params(params)(tokenizer)
    relearn = functools.partial(relearning_attack, cfg=relearn_config(params),
                                data=DataConfig.from_params(params["data"]))
    probe_all = forget_probe(inputs, cfg, tokenizer)
    n_forget = len(inputs.tofu["forget"][1])

    def standard():
        for name, (split, rows) in inputs.tofu.items():
            evaluate_set(model, tokenizer, template, rows, name, cfg.batch_size, cfg.max_new_tokens,
                         es_definition=cfg.es_definition, loss_dtype=cfg.loss_dtype)

    def quantize(bits):
        with rtn_quantized(model, bits, cfg.quantize_spec.group_size):
            probe(model, tokenizer, template, inputs.tofu, inputs.mc, cfg)

    jobs = {
        "standard": standard,
        "mia": lambda: membership_inference(model, tokenizer, template, inputs.tofu["forget"][1], inputs.holdout[1],
                                            mia.attacks, mia.k, cfg.batch_size),
        "paraphrase": lambda: [paraphrase_items(model, tokenizer, template, inputs.tofu[s][1], cfg, s)
                               for s in ("forget", "retain")],
        "quantize_8": lambda: quantize(8),
        "quantize_4": lambda: quantize(4),
        "relearn": lambda: relearn(args.model, probe_all, n_forget),
        "monitor": lambda: monitor.evaluate(model, 0),
    }
    seconds = {name: [] for name in jobs}
    for _ in range(args.repeats):
        for name, job in jobs.items():  # interleaved: every job once before the next repeat
            start = time.perf_counter()
            job()
            seconds[name].append(time.perf_counter() - start)
    median = {name: sorted(v)[len(v) // 2] for name, v in seconds.items()}
    steps = _embedded_run_steps(params, len(inputs.tofu["forget"][1]))
    evaluations = steps // monitor.every + 1 + (steps % monitor.every > 0)
    ratio = {name: round(v / median["standard"], 3) for name, v in median.items() if name != "standard"}
    ratio["monitor_per_run"] = round(evaluations * median["monitor"] / median["standard"], 3)
    print(json.dumps({"model": args.model, "threads": args.threads, "repeats": args.repeats,
                      "standard_seconds": round(median["standard"], 3),
                      "seconds": {k: round(v, 3) for k, v in median.items()},
                      "time_over_standard": ratio, "monitor_evaluations_per_run": evaluations}, indent=2))


def _embedded_run_steps(params: dict, n_forget: int) -> int:
    """Optimizer steps of an unlearning run with `unlearn.train` (one process)."""
    train = params["unlearn"]["train"]
    per_epoch = math.ceil(n_forget / (train["micro_batch_size"] * train.get("grad_accum", 1)))
    return train.get("max_steps") or math.ceil(train["epochs"] * per_epoch)


if __name__ == "__main__":
    from pipeline.common.cli_errors import run_script  # as the CLI: one line per error, an exit status
    run_script(main)
