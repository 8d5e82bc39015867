"""Stage three, evaluation: the TOFU metrics, multiple-choice scoring (WMDP, MMLU, the world's sets; their loaders
are `pipeline.data`'s), any lm-evaluation-harness task run by lm-eval, MUSE's metrics, greedy generation, evaluation
of a model or of every seed of a run, the registry of the metrics; and whether
knowledge is gone or only hidden: membership inference and privleak, the paraphrase probe, the quantization attack,
the probes after an attack that retrains the model (relearning: the attack itself is the trainer's, handed in), and
the evaluation during training that the unlearning loop calls.

May use: `pipeline.common`, `pipeline.data`. It reads models and results from disk, never the trainer.
"""
