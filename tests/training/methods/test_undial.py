"""UNDIAL (pipeline/training/methods/undial.py) on hand-computed cases: the cross-entropy to θ_o's distribution with
the true token's logit lowered by β, from the teacher stage one keeps (θ_o's top k and the tail)."""

import math

import pytest
import torch

from pipeline.attribution.teacher import teacher_topk
from pipeline.training.methods.undial import Params as UndialParams
from pipeline.training.methods.undial import undial_exact, undial_from_logits


def _teacher(ref_logits, targets, k):
    """What stage one keeps of θ_o at each token for UNDIAL: its top k, the tail, and log p_o of the token."""
    true = torch.log_softmax(ref_logits, -1).gather(-1, targets[:, None])[:, 0]
    return (*teacher_topk(ref_logits, targets, k), true)


def test_undial_by_hand_on_three_tokens():
    # θ_o's logits (2, 0, 0), the token 0, β = 2: the target is softmax(0, 0, 0), uniform; with θ = θ_o the loss is
    # −(1/3)·Σ log p_θ = log(e² + 2) − 2/3
    logits, y = torch.tensor([[2.0, 0.0, 0.0]]), torch.tensor([0])
    hand = math.log(math.e ** 2 + 2) - 2 / 3
    assert hand == pytest.approx(1.572878, abs=1e-6)
    assert undial_exact(logits, logits, y, 2.0).item() == pytest.approx(hand, abs=1e-6)
    for k in (3, 2):  # the teacher's top 3 (all) or 2: the rest is at most one token, so the loss is exact
        got = undial_from_logits(logits, y, *_teacher(logits, y, k), params=UndialParams(2.0))
        assert got.item() == pytest.approx(hand, abs=1e-6), k
    # top 1 (token 0 = y): tokens 1 and 2 are one bucket, q's mass 2/3 against p_θ's (p1 + p2)
    p = torch.softmax(logits, -1)[0].tolist()
    coarse = -(math.log(p[0]) + 2 * math.log(p[1] + p[2])) / 3
    assert coarse == pytest.approx(hand - 2 / 3 * math.log(2), abs=1e-6)  # below the exact loss
    got = undial_from_logits(logits, y, *_teacher(logits, y, 1), params=UndialParams(2.0))
    assert got.item() == pytest.approx(coarse, abs=1e-6)
    # token 1, out of the top 1 (token 0): q = (e², e^{-2}, 1)/Z and the rest bucket holds token 2 alone, so exact
    y1 = torch.tensor([1])
    z = math.e ** 2 + math.e ** -2 + 1
    logp = torch.log_softmax(logits, -1)[0].tolist()
    hand1 = -(math.e ** 2 * logp[0] + math.e ** -2 * logp[1] + logp[2]) / z
    assert undial_from_logits(logits, y1, *_teacher(logits, y1, 1), params=UndialParams(2.0)).item() == \
        pytest.approx(hand1, abs=1e-6)


def test_undial_from_the_cached_teacher_is_the_exact_loss_when_k_covers_the_vocabulary():
    torch.manual_seed(0)
    logits, ref = torch.randn(9, 40), 2 * torch.randn(9, 40)
    y = torch.randint(0, 40, (9,))
    exact = undial_exact(logits, ref, y, 10.0)
    for k in (40, 64):  # k ≥ vocab: the teacher stage one keeps is θ_o's whole distribution
        torch.testing.assert_close(undial_from_logits(logits, y, *_teacher(ref, y, k), params=UndialParams(10.0)),
                                   exact, atol=1e-5, rtol=1e-6)
    # fewer tokens: the tail is one bucket, whose cross-entropy is at most the exact one (coarsening)
    coarse = undial_from_logits(logits, y, *_teacher(ref, y, 4), params=UndialParams(10.0))
    assert torch.isfinite(coarse).all() and (coarse <= exact + 1e-5).all()
