"""LoRA adapter directories: their files, the PEFT model inside a wrapped one, and the checks on a directory
before `peft` reads it (see the comment below), which `modeling.load_model` runs."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import fields
from pathlib import Path

import torch

from pipeline.common.errors import DataError

log = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"  # a directory of LoRA adapters (PEFT's files), written with `lora.save: adapter`
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_NOTE = "base_model.json"        # beside them: the base model the adapters belong to, and its hash


def unwrap_adapters(model):
    """The causal LM inside a PEFT model (LoRA adapters injected in its layers); any other model as it is."""
    get_base = getattr(type(model), "get_base_model", None)  # PeftModel's; transformers' models have none
    return model.get_base_model() if callable(get_base) else model


# --- Checks on an adapter directory before `peft` reads it -------------------------------------------------------
# PEFT trusts adapter_config.json and adapter_model.safetensors: a wrong base, a truncated file, a config that
# disagrees with its weights or with the base surface as tracebacks from deep inside peft/torch, or not at all (an
# adapter merged onto a model it was not trained on). These checks read only the JSON files and the safetensors
# header (never the tensors' data, never a pickle) and raise one DataError line naming the file and the problem.

_PEFT_PREFIX = "base_model.model."  # PEFT's prefix of the base's module names in the saved keys
_LORA_KEY = re.compile(r"(?P<module>.+)\.lora_(?P<which>[AB])\.weight")


def check_adapter(directory: str | Path, model=None, base: str | Path | None = None) -> str:
    """Check an adapter directory before PEFT loads it; returns the base model its config names.

    Without `model`: the config (JSON, a LoRA config this peft can build, no unknown fields that switch anything on)
    and that the bases it records (adapter_config.json's `base_model_name_or_path`, base_model.json's `base_model`)
    agree with each other and with `base`, the one it is about to be merged onto (default: the config's). Cheap: call
    it before loading the base. With `model` (the loaded base): also the weights file's header and every tensor's
    shape against the config and the base's modules; where no base_model.json records the base, a warning says the
    base could not be verified beyond those shapes."""
    directory = Path(directory)
    config = read_adapter_config(directory)
    recorded = config["base_model_name_or_path"]
    note = _read_note(directory)
    if note is not None and note.get("base_model") and not same_base(note["base_model"], recorded):
        raise DataError(f"{directory / ADAPTER_CONFIG}: base_model_name_or_path '{recorded}' disagrees with "
                        f"{ADAPTER_NOTE}'s base_model '{note['base_model']}' (the file was edited or mixed up)")
    if base is not None and not same_base(recorded, base):
        raise DataError(f"{directory / ADAPTER_CONFIG}: the adapter was trained on '{recorded}', not on '{base}', "
                        "onto which it was to be merged")
    if model is not None:
        check_adapter_shapes(directory, config, adapter_shapes(directory), model)
        if note is None or not note.get("base_model"):  # PEFT's own record only: anyone can have written it
            log.warning("adapter '%s': no %s records its base, so the base '%s' could not be verified (only its "
                        "module shapes fit the adapter)", directory, ADAPTER_NOTE, recorded)
    return str(base if base is not None else recorded)


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise DataError(f"{path}: not readable JSON ({str(e).splitlines()[0] if str(e) else type(e).__name__})") \
            from None
    if not isinstance(data, dict):
        raise DataError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def _read_note(directory: Path) -> dict | None:
    """base_model.json (this project's note of the base), or None where there is none."""
    path = directory / ADAPTER_NOTE
    return _read_json(path) if path.is_file() else None


# Fields a newer peft writes that this one lacks: dropped with a warning while they are off (None, False, empty),
# since a field at its "off" value switches nothing on (peft itself drops unknown fields, and every release adds
# some, so refusing them all would refuse every adapter a newer peft wrote). Set to anything else, such a field may
# switch on what this peft cannot compute, and the merge would silently differ: refused.
def _is_off(value) -> bool:
    return value is None or value is False or value in ([], {}, "")


def read_adapter_config(directory: Path) -> dict:
    """adapter_config.json as the keyword arguments of this peft's LoraConfig (checked by building one)."""
    from peft import LoraConfig

    path = Path(directory) / ADAPTER_CONFIG
    config = _read_json(path)
    if config.get("peft_type", "LORA") != "LORA":  # the loader merges LoRA's A and B only
        raise DataError(f"{path}: peft_type {config['peft_type']!r}: only LoRA adapters (LORA) can be loaded")
    if not config.get("base_model_name_or_path") or not isinstance(config["base_model_name_or_path"], str):
        raise DataError(f"{path}: does not name its base model (base_model_name_or_path)")
    known = {f.name for f in fields(LoraConfig)}
    unknown = sorted(set(config) - known)
    on = [k for k in unknown if not _is_off(config[k])]
    if on:
        raise DataError(f"{path}: unknown field(s) {on} for this peft ({_peft_version()}), set to values that may "
                        "change what the adapter computes; upgrade peft or remove them")
    if unknown:
        log.warning("%s: ignoring field(s) %s that this peft (%s) does not know (all off)", path, unknown,
                    _peft_version())
    config = {k: v for k, v in config.items() if k in known}
    try:
        LoraConfig(**{k: v for k, v in config.items() if k not in ("peft_type", "peft_version")})
    except (TypeError, ValueError) as e:
        raise DataError(f"{path}: not a valid LoRA config ({str(e).strip().splitlines()[0]})") from None
    if not isinstance(config.get("r", 8), int) or isinstance(config.get("r"), bool):
        raise DataError(f"{path}: r={config['r']!r}: expected an integer rank")
    if config.get("target_parameters"):  # LoRA on bare parameters: not a linear layer's A and B
        raise DataError(f"{path}: target_parameters is set; only LoRA on linear layers (target_modules) can be loaded")
    return config


def _peft_version() -> str:
    import peft

    return f"peft {peft.__version__}"


def same_base(a: str | Path, b: str | Path) -> bool:
    """Do two names of a base model name the same model? Local paths compare resolved (`./base` and its absolute
    path are one); hub names compare as written; a local path inside the hub cache's `models--owner--name` folder
    is that hub name."""
    a, b = str(a), str(b)
    if a == b:
        return True
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    if pa.exists() and pb.exists():
        return pa.resolve() == pb.resolve()
    if pa.exists() != pb.exists():  # one local, one hub name: equal only for a hub cache snapshot of that name
        local, hub = (pa, b) if pa.exists() else (pb, a)
        cached = f"models--{hub.replace('/', '--')}"
        return any(part == cached for part in local.resolve().parts)
    return a.rstrip("/") == b.rstrip("/")


def adapter_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape in adapter_model.safetensors, from its header (which safetensors checks against the
    file's length: a truncated or corrupt file fails here, with one line, rather than inside peft)."""
    from safetensors import SafetensorError, safe_open

    path = Path(directory) / ADAPTER_WEIGHTS
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except (SafetensorError, OSError) as e:
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"{path}: truncated or corrupt ({why}); rerun the stage that wrote it") from None


def _linear_dims(module) -> tuple[int, int] | None:
    """(in, out) features of a linear layer: torch's Linear, or transformers' Conv1D (GPT-2's, weight [in, out])."""
    if isinstance(module, torch.nn.Linear):
        return module.in_features, module.out_features
    if type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None:
        return tuple(module.weight.shape)
    return None


def _targeted(config: dict, model) -> set[str]:
    """The base's modules that the config puts adapters on (PEFT's own matching; all-linear as PEFT expands it:
    every linear layer but the output head)."""
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    targets = config.get("target_modules")
    if isinstance(targets, str) and targets == "all-linear":
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        return {n for n, m in model.named_modules() if _linear_dims(m) and m is not head}
    lora = LoraConfig(**{k: v for k, v in config.items() if k not in ("peft_type", "peft_version")})
    return {n for n, m in model.named_modules() if n and not list(m.children()) and check_target_module_exists(lora, n)}


def check_adapter_shapes(directory: Path, config: dict, shapes: dict, model) -> None:
    """The weights against the config (which modules, rank r or its rank_pattern) and against the base (each
    module exists, is linear, and A is [r, in], B [out, r]): a mismatch is named here, by module, instead of a
    size-mismatch traceback from torch, or adapters that PEFT silently leaves at their initial values."""
    from peft.utils.other import get_pattern_key

    path = Path(directory) / ADAPTER_WEIGHTS
    model = unwrap_adapters(model)
    pairs: dict[str, dict[str, tuple]] = {}
    for key, shape in shapes.items():
        match = _LORA_KEY.fullmatch(key.removeprefix(_PEFT_PREFIX))
        if match is None:  # DoRA's magnitudes, biases, modules_to_save...: the merge handles LoRA's A and B only
            raise DataError(f"{path}: tensor '{key}' is not a LoRA A or B weight; only LoRA on linear layers loads")
        pairs.setdefault(match["module"], {})[match["which"]] = shape
    if not pairs:
        raise DataError(f"{path}: holds no LoRA weights")
    modules = dict(model.named_modules())
    targeted = _targeted(config, model)
    rank_pattern = config.get("rank_pattern") or {}
    for name in sorted(pairs):
        a, b = pairs[name].get("A"), pairs[name].get("B")
        if a is None or b is None:
            has, lacks = ("A", "B") if b is None else ("B", "A")
            raise DataError(f"{path}: module '{name}' has lora_{has} but no lora_{lacks}")
        if name not in modules:
            raise DataError(f"{path}: module '{name}' does not exist in the base model ({type(model).__name__})")
        dims = _linear_dims(modules[name])
        if dims is None:
            raise DataError(f"{path}: module '{name}' is a {type(modules[name]).__name__} in the base model, not a "
                            "linear layer")
        if name not in targeted:
            raise DataError(f"{path}: module '{name}' has weights but {ADAPTER_CONFIG}'s target_modules "
                            f"({config.get('target_modules')!r}) does not select it")
        r = rank_pattern.get(get_pattern_key(rank_pattern.keys(), name), config.get("r", 8))
        fan_in, fan_out = dims
        if a != (r, fan_in) or b != (fan_out, r):
            raise DataError(f"{path}: module '{name}': lora_A {list(a)} and lora_B {list(b)}, but r={r} in "
                            f"{ADAPTER_CONFIG} and the base's layer ({fan_in} in, {fan_out} out) need lora_A "
                            f"{[r, fan_in]} and lora_B {[fan_out, r]}")
    missing = sorted(n for n in targeted if _linear_dims(modules[n]) and n not in pairs)
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise DataError(f"{path}: {ADAPTER_CONFIG}'s target_modules ({config.get('target_modules')!r}) selects "
                        f"{missing[:3]}{more}, for which the file holds no weights")
    odd = sorted(n for n in targeted if not _linear_dims(modules[n]))
    if odd:
        raise DataError(f"{path}: {ADAPTER_CONFIG}'s target_modules ({config.get('target_modules')!r}) selects "
                        f"non-linear layers {odd[:3]}; only linear layers can be loaded")
