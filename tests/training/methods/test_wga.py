"""WGA (pipeline/training/methods/wga.py) on a hand-computed case: GA's log p scaled by a detached p^γ."""

import pytest
import torch

from pipeline.training.methods.wga import wga_token_loss
from tests.conftest import LOG_HALF, LOG_QUARTER


def test_wga_scales_each_tokens_log_probability_by_a_detached_p_to_the_gamma():
    logp = torch.tensor([[LOG_HALF, LOG_QUARTER]], requires_grad=True)
    wga = wga_token_loss(logp, gamma=1.0)
    assert wga[0].tolist() == pytest.approx([0.5 * LOG_HALF, 0.25 * LOG_QUARTER])
    wga.sum().backward()
    assert logp.grad[0].tolist() == pytest.approx([0.5, 0.25])  # the factor p^γ is detached
    expected = [0.25 * LOG_HALF, 0.0625 * LOG_QUARTER]
    assert wga_token_loss(logp.detach(), gamma=2.0)[0].tolist() == pytest.approx(expected)
