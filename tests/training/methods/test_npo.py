"""NPO (pipeline/training/methods/npo.py) on hand-computed cases: its token loss and its loss of whole sequences."""

import math

import pytest
import torch

from pipeline.training.methods.npo import npo_sequence_loss, npo_token_loss
from tests.conftest import LOG_HALF, LOG_QUARTER


def test_npo_token_loss():
    # p = 0.5, p_ref = 0.25, β = 1: (2/1)·log(1 + 2) ; β = 0.5: 4·log(1 + √2)
    logp, ref = torch.tensor([[LOG_HALF]]), torch.tensor([[LOG_QUARTER]])
    assert npo_token_loss(logp, ref, beta=1.0).item() == pytest.approx(2 * math.log(3))
    assert npo_token_loss(logp, ref, beta=0.5).item() == pytest.approx(4 * math.log(1 + math.sqrt(2)))
    # at p = p_ref the loss is (2/β)·log 2
    assert npo_token_loss(ref, ref, beta=0.1).item() == pytest.approx(20 * math.log(2))


def test_npo_sequence_loss_sums_log_probabilities():
    logp = torch.tensor([[LOG_HALF, LOG_HALF, 0.0]])
    ref = torch.tensor([[LOG_QUARTER, LOG_HALF, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    # Σ(log p − log p_ref) = log 2; −(2/β)·log σ(−β·log 2) with β = 1: 2·log(1 + 2)
    assert npo_sequence_loss(logp, ref, mask, beta=1.0).item() == pytest.approx(2 * math.log(3))
