"""LoRA adapters (`peft`) as a training option of every method and of finetuning: the `lora` key of the train config.

With adapters only the low-rank matrices train and the base stays frozen, so the base *is* θ_o: `reference_view`
switches the adapters off for a reference forward pass (the exact KL, RMU's activations) with no second model in
memory. A run writes either the merged model (`save: merged`, a plain Hugging Face model like any stage's output)
or the adapter (`save: adapter`: PEFT's adapter_model.safetensors and adapter_config.json, the tokenizer and
`base_model.json`, a note of the base model and its hash), which `pipeline.common.modeling.load_model` loads back
onto its base.
"""

from __future__ import annotations

import json
import logging
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch

from pipeline.common.errors import ParamError, TokenUnlearnError
from pipeline.common.adapters import ADAPTER_NOTE, unwrap_adapters
from pipeline.common.modeling import model_hash, write_model
from pipeline.common.params import at_least, between, check_rules, dataclass_from_params, one_of, positive

log = logging.getLogger(__name__)

ADAPTER = "default"  # PEFT's name of the one adapter a run trains


@dataclass(frozen=True)
class LoraSpec:
    """The `lora` mapping of a train config (an empty mapping: no adapters)."""

    r: int = 16                     # rank
    alpha: float = 32.0             # scaling alpha / r
    dropout: float = 0.0            # on the adapters' input; > 0 makes N processes differ from one (other masks)
    target_modules: str | list = field(default="all-linear", metadata={"types": (str, list)})
    save: str = "merged"            # merged: a plain Hugging Face model | adapter: the adapter and a note of the base

    RULES = {"r": at_least(1), "alpha": positive(), "dropout": between(0, 1, hi_open=True),
             "save": one_of(["merged", "adapter"])}

    @classmethod
    def from_params(cls, values: dict, where: str) -> "LoraSpec | None":
        """`where`: the full key of the mapping (`unlearn.train.lora`); None for an empty mapping."""
        if not isinstance(values, dict):
            raise ParamError(f"{where}={values!r}: expected a mapping such as {{r: 16, alpha: 32}} (null: off)")
        if not values:
            return None
        spec = dataclass_from_params(cls, values, where)
        check_rules(spec, cls.RULES, where)
        targets = spec.target_modules
        if isinstance(targets, str) and not targets.strip() or isinstance(targets, list) and (
                not targets or not all(isinstance(t, str) and t for t in targets)):
            raise ParamError(f"{where}.target_modules={targets!r}: expected 'all-linear', a module name pattern or "
                             "a non-empty list of module names (q_proj, v_proj, ...)")
        require_peft()  # with the params, not at the first step
        return spec

    def peft_config(self):
        require_peft()
        from peft import LoraConfig

        return LoraConfig(r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout, bias="none",
                          target_modules=self.target_modules, task_type="CAUSAL_LM")


def require_peft() -> None:
    """PEFT imported, or one line naming what is wrong: not installed, or its import guard refusing this environment
    (a transformers or torch version it does not support raises at import, ImportError or not)."""
    try:
        import peft  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any failure of the import is the environment's, reported as such
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise TokenUnlearnError(f"train.lora needs PEFT, and `import peft` failed ({type(e).__name__}: {reason}); "
                                "install the version pyproject.toml pins (pip install -e .), or set train.lora: null"
                                ) from None


def is_peft(model) -> bool:
    return unwrap_adapters(model) is not model


def is_adapter_param(name: str) -> bool:
    """A parameter of the adapters (LoRA's A and B), by its name."""
    return ".lora_" in name or name.startswith("lora_")


def apply_lora(model, spec: LoraSpec, where: str = "lora"):
    """Wrap `model` in a PEFT model with fresh adapters (A random from the current seed, B = 0: the wrapped model
    computes exactly what the base does until it trains); the base parameters are frozen."""
    require_peft()
    from peft import get_peft_model
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer

    try:
        wrapped = get_peft_model(model, spec.peft_config())
    except ValueError as e:  # e.g. "Target modules {...} not found in the base model"
        raise ParamError(f"{where}.target_modules={spec.target_modules!r}: {str(e).strip().splitlines()[0]}") from None
    other = sorted({type(m).__name__ for m in wrapped.modules() if isinstance(m, LoraLayer)
                    and not isinstance(m, LoraLinear)})
    if other:  # the merge below and the adapter loader handle linear layers (LoRA's A, B) only
        raise ParamError(f"{where}.target_modules={spec.target_modules!r}: selects non-linear layers ({other}); "
                         "name linear layers only (or all-linear)")
    trained = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    log.info("LoRA r=%d alpha=%g on %s: %d trainable parameters", spec.r, spec.alpha, spec.target_modules, trained)
    return wrapped


