"""AltPO (Mekala et al. 2024, "Alternate Preference Optimization for Unlearning Factual Knowledge in LLMs"): IdkDPO's
loss (`idkdpo.sequence_loss`, DPO with open-unlearning's 2/β) with an alternative answer preferred to the forget
answer instead of "I don't know", as its authors' `dpo` branch (molereddy/Alternate-Preference-Optimization,
dataloader.py) and open-unlearning's community AltPO (its DPO trainer) compute it.

The alternative: the authors generate alternates with the model being unlearned (open-unlearning's AltPO reads them
pre-generated, JSON lines with an `alternate`). Here it is one of the row's TOFU `perturbed_answer`s (the embedded
world's and real TOFU's `<split>_perturbed` files), fixed per question, with θ_o's Σ log p of it from stage one
(`attribution.alternatives: [perturbed]`): stage one has no generation step, and TOFU's perturbed answers are
plausible wrong answers of the same form, which is what AltPO's generated alternates are meant to be.
(`pipeline.attribution.alternatives` says more.) ω enters the forget answer's term only, as for IdkDPO.

β = 0.1, the middle of open-unlearning's AltPO sweep (β ∈ {0.05, 0.1, 0.5}). Retain: none of its own; the authors
add retain NLL with weight 1 (open-unlearning's sweep: α ∈ {1, 2, 5}): here `retain_loss: nll, retain_weight: 1`.
"""

from __future__ import annotations

from pipeline.common.params import positive
from pipeline.training.methods import idkdpo
from pipeline.training.methods.base import Method

METHOD = Method("altpo", None, idkdpo.Params, rules={"beta": positive()}, sequence_loss=idkdpo.sequence_loss,
                inputs=("logp", "alternative_logp"), alternative="perturbed", title="AltPO")
