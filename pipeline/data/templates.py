"""Prompt formats per model family, and tokenization of a question-answer pair with character offsets.

The prompt and the answer are tokenized separately and concatenated, so the prompt's token ids are the
same at training time and at generation time. Later stages mask tokens by character spans, so every
encoded sample carries the offset mapping of its tokens into `text`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from pipeline.common.errors import DataError, ParamError

Span = tuple[int, int]


@dataclass(frozen=True)
class PromptTemplate:
    """`prefix + question + suffix` is the prompt; the answer follows it directly."""

    name: str
    prefix: str = ""
    suffix: str = ""
    uses_chat_template: bool = False

    def prompt(self, question: str, tokenizer=None) -> tuple[str, Span]:
        """The prompt text and the question's character span in it."""
        if not self.uses_chat_template:
            start = len(self.prefix)
            return f"{self.prefix}{question}{self.suffix}", (start, start + len(question))
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ParamError(f"template '{self.name}' needs a tokenizer with a chat template")
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True,
            enable_thinking=False,  # Qwen3: answer directly, as the TOFU finetunes do
        )
        start = text.rfind(question)
        if start < 0:
            raise DataError(f"template '{self.name}': the chat template did not keep the question verbatim")
        return text, (start, start + len(question))


TEMPLATES: dict[str, PromptTemplate] = {
    t.name: t
    for t in (
        PromptTemplate("phi", prefix="Question: ", suffix="\nAnswer: "),
        PromptTemplate("llama2-chat", prefix="[INST] ", suffix=" [/INST] "),
        PromptTemplate("qwen3", uses_chat_template=True),
        PromptTemplate("plain", suffix="\n"),
    )
}


def get_template(name: str) -> PromptTemplate:
    try:
        return TEMPLATES[name]
    except KeyError:
        raise ParamError(f"data.template='{name}': unknown template (choose from {sorted(TEMPLATES)})") from None


@dataclass
class EncodedSample:
    text: str                  # prompt + answer
    input_ids: list[int]       # prompt ids, answer ids, EOS
    labels: list[int]          # -100 on the prompt; the answer ids and EOS
    offsets: list[Span]        # each token's character span in `text`; EOS gets (len, len)
    question_span: Span
    answer_span: Span
    prompt_length: int         # number of prompt tokens

    def __len__(self) -> int:
        return len(self.input_ids)


IGNORE_INDEX = -100


def _encode(tokenizer, text: str, add_special_tokens: bool) -> tuple[list[int], list[Span]]:
    if not getattr(tokenizer, "is_fast", False):
        raise ParamError(
            f"tokenizer {type(tokenizer).__name__} gives no offset mapping: a fast (Rust) tokenizer is needed"
        )
    enc = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]


def encode_prompt(tokenizer, template: PromptTemplate, question: str) -> tuple[str, Span, list[int], list[Span]]:
    """The prompt text, the question's span in it, and its token ids and offsets (as used in training)."""
    prompt, q_span = template.prompt(question, tokenizer)
    # A chat template already holds its special tokens; a plain template gets the tokenizer's BOS, if any.
    ids, offsets = _encode(tokenizer, prompt, add_special_tokens=not template.uses_chat_template)
    return prompt, q_span, ids, offsets


def encode_qa(tokenizer, template: PromptTemplate, question: str, answer: str) -> EncodedSample:
    prompt, q_span, p_ids, p_off = encode_prompt(tokenizer, template, question)
    a_ids, a_off = _encode(tokenizer, answer, add_special_tokens=False)
    if tokenizer.eos_token_id is None:
        raise ParamError(f"tokenizer {tokenizer.name_or_path!r} has no EOS token")
    text = prompt + answer
    shift = len(prompt)
    offsets = p_off + [(s + shift, e + shift) for s, e in a_off] + [(len(text), len(text))]
    input_ids = p_ids + a_ids + [tokenizer.eos_token_id]
    labels = [IGNORE_INDEX] * len(p_ids) + a_ids + [tokenizer.eos_token_id]
    return EncodedSample(text, input_ids, labels, offsets, q_span, (shift, len(text)), len(p_ids))


def encode_text(tokenizer, text: str) -> EncodedSample:
    """A passage as a sample: BOS (if the tokenizer has one) and its tokens, every token after the first labelled
    (the tokens corpus-mode attribution scores, and the retain corpus trains on; no prompt, no EOS)."""
    ids, offsets = _encode(tokenizer, text, add_special_tokens=True)
    return EncodedSample(text, ids, [IGNORE_INDEX] + ids[1:], offsets, (0, 0), (0, len(text)), 0)


def _within_length(samples: Iterable[EncodedSample], max_length: int, where: str, what: str, skip_too_long: bool,
                   on_skip: Callable[[int], None] | None) -> list[EncodedSample]:
    """The samples (numbered from 1 as `what`) that fit `max_length`; a longer one is an error naming it, or
    skipped if asked."""
    out = []
    for i, sample in enumerate(samples, start=1):
        if len(sample) > max_length:
            if skip_too_long:
                if on_skip:
                    on_skip(i)
                continue
            raise DataError(
                f"{where}: {what} {i}: {len(sample)} tokens exceed data.max_length={max_length} "
                "(raise max_length, or set data.skip_too_long: true to skip and count such rows)"
            )
        out.append(sample)
    return out


def encode_rows(
    tokenizer,
    template: PromptTemplate,
    rows: list[dict],
    max_length: int,
    where: str,
    skip_too_long: bool = False,
    on_skip: Callable[[int], None] | None = None,
) -> list[EncodedSample]:
    """Encode question-answer rows; a row longer than `max_length` is an error naming it, or skipped if asked."""
    samples = (encode_qa(tokenizer, template, row["question"], row["answer"]) for row in rows)
    return _within_length(samples, max_length, where, "row", skip_too_long, on_skip)


def encode_texts(tokenizer, texts: Iterable[str], max_length: int, where: str, what: str = "passage",
                 skip_too_long: bool = False) -> list[EncodedSample]:
    """Encode passages (`encode_text`); one longer than `max_length` is an error naming it, or skipped if asked."""
    return _within_length((encode_text(tokenizer, t) for t in texts), max_length, where, what, skip_too_long, None)
