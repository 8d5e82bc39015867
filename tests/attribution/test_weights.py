"""Attribution score and weights on hand-computed cases."""

import math

import numpy as np
import pytest

from pipeline.attribution.signals import attribution_score, minmax
from pipeline.attribution.weights import hard_weights, proportional_weights, soft_weights, token_weights
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


def test_proportional_weights_are_the_scores_themselves_in_the_weighted_mean():
    """ETW's weighting: ω ∝ score. Entropies 0.5, 1.5, 0, 2.0 nats weigh the losses 1, 2, 3, 4 into
    (0.5·1 + 1.5·2 + 0 + 2·4) / 4 = 2.875, where the token mean is 2.5."""
    h = np.array([0.5, 1.5, 0.0, 2.0])
    w = token_weights("proportional", h)
    assert w.tolist() == [0.5, 1.5, 0.0, 2.0]
    losses = np.array([1.0, 2.0, 3.0, 4.0])
    assert (w * losses).sum() / w.sum() == pytest.approx(2.875)
    assert proportional_weights(np.array([-0.3, 0.6])).tolist() == [0.0, 0.6]  # a negative score pushes nothing
    assert proportional_weights(np.zeros(3)).tolist() == [1.0, 1.0, 1.0]       # no score anywhere: the token mean
    assert token_weights("proportional", h, mix=0.5).tolist() == pytest.approx([0.1875, 0.3125, 0.125, 0.375])


# ---- mix: a share of each sample's push spread evenly over its scored tokens ----------------------------------

def test_hard_weights_with_mix_are_a_mixture_of_the_selection_and_the_token_mean():
    phi = np.array([0.1, 0.9, 0.5, 0.3])  # r = 0.5 selects positions 1 and 2
    # ω = 0.5·1/4 + 0.5·[0, 1, 1, 0]/2
    assert token_weights("hard", phi, r=0.5, mix=0.5).tolist() == [0.125, 0.375, 0.375, 0.125]
    assert token_weights("hard", phi, r=0.5, mix=0.2).tolist() == pytest.approx([0.05, 0.45, 0.45, 0.05])
    assert token_weights("hard", np.array([0.7]), r=0.2, mix=0.5).tolist() == [1.0]  # one token: all of it


def test_soft_weights_with_mix():
    phi = np.array([0.0, math.log(3.0)])  # softmax(φ / 1) = [1/4, 3/4]
    assert token_weights("soft", phi, tau=1.0).tolist() == pytest.approx([0.25, 0.75])
    # ω = 0.2·1/2 + 0.8·[1/4, 3/4]
    assert token_weights("soft", phi, tau=1.0, mix=0.2).tolist() == pytest.approx([0.3, 0.7])


def test_mix_zero_is_the_weights_without_it():
    from pipeline.attribution.weights import mixed_weights

    phi = np.array([0.1, 0.9, 0.5, 0.9, 0.2, 0.0, 0.3, 0.4, 0.6, 0.7])
    for strategy in ("uniform", "hard", "soft"):
        old = token_weights(strategy, phi, r=0.3, tau=0.5)
        new = token_weights(strategy, phi, r=0.3, tau=0.5, mix=0.0)
        assert new.dtype == old.dtype and new.tobytes() == old.tobytes()
    assert token_weights("hard", phi, r=0.3, mix=0).tolist() == hard_weights(phi, r=0.3).tolist()  # an int 0 too
    w = hard_weights(phi, r=0.3)
    assert mixed_weights(w, 0.0) is w  # the very array: nothing is renormalised


def test_mix_one_is_the_uniform_weighting_in_the_weighted_mean():
    import torch

    from pipeline.training.losses import weighted_sample_mean

    phi = np.array([0.1, 0.9, 0.5, 0.3])
    losses = torch.tensor([[1.0, 2.0, 4.0, 8.0]], dtype=torch.float64)

    def mean(w):
        return weighted_sample_mean(losses, torch.from_numpy(np.asarray(w, dtype=np.float64))[None]).item()

    for strategy in ("hard", "soft"):
        w = token_weights(strategy, phi, r=0.5, tau=0.5, mix=1.0)
        assert w.tolist() == pytest.approx([0.25] * 4)  # uniform's ω = 1, up to scale
        assert mean(w) == pytest.approx(mean(token_weights("uniform", phi))) == pytest.approx(3.75)
    # in between, the weighted mean interpolates: 0.5·(token mean) + 0.5·(mean over the selected tokens)
    assert mean(token_weights("hard", phi, r=0.5, mix=0.5)) == pytest.approx(0.5 * 3.75 + 0.5 * 3.0)


