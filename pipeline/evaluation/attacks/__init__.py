"""The attacks that ask whether knowledge is gone or only hidden, one module each: the paraphrase probe, membership
inference, quantization (evaluators of one loaded model, `evaluation/evaluator.py`) and relearning (the probes
around an attack that retrains the model)."""
