"""Prompt formats, and tokenization of a question-answer pair with character offsets.

A template is written the way open-unlearning's model configs (`template_args`) and TOFU's configs describe a
model, so a user adds a model in params, without code:

* tags around the question, for a model without a chat template (`data.template: phi` is
  `{user_start_tag: "Question: ", user_end_tag: "\\n", asst_start_tag: "Answer: "}`; TOFU's `question_start_tag`,
  `question_end_tag` and `answer_tag` are the same three), with `system_prompt_with_special_tokens` before them;
* or the tokenizer's own chat template (`apply_chat_template: true`, the named template `chat`), with an optional
  `system_prompt`, `date_string` (Llama 3) and `chat_template_kwargs` (Qwen 3's `enable_thinking`; `qwen3` is
  `chat` with thinking off).

Two encodings of a pair (`encoding`), both labelling only what follows the prompt:

* `open-unlearning` (the default): as open-unlearning's `preprocess_chat_instance` does, the prompt and the answer
  (and, for a chat template, what the template writes after an assistant turn, e.g. `<|im_end|>\\n`) are tokenized
  together, the first len(prompt ids) positions are masked, and EOS is appended unless the ids already end with it.
  Identical ids to open-unlearning, so both tools score the same tokens. Where a tokenizer merges the prompt's last
  character with the answer's first (`"Answer: " + "The"` -> `" The"` in a GPT-2 or SentencePiece vocabulary), that
  merged token is masked with the prompt, as open-unlearning masks it.
* `separate`: the prompt, the answer and the end are tokenized on their own and concatenated, so every answer
  token is labelled and the prompt's ids are the same in training and generation whatever the tokenizer; the end is
  EOS, or for a chat template its end-of-turn token (the template's text after an assistant turn, up to its first
  special token: `<|eot_id|>`, `<end_of_turn>`, `<|end|>`).

BOS: a tag template gets the tokenizer's own special tokens (its post-processor's BOS, if any), unless the prompt
text already starts with the BOS token (a `system_prompt_with_special_tokens` that writes `<|begin_of_text|>`):
never two BOS. A chat template writes its own special tokens, so none are added. Later stages mask tokens by
character spans, so every encoded sample carries the offset mapping of its tokens into `text`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from pipeline.common.errors import DataError, ParamError

Span = tuple[int, int]
ENCODINGS = ("open-unlearning", "separate")

# open-unlearning's `template_args` keys, and TOFU's names for the three tags.
TAG_KEYS = ("user_start_tag", "user_end_tag", "asst_start_tag")
TOFU_TAGS = {"question_start_tag": "user_start_tag", "question_end_tag": "user_end_tag", "answer_tag": "asst_start_tag"}
TEMPLATE_KEYS = ("name", "apply_chat_template", *TAG_KEYS, "asst_end_tag", "system_prompt",
                 "system_prompt_with_special_tokens", "date_string", "chat_template_kwargs", "encoding", *TOFU_TAGS)


@dataclass(frozen=True)
class PromptTemplate:
    """How a question becomes a prompt, and how the answer after it is tokenized (see the module's docstring)."""

    name: str
    user_start_tag: str = ""
    user_end_tag: str = ""
    asst_start_tag: str = ""
    system_prompt_with_special_tokens: str = ""  # tags: text before the question's tags
    apply_chat_template: bool = False
    system_prompt: str = ""                      # chat: a system turn, if not empty
    date_string: str = ""                        # chat: Llama 3's template date (open-unlearning passes one)
    chat_template_kwargs: tuple = ()             # chat: more variables of the template, as (key, value) pairs
    encoding: str = "open-unlearning"

    def _messages(self, question: str, answer: str | None = None) -> list[dict]:
        turns = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        turns.append({"role": "user", "content": question})
        if answer is not None:
            turns.append({"role": "assistant", "content": answer})
        return turns

    def _render(self, tokenizer, messages: list[dict], add_generation_prompt: bool) -> str:
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ParamError(f"template '{self.name}' needs a tokenizer with a chat template; this one has none "
                             "(use a tag template such as phi, or set user_start_tag/user_end_tag/asst_start_tag)")
        kwargs = dict(self.chat_template_kwargs)
        if self.date_string:
            kwargs["date_string"] = self.date_string
        try:
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                 **kwargs)
        except Exception as e:  # jinja2's TemplateError, or the template's raise_exception (Gemma: no system turn)
            raise ParamError(f"template '{self.name}': the tokenizer's chat template refused the conversation "
                             f"({str(e).strip() or type(e).__name__})"
                             + ("; remove system_prompt" if self.system_prompt else "")) from None

    def prompt(self, question: str, tokenizer=None) -> tuple[str, Span]:
        """The prompt text and the question's character span in it."""
        if not self.apply_chat_template:
            head = self.system_prompt_with_special_tokens + self.user_start_tag
            return f"{head}{question}{self.user_end_tag}{self.asst_start_tag}", (len(head), len(head) + len(question))
        text = self._render(tokenizer, self._messages(question), add_generation_prompt=True)
        start = text.rfind(question)
        if start < 0:
            raise DataError(f"template '{self.name}': the chat template did not keep the question verbatim")
        return text, (start, start + len(question))

    def answer_end(self, tokenizer, question: str, answer: str) -> str:
        """What the template writes after an assistant answer (chat templates; "" for tags, which end with EOS)."""
        if not self.apply_chat_template:
            return ""
        full = self._render(tokenizer, self._messages(question, answer), add_generation_prompt=False)
        at = full.rfind(answer)
        if at < 0:
            raise DataError(f"template '{self.name}': the chat template did not keep the answer verbatim")
        return full[at + len(answer):]

    def adds_special_tokens(self, tokenizer, prompt: str) -> bool:
        """Whether the prompt is tokenized with the tokenizer's special tokens: tags yes, unless the text already
        starts with BOS; a chat template never (it writes its own)."""
        bos = getattr(tokenizer, "bos_token", None)
        return not self.apply_chat_template and not (bos and prompt.startswith(bos))


