"""Stage two, training: the DeepSpeed engine, every loss as a pure function, finetuning (the base, target and
retain models), the forget stream from stage one's shards, unlearning, and learning-rate tuning.

May use: `pipeline.common`, `pipeline.data`, `pipeline.attribution` (its shards and weights).
"""
