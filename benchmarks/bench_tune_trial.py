"""A tuning trial's evaluation (`tune_runs.trial_eval_config`: the TOFU sets, the forget set without its greedy
answers, no multiple choice) against what every trial evaluated before it (the whole evaluation but membership
inference, the paraphrases and quantization):
the seconds of each on one model, interleaved, and the numbers the choice reads from both, which must be equal.

Give an unlearned model: a target stops at the end of each forget answer, an unlearned one often talks on to
max_new_tokens, so the forget generation a trial no longer makes costs more there.

    cd experiments && python ../benchmarks/bench_tune_trial.py --params ../configs/paper.yaml \\
        --overlay ../configs/tofu-small.yaml --overlay ../configs/ladder-3m.yaml --overlay ../configs/seeds.yaml \\
        --overlay ../configs/ladder.yaml --model artifacts/ladder/3m/m0/unlearn/ga/seed1/model \\
        --retain-results artifacts/ladder/3m/m0/eval/retain            # real TOFU, the 3.67M rung
    python benchmarks/bench_tune_trial.py --model artifacts/unlearn/npo/seed0/model   # the demo's, after make demo
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pipeline.common.params import load_params  # noqa: E402
from pipeline.evaluation.config import eval_config  # noqa: E402
from pipeline.evaluation.evaluate import evaluate_model  # noqa: E402
from pipeline.evaluation.inputs import load_inputs  # noqa: E402
from pipeline.studies.tune_runs import trial_eval_config  # noqa: E402

CHOICE_KEYS = ("forget_es", "retain_es", "model_utility", "log10_forget_quality")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--overlay", action="append", default=[])
    parser.add_argument("-S", "--set", dest="settings", action="append", default=[])
    parser.add_argument("--model", required=True, help="an unlearned model's directory")
    parser.add_argument("--retain-results", default="artifacts/eval/retain", help="the retain model's evaluation")
    parser.add_argument("--utility", default="model_utility", help="tune.utility")
    parser.add_argument("--repeat", type=int, default=2, help="rounds, each both evaluations one after the other")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    params = load_params(args.params, args.overlay, args.settings)
    retain = Path(args.retain_results) if args.retain_results else None
    configs = {"before": replace(eval_config(params), mia={}, paraphrase=False, quantize={}),
               "trial": trial_eval_config(params, args.utility)}
    inputs = {name: load_inputs(cfg, retain) for name, cfg in configs.items()}
    seconds: dict[str, list[float]] = {name: [] for name in configs}
    summaries: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.repeat):
            order = list(configs) if round_ % 2 == 0 else list(configs)[::-1]  # interleaved, each first in turn
            for name in order:
                start = time.perf_counter()
                summaries[name] = evaluate_model(args.model, configs[name], Path(tmp) / f"{name}{round_}", retain,
                                                 inputs[name])
                seconds[name].append(time.perf_counter() - start)
    before, trial = (statistics.median(seconds[n]) for n in ("before", "trial"))
    print(f"model {args.model}, {args.repeat} rounds interleaved")
    for name in configs:
        print(f"  {name:6s} evaluation: median {statistics.median(seconds[name]):.1f} s "
              f"({', '.join(f'{s:.1f}' for s in seconds[name])})")
    print(f"  a trial's evaluation takes {trial / before:.2f} of what it took ({before / trial:.2f}x faster)")
    keys = [k for k in (*CHOICE_KEYS, args.utility) if k in summaries["before"]]
    same = all(summaries["before"][k] == summaries["trial"].get(k) for k in keys)
    print(f"  the choice's numbers ({', '.join(dict.fromkeys(keys))}): {'equal' if same else 'DIFFERENT'}")
    if not same:
        print(f"    before {[summaries['before'][k] for k in keys]}, trial {[summaries['trial'].get(k) for k in keys]}")
        raise SystemExit(1)


if __name__ == "__main__":
    from pipeline.common.cli_errors import run_script  # as the CLI: one line per error, an exit status
    run_script(main)
