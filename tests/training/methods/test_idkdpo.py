"""IdkDPO (pipeline/training/methods/idkdpo.py) on hand-computed cases: DPO with open-unlearning's 2/β, an "I don't
know" answer preferred to the forget answer, the token weights ω on the forget answer's term alone."""

import math

import pytest
import torch

from pipeline.training.methods import METHODS, ForwardOut
from pipeline.training.methods.idkdpo import dpo_loss, weighted_answer_logp
from pipeline.training.methods.idkdpo import sequence_loss as idkdpo_loss
from tests.conftest import LOG_HALF, LOG_QUARTER


def dpo_batch(weights):
    """The spec's example (methods_spec §6): forget answer p_θ = (1/2, 1/4), p_o = (4/5, 1/2), so Δ_l = −1.163151;
    the preferred answer log π_θ = −3 (three tokens), log π_o = −4, so Δ_w = 1. A padded third position."""
    out = ForwardOut(torch.tensor([[LOG_HALF, LOG_QUARTER, 0.0]]), None, None,
                     torch.tensor([[0.0, -1.0, -1.5, -0.5, 0.0]]))
    batch = {"weights": torch.tensor([weights]), "scored": torch.tensor([[1.0, 1.0, 0.0]]),
             "ref_logp": torch.tensor([[math.log(0.8), LOG_HALF, 0.0]]),
             "alternative": {"scored": torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0]]), "ref_logp": torch.tensor([-4.0])}}
    return out, batch


def test_dpo_with_open_unlearnings_two_over_beta():
    # Δ_w − Δ_l = 2.163151: −(2/β)·log σ(0.2163151) = 11.816546 (open-unlearning); without 2/β: 0.590827 (DPO paper)
    assert dpo_loss(torch.tensor([1.0]), torch.tensor([-1.1631508]), beta=0.1).item() == \
        pytest.approx(11.816546, abs=1e-5)
    assert dpo_loss(torch.tensor([1.0]), torch.tensor([-1.1631508]), beta=0.1).item() * 0.1 / 2 == \
        pytest.approx(0.590827, abs=1e-6)
    # θ = θ_o on both answers: (2/β)·ln 2, NPO's value at the start
    assert dpo_loss(torch.zeros(3), torch.zeros(3), beta=0.1).item() == pytest.approx(20 * math.log(2))
    # the mean over samples
    assert dpo_loss(torch.tensor([1.0, 0.0]), torch.tensor([-1.1631508, 0.0]), beta=0.1).item() == \
        pytest.approx((11.816546 + 20 * math.log(2)) / 2, abs=1e-5)


def test_idkdpo_prefers_the_alternative_and_weights_only_the_forget_answer():
    params = METHODS["idkdpo"].params()
    assert params.beta == 0.1  # open-unlearning's
    out, batch = dpo_batch([1.0, 1.0, 0.0])  # uniform: DPO itself, the sums of log p
    assert idkdpo_loss(out, batch, params).item() == pytest.approx(11.816546, abs=1e-5)
    # soft ω = (3/4, 1/4): S_ω = n·Σ ω log p / Σ ω on θ and θ_o alike, Δ_l = 2·(−0.866434 + 0.340644) = −1.051579
    out, batch = dpo_batch([0.75, 0.25, 0.0])
    assert idkdpo_loss(out, batch, params).item() == pytest.approx(11.916405, abs=1e-5)
    # hard ω = (1, 0): the first token's log-ratio, scaled to the answer's 2 tokens: Δ_l = 2·ln(0.5/0.8)
    out, batch = dpo_batch([1.0, 0.0, 0.0])
    assert idkdpo_loss(out, batch, params).item() == pytest.approx(12.016880, abs=1e-5)
    # the weights' scale does not matter (hard 1/r-style weights give the same loss)
    out, batch = dpo_batch([5.0, 0.0, 0.0])
    assert idkdpo_loss(out, batch, params).item() == pytest.approx(12.016880, abs=1e-5)


def test_weighted_answer_logp_is_the_sum_under_uniform_weights():
    logp = torch.tensor([[-1.0, -2.0, -3.0, 0.0], [-0.5, 0.0, 0.0, 0.0]])
    scored = torch.tensor([[1.0, 1, 1, 0], [1, 0, 0, 0]])
    assert weighted_answer_logp(logp, scored, scored).tolist() == pytest.approx([-6.0, -0.5])
    assert weighted_answer_logp(logp, torch.zeros(2, 4), scored).tolist() == [0.0, 0.0]  # no weight: no term
