"""Data: the embedded fictitious world, TOFU-format loading and validation, the multiple-choice benchmarks' loaders
(WMDP, MMLU, the world's own sets: one module each, over `mc_items.MCItem`), MUSE's layout, prompt templates and
tokenization, and batching (padding and the step schedule that makes resumed and multi-process runs see the same
batches).

May use: `pipeline.common`.
"""