# Named templates: open-unlearning's / TOFU's tags for the models they configure, and the chat templates.
TEMPLATES: dict[str, PromptTemplate] = {
    t.name: t
    for t in (
        PromptTemplate("phi", "Question: ", "\n", "Answer: "),          # Phi-1.5, Llama-2 base (TOFU, open-unlearning)
        PromptTemplate("llama2-chat", "[INST] ", " [/INST]", ""),       # TOFU's and open-unlearning's Llama-2-chat
        PromptTemplate("chat", apply_chat_template=True),                # the tokenizer's own chat template
        PromptTemplate("qwen3", apply_chat_template=True, chat_template_kwargs=(("enable_thinking", False),)),
        PromptTemplate("plain", user_end_tag="\n"),                      # the embedded model's
        PromptTemplate("passage"),   # no tags: a passage's first part prompts its rest (own-data's passage probes)
    )
}


def template_from_params(spec, where: str = "data.template") -> PromptTemplate:
    """A template from params: a name of `TEMPLATES`, or a mapping of open-unlearning's `template_args` keys (or
    TOFU's tag names), optionally over a named template (`name: chat`) and with an `encoding`."""
    if isinstance(spec, str):
        if spec not in TEMPLATES:
            raise ParamError(f"{where}='{spec}': unknown template (choose from {sorted(TEMPLATES)}, or write its tags: "
                             "{user_start_tag: ..., user_end_tag: ..., asst_start_tag: ...})")
        return TEMPLATES[spec]
    if not isinstance(spec, dict):
        raise ParamError(f"{where}: expected a template name or a mapping of its tags, got {type(spec).__name__}")
    unknown = sorted(set(spec) - set(TEMPLATE_KEYS))
    if unknown:
        raise ParamError(f"{where}: unknown key(s) {unknown} (known: {sorted(TEMPLATE_KEYS)})")
    values = {TOFU_TAGS.get(k, k): v for k, v in spec.items() if k not in ("name", "asst_end_tag")}
    # asst_end_tag is accepted for open-unlearning's configs; its QA tokenization does not use it either
    for key, value in values.items():
        kind = dict if key == "chat_template_kwargs" else bool if key == "apply_chat_template" else str
        if not isinstance(value, kind) or kind is not bool and isinstance(value, bool):
            raise ParamError(f"{where}.{key}={value!r}: expected {kind.__name__}")
    if values.get("encoding", ENCODINGS[0]) not in ENCODINGS:
        raise ParamError(f"{where}.encoding={values['encoding']!r}: must be one of {list(ENCODINGS)}")
    if "chat_template_kwargs" in values:
        values["chat_template_kwargs"] = tuple(sorted(values["chat_template_kwargs"].items()))
    base = template_from_params(spec["name"], f"{where}.name") if "name" in spec else PromptTemplate("custom")
    merged = {**{k: getattr(base, k) for k in base.__dataclass_fields__}, **values}
    merged["name"] = spec.get("name", "custom")
    template = PromptTemplate(**merged)
    chat_only = [k for k in ("system_prompt", "date_string", "chat_template_kwargs") if k in values]
    if chat_only and not template.apply_chat_template:
        raise ParamError(f"{where}: {chat_only} apply to a chat template only (set apply_chat_template: true)")
    return template


