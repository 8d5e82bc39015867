"""Small random-weight models of the families users unlearn, each built from its own `transformers` config class,
with a tokenizer that behaves as the family's does where it matters to the pipeline: whether the post-processor
adds a BOS, which special tokens exist (no pad token for Llama, Mistral, Phi and GPT-NeoX), the EOS, and the chat
template (a system turn, Llama 3's date header, Qwen 3's thinking switch, Gemma's refusal of a system turn).

The tokenizers are byte-level BPEs trained on the micro world's text (real vocabularies need the hub), and the
models are saved with `save_pretrained` and read back by the stages through `from_pretrained`, as a user's are.
Used by tests/test_families.py and by `python -m tests.family_matrix`, which writes docs/real-models.md's table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

# ---- chat templates: the behaviour of each family's own, written small -------------------------------------

LLAMA2_CHAT = (
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
    "{% set messages = messages[1:] %}{% else %}{% set system = '' %}{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}{{ bos_token }}[INST] "
    "{% if loop.first and system %}<<SYS>>\n{{ system }}\n<</SYS>>\n\n{% endif %}{{ m['content'] }} [/INST]"
    "{% else %} {{ m['content'] }} {{ eos_token }}{% endif %}{% endfor %}"
)
# Llama 3.1: always a system turn, with the knowledge cutoff and today's date (open-unlearning passes date_string).
LLAMA3_CHAT = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
    "{% set messages = messages[1:] %}{% else %}{% set system = '' %}{% endif %}"
    "{% if date_string is not defined %}{% set date_string = '26 Jul 2024' %}{% endif %}"
    "<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
    "Today Date: {{ date_string }}\n\n{{ system }}<|eot_id|>"
    "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}"
    "<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% endif %}"
)
# Qwen 2.5: a default system turn when none is given.
QWEN2_CHAT = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. "
    "You are a helpful assistant.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen 3: no default system turn; `enable_thinking=False` writes an empty thinking block.
QWEN3_CHAT = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
MISTRAL_CHAT = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% elif m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported') }}{% endif %}{% endfor %}"
)
GEMMA_CHAT = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "<start_of_turn>{{ role }}\n{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
PHI3_CHAT = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% else %}{{ eos_token }}{% endif %}"
)


@dataclass(frozen=True)
class TokenizerStyle:
    """What a family's tokenizer does that the pipeline depends on."""

    eos: str
    bos: str | None = None          # the BOS token, if the vocabulary has one
    add_bos: bool = False           # the post-processor prepends it (Llama, Mistral, Gemma); GPT-2-style ones do not
    pad: str | None = None          # None: no pad token (the stages fall back to EOS)
    unk: str | None = None
    extra: tuple[str, ...] = ()     # the chat format's own special tokens
    chat_template: str | None = None


STYLES = {
    "llama2": TokenizerStyle("</s>", "<s>", True, None, "<unk>", chat_template=LLAMA2_CHAT),
    "llama3": TokenizerStyle("<|eot_id|>", "<|begin_of_text|>", True, None, None,
                             ("<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>"), LLAMA3_CHAT),
    "mistral": TokenizerStyle("</s>", "<s>", True, None, "<unk>", chat_template=MISTRAL_CHAT),
    "qwen2": TokenizerStyle("<|im_end|>", None, False, "<|endoftext|>", None, ("<|im_start|>",), QWEN2_CHAT),
    "qwen3": TokenizerStyle("<|im_end|>", None, False, "<|endoftext|>", None, ("<|im_start|>", "<think>",
                                                                                 "</think>"), QWEN3_CHAT),
    "gemma": TokenizerStyle("<eos>", "<bos>", True, "<pad>", "<unk>", ("<start_of_turn>", "<end_of_turn>"),
                            GEMMA_CHAT),
    "phi3": TokenizerStyle("<|endoftext|>", "<s>", True, None, "<unk>",
                           ("<|user|>", "<|assistant|>", "<|system|>", "<|end|>"), PHI3_CHAT),
    # GPT-2 / CodeGen / GPT-NeoX: one <|endoftext|> token for BOS and EOS, none added, no pad, no chat template
    "gpt2": TokenizerStyle("<|endoftext|>", "<|endoftext|>", False, None, "<|endoftext|>"),
}


