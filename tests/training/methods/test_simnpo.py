"""SimNPO (pipeline/training/methods/simnpo.py) on hand-computed cases: NPO without a reference, on each sample's
ω-weighted mean NLL, with the margin δ inside β."""

import math

import pytest
import torch

from pipeline.training.methods.simnpo import simnpo_sequence_loss
from tests.conftest import LOG_HALF, LOG_QUARTER


def test_simnpo_on_the_mean_nll_with_the_margin_inside_beta():
    # p = 1/2, 1/4: mean NLL m = (3/2)·ln 2 = 1.039721; L = −(2/β)·log σ(β·(m − δ)) = (2/β)·log(1 + e^{−β(m − δ)})
    logp = torch.tensor([[LOG_HALF, LOG_QUARTER, 0.0]])
    scored = torch.tensor([[1.0, 1.0, 0.0]])  # uniform weights: 1 on the scored tokens
    m = 1.5 * math.log(2)
    assert simnpo_sequence_loss(logp, scored, beta=1.0).item() == pytest.approx(2 * math.log(1 + 2 ** -1.5))
    assert simnpo_sequence_loss(logp, scored, beta=1.0).item() == pytest.approx(0.605467, abs=1e-6)
    assert simnpo_sequence_loss(logp, scored, beta=4.5).item() == pytest.approx(0.004110, abs=1e-6)
    # δ = 1: the authors' and open-unlearning's β·(m − δ) gives 0.270117; the paper's β·m − γ (γ = 1) would give
    # 0.011085 (open-unlearning issue #123)
    assert simnpo_sequence_loss(logp, scored, beta=4.5, delta=1.0).item() == \
        pytest.approx((2 / 4.5) * math.log(1 + math.exp(-4.5 * (m - 1.0))))
    assert simnpo_sequence_loss(logp, scored, beta=4.5, delta=1.0).item() == pytest.approx(0.270117, abs=1e-6)
    # soft weights (0.75, 0.25): m_ω = 0.75·ln 2 + 0.25·ln 4 = 0.866434
    soft = torch.tensor([[0.75, 0.25, 0.0]])
    assert simnpo_sequence_loss(logp, soft, beta=4.5).item() == pytest.approx(0.008916, abs=1e-6)
    # hard weights on the second token only: m_ω = ln 4; a sample with no weight is left out of the batch mean
    hard = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    assert simnpo_sequence_loss(logp.expand(2, 3), hard, beta=1.0).item() == pytest.approx(2 * math.log(1 + 1 / 4))
    # a batch: the mean over samples of the per-sample losses
    two = torch.tensor([[LOG_HALF, LOG_QUARTER, 0.0], [LOG_HALF, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert simnpo_sequence_loss(two, mask, beta=1.0).item() == \
        pytest.approx((2 * math.log(1 + 2 ** -1.5) + 2 * math.log(1.5)) / 2)
