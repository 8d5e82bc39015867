"""Data: the embedded fictitious world, TOFU-format loading and validation, prompt templates and tokenization,
and batching (padding and the step schedule that makes resumed and multi-process runs see the same batches).

May use: `pipeline.common`.
"""
