"""IdkNLL (pipeline/training/methods/idknll.py) on a hand-computed case: each sample's mean NLL of its "I don't
know" answer, the forget answer unread."""

import math

import pytest
import torch

from pipeline.training.methods import METHODS, ForwardOut
from pipeline.training.methods.idknll import idk_nll
from tests.conftest import LOG_HALF, LOG_QUARTER


def test_idknll_is_each_samples_mean_nll_of_its_idk_answer():
    # p = (1/2, 1/8): mean NLL (0.693147 + 2.079442)/2 = 1.386294 (methods_spec §7); a second sample with one token
    logp = torch.tensor([[0.0, LOG_HALF, math.log(0.125)], [0.0, LOG_QUARTER, 0.0]])
    scored = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    assert idk_nll(logp[:1], scored[:1]).item() == pytest.approx(1.386294, abs=1e-6)
    assert idk_nll(logp, scored).item() == pytest.approx((1.386294 + math.log(4)) / 2, abs=1e-6)
    out = ForwardOut(None, None, None, logp)
    assert METHODS["idknll"].sequence_loss(out, {"alternative": {"scored": scored}}, None).item() == \
        pytest.approx(idk_nll(logp, scored).item())