def get_template(spec) -> PromptTemplate:
    """`template_from_params`, for a value of `data.template`."""
    return template_from_params(spec)


@dataclass
class EncodedSample:
    text: str                  # prompt + answer (+ the chat template's end of turn)
    input_ids: list[int]       # prompt ids, answer ids, end ids
    labels: list[int]          # -100 on the prompt; the answer ids and what ends it
    offsets: list[Span]        # each token's character span in `text`; an appended EOS gets (len, len)
    question_span: Span
    answer_span: Span
    prompt_length: int         # number of prompt tokens (the masked ones)

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
    ids, offsets = _encode(tokenizer, prompt, template.adds_special_tokens(tokenizer, prompt))
    return prompt, q_span, ids, offsets


def _eos_id(tokenizer) -> int:
    if tokenizer.eos_token_id is None:
        raise ParamError(f"tokenizer {tokenizer.name_or_path!r} has no EOS token")
    return tokenizer.eos_token_id


def _end_of_turn(tokenizer, end_text: str) -> tuple[list[int], list[Span]]:
    """A chat template's end of an assistant turn, up to and including its first special token (the end-of-turn
    token the model emits); EOS if it writes none."""
    ids, offsets = _encode(tokenizer, end_text, add_special_tokens=False)
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    first = next((k for k, i in enumerate(ids) if i in special), None)
    if first is None:
        return [_eos_id(tokenizer)], [(len(end_text), len(end_text))]
    return ids[: first + 1], offsets[: first + 1]


def encode_qa(tokenizer, template: PromptTemplate, question: str, answer: str) -> EncodedSample:
    prompt, q_span, p_ids, p_off = encode_prompt(tokenizer, template, question)
    end_text = template.answer_end(tokenizer, question, answer)
    eos = _eos_id(tokenizer)
    if template.encoding == "open-unlearning":
        text = prompt + answer + end_text
        input_ids, offsets = _encode(tokenizer, text, template.adds_special_tokens(tokenizer, prompt))
        if input_ids[-1] != eos:
            input_ids, offsets = input_ids + [eos], offsets + [(len(text), len(text))]
    else:
        a_ids, a_off = _encode(tokenizer, answer, add_special_tokens=False)
        e_ids, e_off = _end_of_turn(tokenizer, end_text) if end_text else ([eos], [(0, 0)])
        text = prompt + answer + end_text[: e_off[-1][1]]
        a0, e0 = len(prompt), len(prompt) + len(answer)
        input_ids = p_ids + a_ids + e_ids
        offsets = p_off + [(s + a0, e + a0) for s, e in a_off] + [(s + e0, e + e0) for s, e in e_off]
    labels = [IGNORE_INDEX] * len(p_ids) + input_ids[len(p_ids):]
    shift = len(prompt)
    return EncodedSample(text, input_ids, labels, offsets, q_span, (shift, shift + len(answer)), len(p_ids))


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
