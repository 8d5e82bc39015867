"""GA (pipeline/training/methods/ga.py) on a hand-computed case: its token loss is log p itself."""

import pytest
import torch

from pipeline.training.methods import METHODS, ForwardOut
from pipeline.training.methods.ga import ga_token_loss
from tests.conftest import LOG_HALF, LOG_QUARTER


def test_ga_token_loss_is_the_log_probability():
    logp = torch.tensor([[LOG_HALF, LOG_QUARTER]])
    assert ga_token_loss(logp)[0].tolist() == pytest.approx([LOG_HALF, LOG_QUARTER])
    ga = METHODS["ga"]
    assert ga.token_loss(ForwardOut(logp=logp), {}, ga.params())[0].tolist() == pytest.approx([LOG_HALF, LOG_QUARTER])
