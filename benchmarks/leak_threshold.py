"""The sampling attack's ROUGE rule on TOFU, calibrated: how often a wrong or a right answer passes each threshold.

Where the data has no fact annotations (TOFU), a sampled answer leaks when its ROUGE-L recall of the gold answer is
at least `evaluate.sampling.rouge_threshold`. leak@20 reads 20 samples, so a per-sample false-leak rate f gives up to
1 − (1 − f)^20 on a model that only ever says wrong facts. This prints, for each threshold, the share of TOFU's
perturbed answers (the right template, a wrong fact), of the questions themselves (a model repeating the question)
and of the paraphrased answers (the right fact, other words) that pass it, and that worst-case leak@20:

    python benchmarks/leak_threshold.py                        # ../shared/data/tofu, forget10
    python benchmarks/leak_threshold.py --source DIR --split forget05
"""

from __future__ import annotations

import argparse
import logging

import numpy as np

from pipeline.data.tofu import load_split
from pipeline.evaluation.tofu_metrics import rouge_l_recall

log = logging.getLogger("leak_threshold")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", default="../shared/data/tofu", help="TOFU's splits (a directory or hub name)")
    parser.add_argument("--split", default="forget10", help="the forget split (its _perturbed split is read)")
    parser.add_argument("--thresholds", type=float, nargs="+", default=[0.4, 0.5, 0.6, 0.7, 0.8])
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rows = load_split(args.source, f"{args.split}_perturbed")
    wrong = np.array([rouge_l_recall(x, r["answer"]) for r in rows for x in r["perturbed_answer"]])
    question = np.array([rouge_l_recall(r["question"], r["answer"]) for r in rows])
    right = np.array([rouge_l_recall(r["paraphrased_answer"], r["answer"]) for r in rows])
    log.info("%s/%s_perturbed: %d questions, %d perturbed answers", args.source, args.split, len(rows), len(wrong))
    log.info("| threshold | wrong fact passes | question repeated passes | paraphrased right answer passes | "
             "leak@20 of wrong facts |\n|---|---|---|---|---|")
    for t in args.thresholds:
        f = float(np.mean(wrong >= t))
        log.info("| %.2f | %.3f | %.3f | %.3f | %.3f |", t, f, np.mean(question >= t), np.mean(right >= t),
                 1 - (1 - f) ** 20)


if __name__ == "__main__":
    from pipeline.common.cli_errors import run_script  # as the CLI: one line per error, an exit status
    run_script(main)
