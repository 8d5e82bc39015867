"""CE-U (pipeline/training/methods/ceu.py) on a hand-computed case: the cross-entropy to θ's next-token
distribution with the true token's mass removed, and its gradient."""

import math

import pytest
import torch

from pipeline.training.methods.ceu import ceu_from_logits
from tests.conftest import LOG_HALF, LOG_QUARTER


def test_ceu_is_the_cross_entropy_to_the_distribution_without_the_true_token():
    # logits (ln 2, 0, 0): p = (1/2, 1/4, 1/4); y = 0, so q = (0, 1/2, 1/2) and ℓ = −2·(1/2)·ln(1/4) = ln 4
    logits = torch.tensor([[math.log(2), 0.0, 0.0]], requires_grad=True)
    loss = ceu_from_logits(logits, torch.tensor([0]))
    assert loss.item() == pytest.approx(math.log(4))
    loss.backward()
    # ∂ℓ/∂z_y = p_y, ∂ℓ/∂z_j = p_j − q_j = −p_j·p_y/(1 − p_y): bounded, and 0 once p_y is 0
    assert logits.grad[0].tolist() == pytest.approx([0.5, -0.25, -0.25])
    # another target: y = 1, q = (2/3, 0, 1/3): ℓ = −(2/3)·ln(1/2) − (1/3)·ln(1/4)
    assert ceu_from_logits(logits.detach(), torch.tensor([1])).item() == \
        pytest.approx(-(2 / 3) * LOG_HALF - (1 / 3) * LOG_QUARTER)
