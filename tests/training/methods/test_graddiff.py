"""GradDiff (pipeline/training/methods/graddiff.py) on a hand-computed case: GA on the forget answer plus its own
retain term, NLL with λ = 1, here on the toy LM of tests/training/test_retain_terms.py."""

import math

import pytest
import torch

from pipeline.training.losses import weighted_sample_mean
from pipeline.training.methods import METHODS, ForwardOut
from pipeline.training.retain_terms import RETAIN_LOSSES
from tests.conftest import LOG_HALF, LOG_QUARTER
from tests.training.test_retain_terms import BATCH, CFG, THETA, ToyLM


def test_graddiff_is_ga_on_the_forget_answer_plus_the_retain_nll_at_weight_one():
    graddiff = METHODS["graddiff"]
    # the forget answer at p = (1/2, 1/4) under uniform weights: GA's mean log p, −(3/2)·ln 2
    logp = torch.tensor([[LOG_HALF, LOG_QUARTER]])
    token_loss = graddiff.token_loss(ForwardOut(logp=logp), {}, graddiff.params())
    forget = weighted_sample_mean(token_loss, torch.ones(1, 2))
    assert forget.item() == pytest.approx(-1.5 * math.log(2))
    # its own retain term: NLL on the toy LM's retain answer, p = (1/2, 3/4), so (ln 2 + ln 4/3) / 2
    name, weight = graddiff.own_retain
    assert (name, weight) == ("nll", 1.0)
    retain = RETAIN_LOSSES[name].loss(ToyLM(THETA), None, BATCH, CFG)
    # together: −(3/2)·ln 2 + (ln 2 + ln 4/3) / 2 = −(1/2)·ln 3
    assert (forget + weight * retain).item() == pytest.approx(-0.5 * math.log(3))