@contextmanager
def reference_view(model) -> Iterator[torch.nn.Module | None]:
    """The frozen base θ_o of a model with adapters, for free: inside the block the adapters are switched off and the
    model (a PeftModel, or the one inside a DeepSpeed engine) computes what the base computes, in eval mode. Yields
    None for a model without adapters (θ_o must then come from elsewhere: the cache, or a second model). Use it
    under `torch.no_grad()`; training mode and every parameter's `requires_grad` are restored on exit (PEFT's own
    context would mark every adapter trainable again, RMU's frozen ones included)."""
    net = getattr(model, "module", model)  # a DeepSpeed engine holds the model as `module`
    if not is_peft(net):
        yield None
        return
    flags = [(p, p.requires_grad) for p in net.parameters()]
    was_training = net.training
    try:
        with net.disable_adapter():
            net.eval()
            yield net
    finally:
        net.train(was_training)
        for p, flag in flags:
            p.requires_grad_(flag)


def merged_state_dict(model, state_dict: dict) -> dict:
    """A PEFT model's full state dict (`model.state_dict()`, or the one DeepSpeed gathers under ZeRO-3) as the plain
    base model's: each adapted weight W + (alpha / r)·B·A, in W's dtype (summed in fp32), and the base's own key
    names. What `merge_and_unload()` computes, without touching the (possibly partitioned) live model."""
    from peft.tuners.lora import LoraLayer
    from peft.utils import transpose

    out = dict(state_dict)
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer) or ADAPTER not in module.lora_A:
            continue
        key = f"{name}.base_layer.weight"
        a, b = out.pop(f"{name}.lora_A.{ADAPTER}.weight"), out.pop(f"{name}.lora_B.{ADAPTER}.weight")
        delta = transpose(b.float() @ a.float(), module.fan_in_fan_out) * module.scaling[ADAPTER]
        out[key] = (out[key].float() + delta).to(out[key].dtype)
    prefix = "base_model.model."
    merged = {}
    for key, value in out.items():
        if is_adapter_param(key):
            raise ValueError(f"{key}: an adapter weight the merge does not know")
        merged[key.removeprefix(prefix).replace(".base_layer.", ".")] = value
    return merged


def adapter_state_dict(state_dict: dict) -> dict:
    return {k: v for k, v in state_dict.items() if is_adapter_param(k)}


def write_adapter(model, tokenizer, directory: str | Path, state_dict: dict, spec: LoraSpec, base: str) -> None:
    """PEFT's adapter files, the tokenizer, and `base_model.json`: the base (as the run named it) and its hash, which
    `load_model` checks before it attaches the adapter."""
    directory = Path(directory)
    model.peft_config[ADAPTER].base_model_name_or_path = str(base)
    model.save_pretrained(str(directory), state_dict=adapter_state_dict(state_dict), safe_serialization=True,
                          save_embedding_layers=False)
    tokenizer.save_pretrained(directory)
    note = {"base_model": str(base), "base_model_hash": model_hash(unwrap_adapters(model), str(base)),
            "lora": asdict(spec)}
    (directory / ADAPTER_NOTE).write_text(json.dumps(note, indent=2) + "\n")


def write_trained(model, tokenizer, directory: str | Path, state_dict: dict | None, spec: LoraSpec | None,
                  base: str, write: Callable = write_model) -> None:
    """Write a trained model with `write` (`write_model`): as it is without adapters; with them, the merged model
    or the adapter (`save`)."""
    if spec is None or not is_peft(model):
        write(model, tokenizer, directory, state_dict)
        return
    state_dict = state_dict if state_dict is not None else model.state_dict()
    if spec.save == "merged":
        write(unwrap_adapters(model), tokenizer, directory, merged_state_dict(model, state_dict))
    else:
        write_adapter(model, tokenizer, directory, state_dict, spec, base)
