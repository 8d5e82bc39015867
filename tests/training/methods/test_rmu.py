"""RMU (pipeline/training/methods/rmu.py) on a hand-computed case: the squared distance of each token's hidden state
to the control vector c·u, the mean over the hidden dimensions."""

import pytest
import torch

from pipeline.training.methods.rmu import rmu_token_loss


def test_rmu_token_loss():
    hidden = torch.tensor([[[1.0, 2.0], [0.0, 0.0]]])
    control = torch.tensor([3.0, 0.0])
    assert rmu_token_loss(hidden, control)[0].tolist() == pytest.approx([(4 + 4) / 2, (9 + 0) / 2])
