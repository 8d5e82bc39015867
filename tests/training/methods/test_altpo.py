"""AltPO (pipeline/training/methods/altpo.py) on a hand-computed case: IdkDPO's loss, with a perturbed answer
preferred to the forget answer instead of "I don't know"."""

import pytest

from pipeline.training.methods import METHODS
from tests.training.methods.test_idkdpo import dpo_batch


def test_altpo_is_idkdpos_loss_with_the_perturbed_answer_preferred():
    altpo, idkdpo = METHODS["altpo"], METHODS["idkdpo"]
    assert altpo.sequence_loss is idkdpo.sequence_loss
    assert (idkdpo.alternative, altpo.alternative) == ("idk", "perturbed")
    assert altpo.params().beta == 0.1  # the middle of open-unlearning's AltPO sweep
    # the spec's case (tests/training/methods/test_idkdpo.py), the perturbed answer in the preferred place
    out, batch = dpo_batch([1.0, 1.0, 0.0])
    assert altpo.sequence_loss(out, batch, altpo.params()).item() == pytest.approx(11.816546, abs=1e-5)
