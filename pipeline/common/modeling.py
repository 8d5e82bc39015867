"""Tokenizers and models: building, loading, saving, and the hashes that identify them.

The embedded default is a byte-level BPE tokenizer trained on the world's text and a small Llama built from a
config. Every stage loads models only through `AutoModelForCausalLM.from_pretrained`, so a hub name such as
`microsoft/phi-1_5` or a local Llama directory works the same way. Weights are read from safetensors only.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch

from pipeline.common.atomic import atomic_dir
from pipeline.common.adapters import ADAPTER_CONFIG, ADAPTER_NOTE, ADAPTER_WEIGHTS, check_adapter, unwrap_adapters
from pipeline.common.errors import DataError, ParamError
from pipeline.common.paths import hub_failure, hub_reachable, is_hub_name, require_local_or_hub

log = logging.getLogger(__name__)

SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>", "mask_token": "<mask>"}


@dataclass(frozen=True)
class TokenizerConfig:
    """The `tokenizer` section: the embedded model's byte-level BPE."""

    vocab_size: int
    min_frequency: int = 2


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str | Path, min_frequency: int = 2) -> None:
    """Train a byte-level BPE tokenizer and save it as a `transformers` fast tokenizer (atomically)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 300:
        raise ParamError(f"tokenizer.vocab_size={vocab_size}: must be at least 300 (256 bytes + special tokens)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    bos = SPECIAL_TOKENS["bos_token"]
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=True),  # offsets start at the word, not at its leading space
        processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, tok.token_to_id(bos))]),
    ])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=2048, **SPECIAL_TOKENS)
    with atomic_dir(out_dir) as tmp:
        fast.save_pretrained(tmp)


def load_tokenizer(name_or_path: str | Path, trust_remote_code: bool = False):
    """A fast (Rust) tokenizer from a directory or the hub: every stage needs its character offsets."""
    from transformers import AutoTokenizer

    require_local_or_hub(name_or_path, "tokenizer")
    hub = is_hub_name(name_or_path)
    if hub:
        hub_reachable()  # unreachable: the cache is read at once, instead of after a minute of retries
    try:
        tok = AutoTokenizer.from_pretrained(str(name_or_path), use_fast=True, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        if hub:
            raise hub_failure(str(name_or_path), "tokenizer", e) from None
        raise DataError(f"tokenizer '{name_or_path}': cannot be loaded ({_first_line(e)})") from None
    if not getattr(tok, "is_fast", False):
        raise DataError(
            f"tokenizer '{name_or_path}': only a slow (Python) {type(tok).__name__} exists for it; TokenUnlearn needs "
            "a fast tokenizer (tokenizer.json) for character offsets: convert it with transformers where a converter "
            "exists (AutoTokenizer.from_pretrained(..., use_fast=True).save_pretrained(...)), or use the model's "
            "fast tokenizer"
        )
    if tok.pad_token_id is None:  # Llama and Phi ship without a pad token; padding is always masked out
        tok.pad_token = tok.eos_token
    return tok


def build_model(config: dict, tokenizer, seed: int):
    """A fresh LlamaForCausalLM sized by `config` (hidden size, layers, heads, ...) for this tokenizer."""
    import inspect

    from transformers import LlamaConfig, LlamaForCausalLM

    # A config class takes unknown keywords silently (it keeps them as attributes): a typo would build the
    # default size. Only the keys its constructor names, or the common config attributes, are accepted.
    known = set(inspect.signature(LlamaConfig.__init__).parameters) | set(LlamaConfig().to_dict())
    known -= {"self", "kwargs"}
    unknown = sorted(set(config) - known)
    if unknown:
        raise ParamError(f"model.config: unknown key(s) {unknown} for LlamaConfig")
    try:
        cfg = LlamaConfig(
            vocab_size=len(tokenizer),
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            **config,
        )
    except (TypeError, ValueError) as e:
        raise ParamError(f"model.config: {e}") from None
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def load_model(name_or_path: str | Path, dtype: torch.dtype | None = None, trust_remote_code: bool = False):
    """Load a causal LM from a directory or the hub, from safetensors only (never unpickle)."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    require_local_or_hub(name_or_path, "model")
    hub = is_hub_name(name_or_path)
    if hub:
        hub_reachable()  # unreachable: the cache is read at once, instead of after a minute of retries
    local = Path(name_or_path)
    if local.is_dir() and (local / ADAPTER_CONFIG).is_file():
        return _load_adapter(local, dtype, trust_remote_code)
    if local.is_dir() and not any(local.glob("*.safetensors")) and any(local.glob("*.bin")):
        raise DataError(_pickle_only(str(name_or_path)))
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(name_or_path), dtype=dtype, use_safetensors=True, trust_remote_code=trust_remote_code
        )
    except SafetensorError as e:
        raise DataError(f"model '{name_or_path}': a safetensors file is truncated or corrupt ({_first_line(e)}); "
                        "rerun the stage that wrote it, or download it again") from None
    except (OSError, ValueError, EnvironmentError) as e:
        if "safetensors" in str(e) and (".bin" in str(e) or "pytorch_model" in str(e)):
            raise DataError(_pickle_only(str(name_or_path))) from None
        if hub:
            raise hub_failure(str(name_or_path), "model", e) from None
        raise DataError(f"model '{name_or_path}': cannot be loaded ({_first_line(e)})") from None
    return model


