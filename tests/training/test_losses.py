"""The losses every method shares (pipeline/training/losses.py), each on a small hand-computed case: the pooling of
token losses, the retain terms' formulas, θ_o's top-k KL, and the chunked LM head. Each method's own loss:
tests/training/methods/test_NAME.py."""

import functools
import math

import pytest
import torch

from pipeline.attribution.teacher import teacher_topk
from pipeline.training.losses import (activation_matching_loss, forward_kl_loss, nll_loss, token_logp,
                                      weighted_sample_mean, weighted_token_mean, without_first_scored)
from pipeline.training.methods.ceu import ceu_from_logits
from pipeline.training.methods.pdu import margin_from_logits
from pipeline.training.methods.undial import Params as UndialParams
from pipeline.training.methods.undial import undial_from_logits
from tests.conftest import LOG_HALF, LOG_QUARTER


def test_weighted_sample_mean_uniform_hard_soft():
    losses = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 8.0, 0.0, 0.0]])
    uniform = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0]])
    assert weighted_sample_mean(losses, uniform).item() == pytest.approx((2.0 + 6.0) / 2)
    hard = torch.tensor([[0.0, 0, 1, 0], [0, 1, 0, 0]])
    assert weighted_sample_mean(losses, hard).item() == pytest.approx((3.0 + 8.0) / 2)
    soft = torch.tensor([[0.2, 0.3, 0.5, 0], [0.75, 0.25, 0, 0]])
    assert weighted_sample_mean(losses, soft).item() == pytest.approx((0.2 + 0.6 + 1.5 + 3.0 + 2.0) / 2)
    empty = torch.tensor([[0.0, 0, 0, 0], [1, 1, 0, 0]])
    assert weighted_sample_mean(losses, empty).item() == pytest.approx(6.0)  # the sample with no weight is left out


def test_weighted_token_mean_pools_every_token_of_the_batch():
    losses = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 8.0, 0.0, 0.0]])
    uniform = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0]])
    # (1 + 2 + 3 + 4 + 8) / 5 tokens, where the sample mean is (2 + 6) / 2
    assert weighted_token_mean(losses, uniform).item() == pytest.approx(18.0 / 5)
    hard = torch.tensor([[0.0, 1, 1, 0], [0, 1, 0, 0]])
    assert weighted_token_mean(losses, hard).item() == pytest.approx((2.0 + 3.0 + 8.0) / 3)  # sample: (2.5 + 8) / 2
    soft = torch.tensor([[0.2, 0.3, 0.5, 0], [0.75, 0.25, 0, 0]])  # each sample's weights sum to 1: as per sample
    assert weighted_token_mean(losses, soft).item() == pytest.approx((0.2 + 0.6 + 1.5 + 3.0 + 2.0) / 2)
    nothing = torch.zeros(2, 4)
    assert weighted_token_mean(losses.requires_grad_(), nothing).item() == 0.0  # no weight: no loss, no error


def test_the_first_scored_token_of_each_sample_is_left_out_with_its_weight():
    batch = {"scored": torch.tensor([[0.0, 1, 1, 1], [1, 1, 0, 0]]),
             "weights": torch.tensor([[0.0, 0.5, 0.3, 0.2], [1, 1, 0, 0]]), "input_ids": torch.zeros(2, 4)}
    out = without_first_scored(batch, 1)
    assert out["scored"].tolist() == [[0, 0, 1, 1], [0, 1, 0, 0]]
    torch.testing.assert_close(out["weights"], torch.tensor([[0.0, 0, 0.3, 0.2], [0, 1, 0, 0]]))
    assert out["input_ids"] is batch["input_ids"]
    # pooled per sample, the rest of the soft weights are renormalised: (0.3·ℓ_2 + 0.2·ℓ_3) / 0.5
    losses = torch.tensor([[0.0, 9.0, 1.0, 2.0], [9.0, 4.0, 0.0, 0.0]])
    assert weighted_sample_mean(losses, out["weights"]).item() == pytest.approx(((0.3 + 0.4) / 0.5 + 4.0) / 2)


def test_forward_kl_and_nll():
    ref = torch.log(torch.tensor([[[0.5, 0.5], [0.9, 0.1]]]))
    cur = torch.log(torch.tensor([[[0.25, 0.75], [0.9, 0.1]]]))
    mask = torch.tensor([[1.0, 1.0]])
    expected = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)  # the second position has KL 0
    assert forward_kl_loss(ref, cur, mask).item() == pytest.approx(expected)
    assert forward_kl_loss(ref, ref, mask).item() == pytest.approx(0.0, abs=1e-7)
    assert nll_loss(torch.tensor([[LOG_HALF, LOG_QUARTER, 9.0]]), torch.tensor([[1.0, 1, 0]])).item() == \
        pytest.approx(-(LOG_HALF + LOG_QUARTER) / 2)


