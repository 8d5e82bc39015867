"""SatImp (pipeline/training/methods/satimp.py) on a hand-computed case: each token's log p scaled by the detached
factor p^β1·(1 − p)^β2."""

import pytest
import torch

from pipeline.training.methods.satimp import satimp_token_loss
from tests.conftest import LOG_HALF, LOG_QUARTER


def test_satimp_scales_each_tokens_log_probability_by_a_detached_factor():
    # p = 1/2, 1/4, β1 = 5, β2 = 1: factors p^5·(1 − p) = 0.015625 and 0.000732422
    logp = torch.tensor([[LOG_HALF, LOG_QUARTER]], requires_grad=True)
    loss = satimp_token_loss(logp, beta1=5.0, beta2=1.0)
    assert loss[0].tolist() == pytest.approx([0.015625 * LOG_HALF, 0.25 ** 5 * 0.75 * LOG_QUARTER])
    assert loss.mean().item() == pytest.approx(-0.005923, abs=1e-6)  # open-unlearning's pooled mean
    loss.sum().backward()
    assert logp.grad[0].tolist() == pytest.approx([0.015625, 0.25 ** 5 * 0.75])  # no gradient through the factor
    # β1 = 1, β2 = 0: WGA with γ = 1; β1 = β2 = 0: GA
    assert satimp_token_loss(logp.detach(), 1.0, 0.0)[0].tolist() == pytest.approx([0.5 * LOG_HALF,
                                                                                     0.25 * LOG_QUARTER])
    assert satimp_token_loss(logp.detach(), 0.0, 0.0)[0].tolist() == pytest.approx([LOG_HALF, LOG_QUARTER])
