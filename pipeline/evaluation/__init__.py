"""Stage three, evaluation: the TOFU metrics, multiple choice (WMDP, MMLU, the world's sets), greedy generation,
evaluation of a model or of every seed of a run, and the report.

May use: `pipeline.common`, `pipeline.data`. It reads models and results from disk, never the trainer.
"""
