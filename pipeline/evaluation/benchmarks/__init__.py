"""The benchmarks, one evaluator each (`evaluation/evaluator.py`): TOFU's sets, multiple choice, lm-eval's tasks."""
