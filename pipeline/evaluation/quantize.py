"""The quantization attack: evaluate an unlearned model again after rounding its weights to 8 or 4 bits.

Zhang et al. 2024 ("Catastrophic failure of LLM unlearning via quantization") find that unlearning often moves the
weights by less than a 4-bit grid step, so quantizing the unlearned model snaps it back towards the original and the
forgotten content returns. Two ways to quantize:

- `rtn`: weight-only round-to-nearest with asymmetric min-max scales per group of `group_size` consecutive input
  columns of each output row (group 128 at 4 bits is the common "w4g128" baseline). It runs anywhere: it is fake
  quantization, the weights are rounded to the integer grid and dequantized back into the model's dtype, so the model
  computes with exactly the values an integer kernel would see.
- `bnb`: the model loaded with bitsandbytes (LLM.int8 at 8 bits, NF4 at 4 bits), on CUDA only.

Both leave the LM head and the embeddings in full precision, as bitsandbytes and transformers do (the head's errors
go straight into the logits; a tied head is the same tensor as the input embedding).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from pipeline.common.errors import DataError, ParamError
from pipeline.common.adapters import unwrap_adapters
from pipeline.common.modeling import decoder
from pipeline.common.paths import require_local_or_hub

QUANT_METHODS = ("auto", "rtn", "bnb")
BITS = (2, 3, 4, 8)


def _check_bits(bits: int, allowed: tuple[int, ...] = BITS) -> None:
    if bits not in allowed:
        raise ParamError(f"evaluate.quantize.bits={bits!r}: must be one of {list(allowed)}")


def fake_quantize(weight: torch.Tensor, bits: int, group_size: int = 128) -> torch.Tensor:
    """`weight` [out, in] rounded to a `bits`-bit grid per group of `group_size` input columns, and dequantized."""
    _check_bits(bits)
    rows, cols = weight.shape
    g = cols if group_size <= 0 or group_size >= cols else group_size
    w = weight.detach().float()
    pad = -cols % g
    if pad:  # the last group is shorter: pad it with its own last value, which widens no group's range
        w = torch.cat([w, w[:, -1:].expand(rows, pad)], dim=1)
    w = w.reshape(rows, -1, g)
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    qmax = 2 ** bits - 1
    scale = (hi - lo) / qmax
    flat = scale == 0  # a constant group is exactly representable: keep it (and never divide by zero)
    scale = torch.where(flat, torch.ones_like(scale), scale)
    zero = torch.round(-lo / scale)  # the integer that stands for 0.0, so the grid spans [lo, hi]
    q = torch.clamp(torch.round(w / scale) + zero, 0, qmax)
    out = torch.where(flat, w, (q - zero) * scale)
    return out.reshape(rows, -1)[:, :cols].to(weight.dtype)


def quantizable_modules(model) -> list[tuple[str, torch.nn.Linear]]:
    """The decoder's linear layers, without the LM head and the embeddings (kept in full precision)."""
    model = unwrap_adapters(model)
    head = model.get_output_embeddings()
    skip = {id(model.get_input_embeddings().weight), id(head.weight) if head is not None else None}
    return [(name, m) for name, m in decoder(model).named_modules()
            if isinstance(m, torch.nn.Linear) and id(m.weight) not in skip]


@contextmanager
def rtn_quantized(model, bits: int, group_size: int = 128):
    """Inside the block the model's quantizable weights are fake-quantized in place; the block gets a report.
    The original weights come back exactly on exit, also on an exception."""
    _check_bits(bits)
    modules = quantizable_modules(model)
    saved = [(m.weight, m.weight.detach().to("cpu", copy=True)) for _, m in modules]  # copied before any change
    try:
        changed = total = 0.0
        with torch.no_grad():
            for weight, _ in saved:
                q = fake_quantize(weight, bits, group_size)
                changed += (q.float() - weight.float()).abs().sum().item()
                total += weight.float().abs().sum().item()
                weight.copy_(q)
        yield {
            "method": "rtn", "bits": bits, "group_size": group_size, "n_tensors": len(saved),
            "n_parameters": sum(w.numel() for w, _ in saved),
            "relative_change": changed / total if total else 0.0,  # mean |Δw| / mean |w|
        }
    finally:
        with torch.no_grad():
            for weight, original in saved:
                weight.copy_(original)


def bnb_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import bitsandbytes  # noqa: F401
    except Exception:  # a broken install (no CUDA library found) can raise more than ImportError
        return False
    return True


def resolve_method(method: str) -> str:
    """`auto`: bitsandbytes where it can run (CUDA), else RTN."""
    if method not in QUANT_METHODS:
        raise ParamError(f"evaluate.quantize.method={method!r}: must be one of {list(QUANT_METHODS)}")
    if method == "auto":
        return "bnb" if bnb_available() else "rtn"
    return method


def load_quantized_bnb(model_path: str, bits: int, trust_remote_code: bool = False):
    """The model loaded by bitsandbytes at 8 (LLM.int8) or 4 bits (NF4, bf16 compute), on the current GPU."""
    _check_bits(bits, (4, 8))
    if not torch.cuda.is_available():
        raise ParamError("evaluate.quantize.method=bnb: needs a CUDA GPU; use method rtn on CPU")
    if not bnb_available():
        raise ParamError("evaluate.quantize.method=bnb: bitsandbytes is not installed (pip install bitsandbytes)")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    if bits == 8:
        config = BitsAndBytesConfig(load_in_8bit=True)
    else:
        config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                    bnb_4bit_compute_dtype=torch.bfloat16)
    require_local_or_hub(model_path, "model")
    # load_model passes no quantization_config through, so the same safetensors-only load is done here
    try:
        return AutoModelForCausalLM.from_pretrained(
            str(model_path), quantization_config=config, dtype=torch.bfloat16, use_safetensors=True,
            trust_remote_code=trust_remote_code, device_map={"": torch.cuda.current_device()},
        )
    except (OSError, ValueError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise DataError(f"model '{model_path}': cannot be loaded with bitsandbytes ({first})") from None
