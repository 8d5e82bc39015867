"""GradDiff: GA on the forget set plus NLL on the retain set, equally weighted (open-unlearning's GradDiff: gamma =
alpha = 1). The retain term is the loop's `nll`, taken unless a run sets `retain_loss` or `retain_weight` itself."""

from __future__ import annotations

from pipeline.training.methods import ga
from pipeline.training.methods.base import Method

METHOD = Method("graddiff", ga.token_loss, own_retain=("nll", 1.0), title="GradDiff")
