"""Stage one, token attribution: noun tagging, masking, the two forward passes of the original model, the
per-token signals Δ, H and φ, their Parquet shards, the weights ω that φ gives (for stage two and for
inspection), quality against ground truth, and the terminal and HTML views.

May use: `pipeline.common`, `pipeline.data`. Never the trainer: r and τ are not stage one's params.
"""
