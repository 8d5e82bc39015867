"""TokenUnlearn: token-level attribution for precise LLM unlearning.

The library, one subpackage per stage of the pipeline; data flows one way:

    data ──► attribution (stage one) ──► training (stage two) ──► evaluation (stage three)
    common: errors, params, atomic writes and output locks, models and tokenizers, the process group

`stages/` holds the thin command-line entry points that DVC calls.
"""

__version__ = "0.1.0"
