"""Membership-inference scores, AUC and privleak (issue 18) on hand-computed cases."""

import math
import zlib

import numpy as np
import pytest
import torch

from pipeline.evaluation.mia import (MIA_SCORES, auc, lowest_fraction, min_k_pp_score, min_k_score, privleak,
                                     vocab_moments, zlib_score)

LOGP = np.log([0.5, 0.25, 0.125, 1.0, 0.5])  # answer tokens' log p: −0.693, −1.386, −2.079, 0, −0.693


def test_loss_and_zlib():
    loss = -(math.log(0.5) * 2 + math.log(0.25) + math.log(0.125)) / 5
    assert MIA_SCORES["loss"](LOGP) == pytest.approx(loss)
    text = "Ann Lee was born in Oslo."
    assert zlib_score(LOGP, text=text) == pytest.approx(loss / len(zlib.compress(text.encode())))


def test_min_k_keeps_the_lowest_fraction_and_at_least_one_token():
    # k = 0.4 of 5 tokens: the 2 lowest, log 0.125 and log 0.25
    assert min_k_score(LOGP, k=0.4) == pytest.approx(-(math.log(0.125) + math.log(0.25)) / 2)
    # k = 0.1: int(0.5) = 0 tokens, so the single lowest
    assert min_k_score(LOGP, k=0.1) == pytest.approx(-math.log(0.125))
    assert lowest_fraction([3.0, 1.0, 2.0], 1.0).tolist() == [1.0, 2.0, 3.0]


def test_min_k_pp_normalizes_by_the_models_own_distribution():
    # two positions over a 2-token vocabulary with p = (0.5, 0.5) and (0.9, 0.1)
    logits = torch.log(torch.tensor([[0.5, 0.5], [0.9, 0.1]]))
    mu, sigma2 = vocab_moments(logits)
    mu1 = 0.9 * math.log(0.9) + 0.1 * math.log(0.1)
    assert mu.tolist() == pytest.approx([math.log(0.5), mu1], rel=1e-5)
    var1 = 0.9 * math.log(0.9) ** 2 + 0.1 * math.log(0.1) ** 2 - mu1 ** 2
    assert sigma2.tolist() == pytest.approx([0.0, var1], abs=1e-6)
    # targets: token 0 at both positions; the first position's σ² = 0 is clamped to 1e-6
    logp = np.array([math.log(0.5), math.log(0.9)])
    z = [(logp[0] - mu[0].item()) / 1e-3, (logp[1] - mu1) / math.sqrt(var1)]
    assert min_k_pp_score(logp, mu.numpy(), sigma2.numpy(), k=1.0) == pytest.approx(-np.mean(z), abs=1e-3)


def test_auc_counts_holdout_above_forget_with_ties_as_half():
    # forget scores lower (memorized): every pair ordered -> 1
    assert auc([0.1, 0.2], [0.3, 0.4]) == 1.0
    assert auc([0.3, 0.4], [0.1, 0.2]) == 0.0
    # pairs (h, f): (0.2, 0.2) tie, (0.2, 0.3) below, (0.4, 0.2) above, (0.4, 0.3) above -> (2 + 0.5) / 4
    assert auc([0.2, 0.3], [0.2, 0.4]) == pytest.approx(0.625)
    with pytest.raises(ValueError, match="non-empty"):
        auc([], [0.1])


def test_privleak_is_zero_for_the_retain_model_against_itself():
    retain_auc = auc([0.3, 0.5, 0.2], [0.4, 0.1, 0.6])
    assert privleak(retain_auc, retain_auc) == 0.0
    assert privleak(0.75, 0.5) == pytest.approx(50.0) and privleak(0.25, 0.5) == pytest.approx(-50.0)