def _load_adapter(directory: Path, dtype: torch.dtype | None, trust_remote_code: bool):
    """A directory of LoRA adapters (`lora.save: adapter`): its base model (adapter_config.json's
    `base_model_name_or_path`, checked against the hash in base_model.json), the adapters attached with `peft` from
    safetensors only, and merged: the plain model, as a merged run would have written it."""
    if not (directory / ADAPTER_WEIGHTS).is_file():
        pickled = " (only pickle weights, adapter_model.bin, which TokenUnlearn never loads)" \
            if (directory / "adapter_model.bin").is_file() else ""
        raise DataError(f"model '{directory}': an adapter directory without {ADAPTER_WEIGHTS}{pickled}")
    base = check_adapter(directory)  # its config and recorded base agree, before any base is loaded
    from transformers.integrations import is_deepspeed_zero3_enabled

    if is_deepspeed_zero3_enabled():  # the merge needs whole weights, which ZeRO-3 partitions as they load
        raise DataError(f"model '{directory}': adapters cannot be loaded under ZeRO-3; write the run with "
                        "lora.save: merged, or use zero_stage 0 to 2")
    try:
        model = load_model(base, dtype=dtype, trust_remote_code=trust_remote_code)
    except DataError as e:
        raise DataError(f"model '{directory}': its base model: {e}") from None
    note = directory / ADAPTER_NOTE
    expected = json.loads(note.read_text()).get("base_model_hash") if note.is_file() else None
    if expected is not None and model_hash(model, base) != expected:
        raise DataError(f"model '{directory}': its base model '{base}' is not the one the adapters were trained on "
                        f"(hash {model_hash(model, base)}, {ADAPTER_NOTE} says {expected})")
    check_adapter(directory, model, base)  # the weights' header and shapes against the config and the base
    from peft import PeftModel

    return PeftModel.from_pretrained(model, str(directory), is_trainable=False).merge_and_unload()


def _pickle_only(name: str) -> str:
    return (f"model '{name}': has only PyTorch pickle weights (*.bin), which TokenUnlearn never loads (unpickling can "
            "run code); convert them once, where you trust the file: python -c \"from transformers import "
            f"AutoModelForCausalLM, AutoTokenizer; m = '{name}'; "
            "AutoModelForCausalLM.from_pretrained(m, use_safetensors=False).save_pretrained('converted'); "
            "AutoTokenizer.from_pretrained(m).save_pretrained('converted')\", then use the directory 'converted'")


def decoder(model):
    """The decoder stack under a causal LM's head (embeddings, layers, final norm): what attribution runs to get
    the hidden states the head reads, and whose layers RMU steers and trains. `get_decoder()` where the family
    defines it (Gemma 3's `base_model` is the CausalLM itself), else `base_model` (GPT-NeoX returns itself). A PEFT
    model's is its base model's (the adapters sit in its layers)."""
    model = unwrap_adapters(model)
    inner = model.get_decoder() if hasattr(model, "get_decoder") else None
    if inner is None or inner is model:
        inner = model.base_model
    if inner is model or not isinstance(getattr(inner, "layers", None), torch.nn.ModuleList):
        raise DataError(f"{type(model).__name__}: its decoder layers cannot be found (neither get_decoder() nor "
                        "base_model holds a `layers` list); this model family is not supported")
    return inner


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder's layers, in order: `hidden_states[i]` of a forward pass is the output of layer i (1-based)."""
    return decoder(model).layers


