"""Every unlearning loss on a small hand-computed case: the pooling of token losses and the retain terms here, each
method's token loss from its module."""

import functools
import math

import pytest
import torch

from pipeline.attribution.teacher import teacher_topk
from pipeline.training.losses import (activation_matching_loss, forward_kl_loss, nll_loss, token_logp,
                                      weighted_sample_mean, weighted_token_mean, without_first_scored)
from pipeline.training.methods import METHODS, ForwardOut
from pipeline.training.methods.ceu import ceu_from_logits
from pipeline.training.methods.ga import ga_token_loss
from pipeline.training.methods.idkdpo import dpo_loss, weighted_answer_logp
from pipeline.training.methods.idkdpo import sequence_loss as idkdpo_loss
from pipeline.training.methods.idknll import idk_nll
from pipeline.training.methods.npo import npo_sequence_loss, npo_token_loss
from pipeline.training.methods.pdu import Dual
from pipeline.training.methods.pdu import Params as PduParams
from pipeline.training.methods.pdu import margin_from_logits
from pipeline.training.methods.rmu import rmu_token_loss
from pipeline.training.methods.satimp import satimp_token_loss
from pipeline.training.methods.simnpo import simnpo_sequence_loss
from pipeline.training.methods.undial import Params as UndialParams
from pipeline.training.methods.undial import undial_exact, undial_from_logits
from pipeline.training.methods.wga import wga_token_loss

LOG_HALF, LOG_QUARTER = math.log(0.5), math.log(0.25)


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


def test_ga_and_wga():
    logp = torch.tensor([[LOG_HALF, LOG_QUARTER]], requires_grad=True)
    assert ga_token_loss(logp)[0].tolist() == pytest.approx([LOG_HALF, LOG_QUARTER])
    wga = wga_token_loss(logp, gamma=1.0)
    assert wga[0].tolist() == pytest.approx([0.5 * LOG_HALF, 0.25 * LOG_QUARTER])
    wga.sum().backward()
    assert logp.grad[0].tolist() == pytest.approx([0.5, 0.25])  # the factor p^γ is detached
    expected = [0.25 * LOG_HALF, 0.0625 * LOG_QUARTER]
    assert wga_token_loss(logp.detach(), gamma=2.0)[0].tolist() == pytest.approx(expected)


def test_npo_token_loss():
    # p = 0.5, p_ref = 0.25, β = 1: (2/1)·log(1 + 2) ; β = 0.5: 4·log(1 + √2)
    logp, ref = torch.tensor([[LOG_HALF]]), torch.tensor([[LOG_QUARTER]])
    assert npo_token_loss(logp, ref, beta=1.0).item() == pytest.approx(2 * math.log(3))
    assert npo_token_loss(logp, ref, beta=0.5).item() == pytest.approx(4 * math.log(1 + math.sqrt(2)))
    # at p = p_ref the loss is (2/β)·log 2
    assert npo_token_loss(ref, ref, beta=0.1).item() == pytest.approx(20 * math.log(2))


