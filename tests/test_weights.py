"""Attribution score and weights on hand-computed cases."""

import math

import numpy as np
import pytest

from pipeline.attribution.signals import attribution_score, minmax
from pipeline.attribution.weights import hard_weights, soft_weights, token_weights
from pipeline.common.errors import ParamError


def test_minmax():
    assert minmax(np.array([2.0, 4.0, 3.0])).tolist() == [0.0, 1.0, 0.5]
    assert minmax(np.array([5.0, 5.0])).tolist() == [0.0, 0.0]  # a constant vector normalises to 0
    assert minmax(np.array([])).size == 0


def test_phi_mixes_normalised_delta_and_entropy():
    delta, entropy = np.array([0.0, 1.0, 2.0]), np.array([3.0, 1.0, 1.0])
    # minmax(Δ) = [0, .5, 1], minmax(H) = [1, 0, 0]
    assert attribution_score(delta, entropy, 0.7) == pytest.approx([0.3, 0.35, 0.7])
    assert attribution_score(delta, entropy, 1.0) == pytest.approx([0.0, 0.5, 1.0])
    assert attribution_score(np.zeros(3), entropy, 0.7) == pytest.approx([0.3, 0.0, 0.0])  # no noun: Δ = 0
    with pytest.raises(ParamError, match="alpha=1.5"):
        attribution_score(delta, entropy, 1.5)


def test_hard_weights_top_r_with_ties_to_the_earlier_position():
    phi = np.array([0.1, 0.9, 0.5, 0.9, 0.2, 0.0, 0.3, 0.4, 0.6, 0.7])
    assert hard_weights(phi, r=0.2).tolist() == [0, 1, 0, 1, 0, 0, 0, 0, 0, 0]
    assert hard_weights(phi, r=0.3).tolist() == [0, 1, 0, 1, 0, 0, 0, 0, 0, 1]
    assert hard_weights(np.array([0.5, 0.5, 0.5]), r=0.2).tolist() == [1, 0, 0]  # at least one token
    assert hard_weights(phi, r=1.0).sum() == 10
    with pytest.raises(ParamError, match="r=0"):
        hard_weights(phi, r=0)


def test_soft_weights_are_a_softmax_over_phi_by_tau():
    w = soft_weights(np.array([0.0, 1.0]), tau=0.5)
    assert w.tolist() == pytest.approx([1 / (1 + math.e**2), math.e**2 / (1 + math.e**2)])
    assert soft_weights(np.array([0.3, 0.3, 0.3]), tau=0.5).tolist() == pytest.approx([1 / 3] * 3)
    assert soft_weights(np.array([1000.0, 0.0]), tau=0.01).tolist() == pytest.approx([1.0, 0.0])  # stable


def test_registry():
    phi = np.array([0.2, 0.8])
    assert token_weights("uniform", phi).tolist() == [1.0, 1.0]
    assert token_weights("hard", phi, r=0.5).tolist() == [0.0, 1.0]
    with pytest.raises(ParamError, match="weighting='topk'"):
        token_weights("topk", phi)