def test_mix_out_of_range_or_on_uniform_weights_is_refused():
    from pipeline.training.forget_stream import Weighting

    phi = np.array([0.2, 0.8])
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ParamError, match=r"^mix=.*: must be in \[0, 1\]$"):
            token_weights("hard", phi, mix=bad)
    for bad in ("0.5", None, True):
        with pytest.raises(ParamError, match=r"^mix=.*: expected a number in \[0, 1\]$"):
            token_weights("soft", phi, mix=bad)
    with pytest.raises(ParamError, match=r"^mix=0.5: the uniform weighting spreads the push evenly already"):
        token_weights("uniform", phi, mix=0.5)
    with pytest.raises(ParamError, match=r"^mix=0.5: the uniform weighting"):
        Weighting("uniform", mix=0.5)
    with pytest.raises(ParamError, match=r"^mix=2: must be in \[0, 1\]$"):
        Weighting("hard", mix=2)
    assert Weighting("uniform").used() == {"weighting": "uniform"}
    assert Weighting("hard", mix=0.0).used() == {"weighting": "hard", "r": 0.2, "alpha": 0.7, "score": "phi"}
    assert Weighting("hard", mix=0.25).used() == {"weighting": "hard", "r": 0.2, "alpha": 0.7, "score": "phi",
                                                 "mix": 0.25}


# ---- focus: each selected stretch pushed at its first token --------------------------------------------------

def test_focus_first_moves_each_stretch_of_hard_weights_onto_its_first_token():
    from pipeline.attribution.weights import first_token_weights

    assert first_token_weights(np.array([0.0, 1.0, 1.0, 0.0, 1.0])).tolist() == [0.0, 2.0, 0.0, 0.0, 1.0]
    assert first_token_weights(np.array([1.0, 1.0, 1.0])).tolist() == [3.0, 0.0, 0.0]  # all selected: one stretch
    assert first_token_weights(np.array([])).size == 0
    phi = np.array([0.9, 0.8, 0.1, 0.7, 0.2, 0.0])  # r = 0.5 selects positions 0, 1 and 3
    assert token_weights("hard", phi, r=0.5).tolist() == [1, 1, 0, 1, 0, 0]
    assert token_weights("hard", phi, r=0.5, focus="first").tolist() == [2, 0, 0, 1, 0, 0]
    # then mix, over the focused weights: 0.5·1/6 + 0.5·[2, 0, 0, 1, 0, 0]/3
    assert token_weights("hard", phi, r=0.5, focus="first", mix=0.5).tolist() == pytest.approx(
        [1 / 12 + 1 / 3, 1 / 12, 1 / 12, 1 / 12 + 1 / 6, 1 / 12, 1 / 12])


def test_focus_first_on_soft_weights_keeps_the_tokens_below_the_mean_and_the_sum():
    # softmax(φ / 1) of φ = log [1, 3, 4, 1, 1] = [0.1, 0.3, 0.4, 0.1, 0.1]: the stretch at or above the mean (0.2)
    # is positions 1-2, whose 0.7 moves onto position 1
    phi = np.log(np.array([1.0, 3.0, 4.0, 1.0, 1.0]))
    w = token_weights("soft", phi, tau=1.0, focus="first")
    assert w.tolist() == pytest.approx([0.1, 0.7, 0.0, 0.1, 0.1]) and w.sum() == pytest.approx(1.0)


def test_focus_all_is_the_weights_unchanged_and_focus_is_refused_on_uniform_or_unknown():
    from pipeline.training.forget_stream import Weighting

    phi = np.array([0.1, 0.9, 0.5, 0.9, 0.2])
    for strategy in ("hard", "soft"):
        assert token_weights(strategy, phi, focus="all").tobytes() == token_weights(strategy, phi).tobytes()
    with pytest.raises(ParamError, match=r"^focus='first': uniform weights select no stretch of the answer"):
        token_weights("uniform", phi, focus="first")
    with pytest.raises(ParamError, match=r"^focus='last': expected one of \['all', 'first'\]$"):
        token_weights("hard", phi, focus="last")
    with pytest.raises(ParamError, match=r"^focus='first': uniform weights"):
        Weighting("uniform", focus="first")
    assert Weighting("hard", focus="all").used() == Weighting("hard").used()  # named only where it is not all
    assert Weighting("hard", focus="first").used()["focus"] == "first"