def test_npo_sequence_loss_sums_log_probabilities():
    logp = torch.tensor([[LOG_HALF, LOG_HALF, 0.0]])
    ref = torch.tensor([[LOG_QUARTER, LOG_HALF, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    # Σ(log p − log p_ref) = log 2; −(2/β)·log σ(−β·log 2) with β = 1: 2·log(1 + 2)
    assert npo_sequence_loss(logp, ref, mask, beta=1.0).item() == pytest.approx(2 * math.log(3))


def test_simnpo_on_the_mean_nll_with_the_margin_inside_beta():
    # p = 1/2, 1/4: mean NLL m = (3/2)·ln 2 = 1.039721; L = −(2/β)·log σ(β·(m − δ)) = (2/β)·log(1 + e^{−β(m − δ)})
    logp = torch.tensor([[LOG_HALF, LOG_QUARTER, 0.0]])
    scored = torch.tensor([[1.0, 1.0, 0.0]])  # uniform weights: 1 on the scored tokens
    m = 1.5 * math.log(2)
    assert simnpo_sequence_loss(logp, scored, beta=1.0).item() == pytest.approx(2 * math.log(1 + 2 ** -1.5))
    assert simnpo_sequence_loss(logp, scored, beta=1.0).item() == pytest.approx(0.605467, abs=1e-6)
    assert simnpo_sequence_loss(logp, scored, beta=4.5).item() == pytest.approx(0.004110, abs=1e-6)
    # δ = 1: the authors' and open-unlearning's β·(m − δ) gives 0.270117; the paper's β·m − γ (γ = 1) would give
    # 0.011085 (open-unlearning issue #123)
    assert simnpo_sequence_loss(logp, scored, beta=4.5, delta=1.0).item() == \
        pytest.approx((2 / 4.5) * math.log(1 + math.exp(-4.5 * (m - 1.0))))
    assert simnpo_sequence_loss(logp, scored, beta=4.5, delta=1.0).item() == pytest.approx(0.270117, abs=1e-6)
    # soft weights (0.75, 0.25): m_ω = 0.75·ln 2 + 0.25·ln 4 = 0.866434
    soft = torch.tensor([[0.75, 0.25, 0.0]])
    assert simnpo_sequence_loss(logp, soft, beta=4.5).item() == pytest.approx(0.008916, abs=1e-6)
    # hard weights on the second token only: m_ω = ln 4; a sample with no weight is left out of the batch mean
    hard = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    assert simnpo_sequence_loss(logp.expand(2, 3), hard, beta=1.0).item() == pytest.approx(2 * math.log(1 + 1 / 4))
    # a batch: the mean over samples of the per-sample losses
    two = torch.tensor([[LOG_HALF, LOG_QUARTER, 0.0], [LOG_HALF, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert simnpo_sequence_loss(two, mask, beta=1.0).item() == \
        pytest.approx((2 * math.log(1 + 2 ** -1.5) + 2 * math.log(1.5)) / 2)


def _dpo_batch(weights):
    """The spec's example (methods_spec §6): forget answer p_θ = (1/2, 1/4), p_o = (4/5, 1/2), so Δ_l = −1.163151;
    the preferred answer log π_θ = −3 (three tokens), log π_o = −4, so Δ_w = 1. A padded third position."""
    out = ForwardOut(torch.tensor([[LOG_HALF, LOG_QUARTER, 0.0]]), None, None,
                     torch.tensor([[0.0, -1.0, -1.5, -0.5, 0.0]]))
    batch = {"weights": torch.tensor([weights]), "scored": torch.tensor([[1.0, 1.0, 0.0]]),
             "ref_logp": torch.tensor([[math.log(0.8), LOG_HALF, 0.0]]),
             "alternative": {"scored": torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0]]), "ref_logp": torch.tensor([-4.0])}}
    return out, batch


def test_dpo_with_open_unlearnings_two_over_beta():
    # Δ_w − Δ_l = 2.163151: −(2/β)·log σ(0.2163151) = 11.816546 (open-unlearning); without 2/β: 0.590827 (DPO paper)
    assert dpo_loss(torch.tensor([1.0]), torch.tensor([-1.1631508]), beta=0.1).item() == \
        pytest.approx(11.816546, abs=1e-5)
    assert dpo_loss(torch.tensor([1.0]), torch.tensor([-1.1631508]), beta=0.1).item() * 0.1 / 2 == \
        pytest.approx(0.590827, abs=1e-6)
    # θ = θ_o on both answers: (2/β)·ln 2, NPO's value at the start
    assert dpo_loss(torch.zeros(3), torch.zeros(3), beta=0.1).item() == pytest.approx(20 * math.log(2))
    # the mean over samples
    assert dpo_loss(torch.tensor([1.0, 0.0]), torch.tensor([-1.1631508, 0.0]), beta=0.1).item() == \
        pytest.approx((11.816546 + 20 * math.log(2)) / 2, abs=1e-5)


def test_idkdpo_prefers_the_alternative_and_weights_only_the_forget_answer():
    params = METHODS["idkdpo"].params()
    assert params.beta == 0.1  # open-unlearning's
    out, batch = _dpo_batch([1.0, 1.0, 0.0])  # uniform: DPO itself, the sums of log p
    assert idkdpo_loss(out, batch, params).item() == pytest.approx(11.816546, abs=1e-5)
    # soft ω = (3/4, 1/4): S_ω = n·Σ ω log p / Σ ω on θ and θ_o alike, Δ_l = 2·(−0.866434 + 0.340644) = −1.051579
    out, batch = _dpo_batch([0.75, 0.25, 0.0])
    assert idkdpo_loss(out, batch, params).item() == pytest.approx(11.916405, abs=1e-5)
    # hard ω = (1, 0): the first token's log-ratio, scaled to the answer's 2 tokens: Δ_l = 2·ln(0.5/0.8)
    out, batch = _dpo_batch([1.0, 0.0, 0.0])
    assert idkdpo_loss(out, batch, params).item() == pytest.approx(12.016880, abs=1e-5)
    # the weights' scale does not matter (hard 1/r-style weights give the same loss)
    out, batch = _dpo_batch([5.0, 0.0, 0.0])
    assert idkdpo_loss(out, batch, params).item() == pytest.approx(12.016880, abs=1e-5)
    # AltPO is the same loss (on another alternative answer)
    assert METHODS["altpo"].sequence_loss is METHODS["idkdpo"].sequence_loss
    assert (METHODS["idkdpo"].alternative, METHODS["altpo"].alternative) == ("idk", "perturbed")


def test_weighted_answer_logp_is_the_sum_under_uniform_weights():
    logp = torch.tensor([[-1.0, -2.0, -3.0, 0.0], [-0.5, 0.0, 0.0, 0.0]])
    scored = torch.tensor([[1.0, 1, 1, 0], [1, 0, 0, 0]])
    assert weighted_answer_logp(logp, scored, scored).tolist() == pytest.approx([-6.0, -0.5])
    assert weighted_answer_logp(logp, torch.zeros(2, 4), scored).tolist() == [0.0, 0.0]  # no weight: no term


def test_idknll_is_each_samples_mean_nll_of_its_idk_answer():
    # p = (1/2, 1/8): mean NLL (0.693147 + 2.079442)/2 = 1.386294 (methods_spec §7); a second sample with one token
    logp = torch.tensor([[0.0, LOG_HALF, math.log(0.125)], [0.0, LOG_QUARTER, 0.0]])
    scored = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    assert idk_nll(logp[:1], scored[:1]).item() == pytest.approx(1.386294, abs=1e-6)
    assert idk_nll(logp, scored).item() == pytest.approx((1.386294 + math.log(4)) / 2, abs=1e-6)
    out = ForwardOut(None, None, None, logp)
    assert METHODS["idknll"].sequence_loss(out, {"alternative": {"scored": scored}}, None).item() == \
        pytest.approx(idk_nll(logp, scored).item())


def test_satimp_scales_each_tokens_log_probability_by_a_detached_factor():
    # p = 1/2, 1/4, β1 = 5, β2 = 1: factors p^5·(1 − p) = 0.015625 and 0.000732422
    logp = torch.tensor([[LOG_HALF, LOG_QUARTER]], requires_grad=True)
    loss = satimp_token_loss(logp, beta1=5.0, beta2=1.0)
    assert loss[0].tolist() == pytest.approx([0.015625 * LOG_HALF, 0.25 ** 5 * 0.75 * LOG_QUARTER])
    assert loss.mean().item() == pytest.approx(-0.005923, abs=1e-6)  # open-unlearning's pooled mean
    loss.sum().backward()
    assert logp.grad[0].tolist() == pytest.approx([0.015625, 0.25 ** 5 * 0.75])  # no gradient through the factor
    # β1 = 1, β2 = 0: WGA with γ = 1; β1 = β2 = 0: GA
    assert satimp_token_loss(logp.detach(), 1.0, 0.0)[0].tolist() == pytest.approx([0.5 * LOG_HALF,
                                                                                     0.25 * LOG_QUARTER])
    assert satimp_token_loss(logp.detach(), 0.0, 0.0)[0].tolist() == pytest.approx([LOG_HALF, LOG_QUARTER])


def test_ceu_is_the_cross_entropy_to_the_distribution_without_the_true_token():
    # logits (ln 2, 0, 0): p = (1/2, 1/4, 1/4); y = 0, so q = (0, 1/2, 1/2) and ℓ = −2·(1/2)·ln(1/4) = ln 4
    logits = torch.tensor([[math.log(2), 0.0, 0.0]], requires_grad=True)
    loss = ceu_from_logits(logits, torch.tensor([0]))
    assert loss.item() == pytest.approx(math.log(4))
    loss.backward()
    # ∂ℓ/∂z_y = p_y, ∂ℓ/∂z_j = p_j − q_j = −p_j·p_y/(1 − p_y): bounded, and 0 once p_y is 0
    assert logits.grad[0].tolist() == pytest.approx([0.5, -0.25, -0.25])
    # another target: y = 1, q = (2/3, 0, 1/3): ℓ = −(2/3)·ln(1/2) − (1/3)·ln(1/4)
    assert ceu_from_logits(logits.detach(), torch.tensor([1])).item() == \
        pytest.approx(-(2 / 3) * LOG_HALF - (1 / 3) * LOG_QUARTER)


def test_pdu_flattens_the_logits_by_their_squared_max_minus_mean_gap():
    # logits (1, 2, 6): max 6, mean 3, ℓ = 9 whatever the token; equal logits (uniform): ℓ = 0
    logits = torch.tensor([[1.0, 2.0, 6.0], [4.0, 4.0, 4.0]], requires_grad=True)
    loss = margin_from_logits(logits, torch.tensor([0, 2]))
    assert loss.tolist() == [9.0, 0.0]
    loss.sum().backward()
    # ∂ℓ/∂z = 2·(max − mean)·(e_max − 1/3): (−2, −2, 4) on the first row, 0 on the flat one
    assert logits.grad.tolist() == [pytest.approx([-2.0, -2.0, 4.0]), [0.0, 0.0, 0.0]]


def test_pdus_dual_variable_rises_above_epsilon_falls_below_it_stops_at_0_and_waits_for_its_warmup():
    # λ₀ = 1, η = 2, ε = 0.2, one warmup epoch of 2 steps: steps 1 and 2 leave λ; then λ + 2·(L_r − 0.2)
    dual = Dual(PduParams(epsilon=0.2, epsilon_kind="absolute", dual_step=2.0, dual_warmup_epochs=1), 1.0, 2,
                retain_at_start=lambda: pytest.fail("an absolute ε needs no measure"))
    seen = [dual.after_step(done, {"retain_loss": loss})["dual"]
            for done, loss in enumerate([0.5, 0.5, 0.5, 0.0, 0.0, 0.0, 0.0], start=1)]
    assert seen == pytest.approx([1.0, 1.0, 1.6, 1.2, 0.8, 0.4, 0.0])
    assert dual.after_step(8, {"retain_loss": 0.0})["dual"] == 0.0  # max(0, ·): it never goes negative
    # relative: ε = (1 + 0.5)·L_r(θ_o), measured once; a resumed run restores λ from the history
    dual = Dual(PduParams(epsilon=0.5), 3.0, 4, retain_at_start=lambda: 0.4)
    assert dual.epsilon == pytest.approx(0.6)
    assert dual.after_step(1, {"retain_loss": 1.1})["dual"] == pytest.approx(3.5)  # no warmup: from the first step
    dual.restore([{"step": 1, "dual": 3.5}, {"step": 2, "dual": 7.25}])
    assert dual.value == 7.25


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


def test_rmu_token_loss():
    hidden = torch.tensor([[[1.0, 2.0], [0.0, 0.0]]])
    control = torch.tensor([3.0, 0.0])
    assert rmu_token_loss(hidden, control)[0].tolist() == pytest.approx([(4 + 4) / 2, (9 + 0) / 2])


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


def test_log1mexp_values_and_finite_gradients_near_zero():
    from pipeline.common.numerics import log1mexp

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
