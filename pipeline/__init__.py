"""TokenUnlearn: token-level attribution for precise LLM unlearning.

The library: data generation and loading, prompt templates, models, the DeepSpeed training engine.
`stages/` holds the thin command-line entry points that DVC calls.
"""

__version__ = "0.1.0"