def lm_head_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """The model's next-token logits (fp32) from decoder hidden states, as its own forward computes them (Gemma 2's
    final soft-capping included): used where only some positions need logits, so no [batch, length, vocab] tensor
    is made for the rest."""
    model = unwrap_adapters(model)
    logits = model.get_output_embeddings()(hidden).float()
    cap = getattr(model.config, "final_logit_softcapping", None)  # Gemma 2
    return cap * torch.tanh(logits / cap) if cap else logits


POSITION_LIMITS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def check_vocab(model, tokenizer, where: str, max_length: int | None = None) -> None:
    """The tokenizer fits the model's embedding, and `max_length` (data.max_length) its position limit: a longer
    sample would run past the positions the model was trained on, without an error from the model itself."""
    weight = model.get_input_embeddings().weight
    rows = getattr(weight, "ds_shape", weight.shape)[0]  # under ZeRO-3 the loaded weight is a partition
    if len(tokenizer) > rows:
        raise DataError(
            f"{where}: the tokenizer has {len(tokenizer)} tokens but the model's embedding has {rows} rows "
            "(model and tokenizer do not belong together)"
        )
    config = getattr(model, "config", None)
    recorded = getattr(config, "tokenizer_vocab_hash", None)
    if recorded is not None and recorded != vocab_hash(tokenizer):
        raise DataError(f"{where}: the tokenizer's vocabulary (hash {vocab_hash(tokenizer)}) is not the one the "
                        f"model was written with (config.json's tokenizer_vocab_hash {recorded}): the weights and the "
                        "tokenizer files do not belong together; use the tokenizer written with the model")
    limit = next((getattr(config, k) for k in POSITION_LIMITS if isinstance(getattr(config, k, None), int)), None)
    if max_length is not None and limit is not None and max_length > limit:
        raise ParamError(f"data.max_length={max_length}: longer than {where}'s position limit ({limit} tokens); "
                         f"set data.max_length to at most {limit}")


def write_model(model, tokenizer, directory: str | Path, state_dict: dict | None = None) -> None:
    """Write Hugging Face format (safetensors) with the tokenizer into `directory`; config.json notes the
    tokenizer's vocabulary (`vocab_hash`), so that weights given another tokenizer of the same size are refused."""
    model.config.tokenizer_vocab_hash = vocab_hash(tokenizer)
    model.save_pretrained(directory, state_dict=state_dict, safe_serialization=True)
    tokenizer.save_pretrained(directory)


def save_model(model, tokenizer, out_dir: str | Path, state_dict: dict | None = None) -> None:
    """`write_model`, atomically."""
    with atomic_dir(out_dir) as tmp:
        write_model(model, tokenizer, tmp, state_dict)


def file_hash(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for path in sorted(paths):
        h.update(path.name.encode())
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:16]


def model_hash(model, name_or_path: str) -> str:
    """A hash of the model's config and weights: the files of a local directory or of the hub cache's snapshot,
    else the tensors (a model built in memory)."""
    local = Path(name_or_path)
    if not local.is_dir():
        try:
            from huggingface_hub import snapshot_download

            local = Path(snapshot_download(str(name_or_path), local_files_only=True))
        except Exception:  # not a hub name, or not in the cache
            pass
    if local.is_dir() and (local / ADAPTER_CONFIG).is_file():  # adapters: theirs, and the base's hash in the note
        return file_hash([local / ADAPTER_CONFIG, *local.glob("*.safetensors"), *local.glob(ADAPTER_NOTE)])
    if local.is_dir():
        return file_hash([local / "config.json", *local.glob("*.safetensors")])
    h = hashlib.sha256(model.config.to_json_string().encode())
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def tokenizer_hash(tokenizer) -> str:
    blob = tokenizer.backend_tokenizer.to_str() + json.dumps(tokenizer.special_tokens_map, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def vocab_hash(tokenizer) -> str:
    """The token → id map and the special tokens: what must agree between weights and tokenizer (unlike
    `tokenizer_hash`, unchanged by a stage's truncation or padding settings)."""
    blob = json.dumps([sorted(tokenizer.get_vocab().items()), tokenizer.special_tokens_map], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
