"""PDU (pipeline/training/methods/pdu.py) on hand-computed cases: its forget loss, the squared gap of the logits'
max and mean, and its dual variable, the retain weight λ."""

import pytest
import torch

from pipeline.training.methods.pdu import Dual
from pipeline.training.methods.pdu import Params as PduParams
from pipeline.training.methods.pdu import margin_from_logits


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
