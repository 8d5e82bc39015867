"""The common ground of every stage: user-facing errors, params, atomic writes and output locks, loading and
saving models and tokenizers (and the hashes that identify them), the process group, paths and plots.

May use: nothing else in `pipeline` (every stage may use this package).
"""
