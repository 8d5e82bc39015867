"""RMU: steer the hidden state at `rmu_layer` (a `hidden_states` index) towards c·u, u a fixed random unit vector
drawn from the seed, training only a few decoder layers below it. ℓ_i = ‖h_L(s_<i; θ) − c·u‖², the mean over the
hidden dimensions (RMU's MSE). The forget loss reads the hidden states alone: the LM head never runs on the forget
set. `rmu_layer` itself is a field of the run config, since RMU's retain term (`activation`) reads it too."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pipeline.common.errors import ParamError
from pipeline.common.modeling import decoder_layers
from pipeline.common.params import Rule, positive
from pipeline.training.lora import is_adapter_param, is_peft
from pipeline.training.methods.base import ForwardOut, Method, Prepared


@dataclass(frozen=True)
class Params:
    rmu_steer: float = 6.5                                 # c
    rmu_update_layers: list = field(default_factory=list)  # decoder layers updated; empty: the 3 below rmu_layer
    #                                                        (rmu_layer-3 .. rmu_layer-1)


LAYER_INDICES = Rule(lambda v: all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in v),
                     "a list of decoder layer indices (integers ≥ 0)")


def rmu_token_loss(hidden: torch.Tensor, control: torch.Tensor) -> torch.Tensor:
    """‖h_i − c·u‖² per token as a mean over hidden dimensions; `control` is c·u, broadcast over tokens."""
    return (hidden - control).pow(2).mean(-1)


def token_loss(out: ForwardOut, batch: dict, params: Params) -> torch.Tensor:
    # ℓ_i = ‖h_L(s_<i) − c·u‖²: the hidden state at position i−1 is the one that predicts token i.
    losses = torch.zeros_like(batch["weights"])
    losses[:, 1:] = rmu_token_loss(out.hidden[:, :-1].float(), batch["control"])
    return losses


def control_vector(hidden_size: int, steer: float, seed: int) -> torch.Tensor:
    """c·u with u a fixed random unit vector drawn from the seed."""
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(hidden_size, generator=g)
    return steer * u / u.norm()


def freeze_for_rmu(model, layer: int, update_layers: list) -> list[torch.nn.Parameter]:
    """Only the chosen decoder layers are trained (with LoRA, only their adapters); no gradient is computed for the
    rest."""
    layers = decoder_layers(model)
    chosen = update_layers or list(range(max(0, layer - 3), layer))
    if any(not 0 <= i < len(layers) for i in chosen) or layer > len(layers):
        raise ParamError(f"unlearn rmu layers {chosen} / rmu_layer={layer}: the model has {len(layers)} layers")
    for p in model.parameters():
        p.requires_grad_(False)
    adapters = is_peft(model)
    params = [p for i in chosen for n, p in layers[i].named_parameters() if not adapters or is_adapter_param(n)]
    for p in params:
        p.requires_grad_(True)
    return params


def prepare(model, params: Params, layer: int, seed: int) -> Prepared:
    trained = freeze_for_rmu(model, layer, params.rmu_update_layers)
    return Prepared(trained, {"control": control_vector(model.config.hidden_size, params.rmu_steer, seed)})


METHOD = Method("rmu", token_loss, Params, rules={"rmu_steer": positive(), "rmu_update_layers": LAYER_INDICES},
                inputs=("hidden",), prepare=prepare, title="RMU")
