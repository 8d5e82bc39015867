"""Importing trankit on the transformers it must run with.

trankit 1.1.2 does `from transformers import AdamW`, a name transformers 4.57 no longer has (and `adapters`,
which trankit needs, pins transformers~=4.57.6). We supply torch's AdamW under that name. Setting it before
the first model import is not enough: transformers swaps its lazy module object in `sys.modules` when a model
class is first imported, so a model class is imported first and the name is set on the module that stays.
"""

from __future__ import annotations

import sys


def import_trankit():
    """Return the `trankit` module, importable on transformers 4.57."""
    import torch
    from transformers import XLMRobertaModel  # noqa: F401  (settles transformers' module object)

    transformers = sys.modules["transformers"]
    if not hasattr(transformers, "AdamW"):
        transformers.AdamW = torch.optim.AdamW
    import trankit

    return trankit