@dataclass(frozen=True)
class Family:
    name: str
    config_class: str                  # a `transformers` config class
    style: str                         # a key of STYLES
    template: str | dict               # data.template for this family
    config: dict = field(default_factory=dict)  # the family's own options (rotary, attention, tying, softcap)


SIZE = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
        "max_position_embeddings": 256}

FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llama2", "LlamaConfig", "llama2", "llama2-chat", {"num_key_value_heads": 2}),
    Family("llama3", "LlamaConfig", "llama3", "chat",   # Llama 3.2 1B: tied embeddings, grouped-query attention
           {"num_key_value_heads": 1, "tie_word_embeddings": True, "rope_theta": 500000.0,
            "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 64}}),
    Family("mistral", "MistralConfig", "mistral", "chat", {"num_key_value_heads": 1, "sliding_window": 16}),
    Family("qwen2", "Qwen2Config", "qwen2", "chat", {"num_key_value_heads": 1, "tie_word_embeddings": True}),
    Family("qwen3", "Qwen3Config", "qwen3", "qwen3", {"num_key_value_heads": 1, "head_dim": 16}),  # thinking off
    Family("phi", "PhiConfig", "gpt2", "phi", {"partial_rotary_factor": 0.5}),
    Family("phi3", "Phi3Config", "phi3", "chat", {"num_key_value_heads": 2}),
    Family("gemma", "GemmaConfig", "gemma", "chat", {"num_key_value_heads": 1, "head_dim": 16}),
    Family("gemma2", "Gemma2Config", "gemma", "chat",    # logit soft-capping, alternating sliding-window layers
           {"num_key_value_heads": 1, "head_dim": 16, "sliding_window": 16, "final_logit_softcapping": 30.0}),
    Family("gemma3", "Gemma3TextConfig", "gemma", "chat", {"num_key_value_heads": 1, "head_dim": 16,
                                                             "sliding_window": 16}),
    Family("gpt_neox", "GPTNeoXConfig", "gpt2", "plain", {"rotary_pct": 0.25}),
)}


def build_tokenizer(style: TokenizerStyle, texts: Iterable[str], out_dir: Path, vocab_size: int = 400):
    """A byte-level BPE trained on `texts` with the style's special tokens, post-processor and chat template,
    saved as a `transformers` fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = list(dict.fromkeys(t for t in (style.bos, style.eos, style.pad, style.unk, *style.extra) if t))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    steps = [processors.ByteLevel(trim_offsets=True)]
    if style.add_bos:
        steps.append(processors.TemplateProcessing(single=f"{style.bos} $A", pair=f"{style.bos} $A $B",
                                                   special_tokens=[(style.bos, tok.token_to_id(style.bos))]))
    tok.post_processor = processors.Sequence(steps)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=style.bos, eos_token=style.eos,
                                   pad_token=style.pad, unk_token=style.unk, chat_template=style.chat_template,
                                   additional_special_tokens=list(style.extra), model_max_length=SIZE[
                                       "max_position_embeddings"])
    fast.save_pretrained(out_dir)
    return fast


def build_model(family: Family, tokenizer, out_dir: Path, seed: int = 0) -> Path:
    """A random-weight model of `family` sized for the tests, saved (safetensors) with its tokenizer."""
    import torch
    import transformers

    config = getattr(transformers, family.config_class)(
        vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, **SIZE, **family.config)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def build_family(name: str, texts: list[str], out_dir: Path, seed: int = 0) -> Path:
    """Tokenizer and model of family `name` in `out_dir` (a model directory as a user has one)."""
    family = FAMILIES[name]
    tokenizer = build_tokenizer(STYLES[family.style], texts, out_dir)
    return build_model(family, tokenizer, out_dir, seed)
