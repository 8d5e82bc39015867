"""pipeline/common/numerics.py on a hand-computed case: log(1 − e^x) and its gradient, near 0 too."""

import math

import pytest
import torch

from pipeline.common.numerics import log1mexp


def test_log1mexp_values_and_finite_gradients_near_zero():
    # log(1 − e^x) by hand: x = ln 0.5 → ln 0.5; x = ln 0.9 → ln 0.1; x = −1e-9 → ln(1e-9) (1 − e^x ≈ −x)
    x = torch.tensor([math.log(0.5), math.log(0.9), -1e-9, -3.0], requires_grad=True)
    y = log1mexp(x)
    assert y.tolist() == pytest.approx([math.log(0.5), math.log(0.1), math.log(1e-9), math.log(1 - math.exp(-3))],
                                       rel=1e-4)
    y.sum().backward()
    # d/dx log(1 − e^x) = −e^x / (1 − e^x): −1 at ln 0.5, −9 at ln 0.9, about −1e9 near 0; never NaN (a memorised
    # model's retain tail, 1e-9, used to give NaN through the branch torch.where leaves unused)
    assert torch.isfinite(x.grad).all()
    assert x.grad[:2].tolist() == pytest.approx([-1.0, -9.0], rel=1e-4)
    assert x.grad[2].item() == pytest.approx(-1e9, rel=1e-2)
