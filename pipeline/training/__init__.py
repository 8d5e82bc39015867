"""Stage two, training: the DeepSpeed engine, every loss as a pure function, finetuning (the base, target and
retain models), the forget stream from stage one's shards, unlearning (each method a module of `methods/`, with a
monitor handed in by the stage), and the relearning attack's finetuning.

May use: `pipeline.common`, `pipeline.data`, `pipeline.attribution` (its shards and weights).
"""