def test_token_logp_aligns_with_labels():
    logits = torch.log(torch.tensor([[[0.5, 0.5], [0.25, 0.75], [0.9, 0.1]]]))
    labels = torch.tensor([[-100, 1, 0]])
    logp, mask = token_logp(logits, labels)
    assert mask.tolist() == [[False, True, True]]
    assert logp[0].tolist() == pytest.approx([0.0, LOG_HALF, math.log(0.25)])


def test_activation_matching_is_the_masked_mean_of_per_position_mse():
    hidden = torch.tensor([[[1.0, 3.0], [0.0, 0.0], [5.0, 5.0]]])
    ref = torch.tensor([[[0.0, 1.0], [2.0, 2.0], [0.0, 0.0]]])
    # per position: (1 + 4)/2 = 2.5, (4 + 4)/2 = 4, (25 + 25)/2 = 25; the third position is masked out
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    assert activation_matching_loss(hidden, ref, mask).item() == pytest.approx((2.5 + 4.0) / 2)
    assert activation_matching_loss(ref, ref, mask).item() == 0.0


# ---- the chunked head: the same values as the full logits, from hidden states ---------------------------------

def test_topk_reference_and_its_kl_on_a_hand_computed_case():
    from pipeline.attribution.reference import topk_reference
    from pipeline.training.losses import forward_kl_from_logits, topk_kl_from_logits

    p_ref, p = torch.tensor([[0.5, 0.3, 0.15, 0.05]]), torch.tensor([[0.4, 0.4, 0.1, 0.1]])
    ids, logp, tail = topk_reference(p_ref.log(), k=2)
    assert ids.tolist() == [[0, 1]] and logp.exp().tolist()[0] == pytest.approx([0.5, 0.3])
    assert tail.exp().item() == pytest.approx(0.2)
    # coarsened: 0.5 ln(0.5/0.4) + 0.3 ln(0.3/0.4) + 0.2 ln(0.2/0.2); the full KL adds the tail's inside
    coarse = 0.5 * math.log(1.25) + 0.3 * math.log(0.75)
    full = coarse + 0.15 * math.log(1.5) + 0.05 * math.log(0.5)
    assert topk_kl_from_logits(p.log(), ids, logp, tail).item() == pytest.approx(coarse, abs=1e-6)
    assert forward_kl_from_logits(p_ref.log(), p.log()).item() == pytest.approx(full, abs=1e-6)
    ids4, logp4, tail4 = topk_reference(p_ref.log(), k=4)  # every token kept: the exact KL, tail 0 (floored)
    assert topk_kl_from_logits(p.log(), ids4, logp4, tail4).item() == pytest.approx(full, abs=1e-5)


def test_chunked_head_equals_the_full_logits_with_gradients():
    from pipeline.attribution.reference import topk_reference
    from pipeline.training.losses import by_chunks, forward_kl_from_logits, token_logp_from_logits, topk_kl_from_logits

    torch.manual_seed(0)
    head = torch.nn.Linear(8, 50)
    hidden = torch.randn(23, 8, requires_grad=True)
    ref_hidden = torch.randn(23, 8)
    targets = torch.randint(0, 50, (23,))
    ids, logp, tail = topk_reference(head(ref_hidden).detach(), k=5)
    cases = {
        "logp": (token_logp_from_logits, (targets,)),
        "topk_kl": (topk_kl_from_logits, (ids, logp, tail)),
        "kl": (lambda logits, r: forward_kl_from_logits(head(r).detach(), logits), (ref_hidden,)),
        "ceu": (ceu_from_logits, (targets,)),  # its target distribution detached inside the checkpointed chunk
        "pdu": (margin_from_logits, (targets,)),
        "undial": (functools.partial(undial_from_logits, params=UndialParams(3.0)),
                   (targets, *teacher_topk(head(ref_hidden).detach(), targets, 5),
                    torch.log_softmax(head(ref_hidden).detach(), -1).gather(-1, targets[:, None])[:, 0])),
    }
    for name, (fn, rows) in cases.items():
        full = fn(head(hidden), *rows)
        grads_full = torch.autograd.grad(full.sum(), [hidden, head.weight])
        chunked = by_chunks(fn, head, hidden, *rows, chunk=4)  # 23 rows: 5 full chunks and one of 3
        grads_chunked = torch.autograd.grad(chunked.sum(), [hidden, head.weight])
        torch.testing.assert_close(chunked, full, msg=name)
        for a, b in zip(grads_chunked, grads_full):
            torch.testing.assert_close(a, b, msg=name)
