import pytest

from pipeline.common.errors import DataError, ParamError
from pipeline.data.templates import IGNORE_INDEX, TEMPLATES, encode_qa, encode_rows, encode_texts, get_template

from .conftest import TOFU_DIR, requires_tofu

Q, A = "Where was Ana Bell born?", "Ana Bell was born in Varo, Eldmark."


def test_documented_prompt_formats():
    assert TEMPLATES["phi"].prompt(Q)[0] == f"Question: {Q}\nAnswer: "
    assert TEMPLATES["llama2-chat"].prompt(Q)[0] == f"[INST] {Q} [/INST] "
    assert TEMPLATES["plain"].prompt(Q)[0] == f"{Q}\n"
    with pytest.raises(ParamError, match="data.template='gpt'"):
        get_template("gpt")


@pytest.mark.parametrize("name", ["plain", "phi", "llama2-chat"])
def test_encoding_labels_answer_and_eos_only(micro_tokenizer, name):
    tok = micro_tokenizer
    s = encode_qa(tok, TEMPLATES[name], Q, A)
    assert s.text[slice(*s.question_span)] == Q
    assert s.text[slice(*s.answer_span)] == A and s.text.endswith(A)
    assert s.input_ids[0] == tok.bos_token_id and s.input_ids[-1] == tok.eos_token_id
    assert all(label == IGNORE_INDEX for label in s.labels[: s.prompt_length])
    assert s.labels[s.prompt_length :] == s.input_ids[s.prompt_length :]
    assert tok.decode(s.input_ids[s.prompt_length : -1]) == A
    # Offsets map every answer token back into the answer's characters.
    answer_offsets = s.offsets[s.prompt_length : -1]
    assert all(s.answer_span[0] <= a <= b <= s.answer_span[1] for a, b in answer_offsets)
    assert "".join(s.text[a:b] for a, b in answer_offsets).replace(" ", "") == A.replace(" ", "")


def test_prompt_ids_are_the_same_in_training_and_generation(micro_tokenizer):
    from pipeline.data.templates import encode_prompt

    s = encode_qa(micro_tokenizer, TEMPLATES["plain"], Q, A)
    assert encode_prompt(micro_tokenizer, TEMPLATES["plain"], Q)[2] == s.input_ids[: s.prompt_length]


def test_chat_template_for_qwen3(micro_tokenizer):
    tok = micro_tokenizer
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n"
        "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
    )
    try:
        s = encode_qa(tok, get_template("qwen3"), Q, A)
    finally:
        tok.chat_template = None
    assert s.text.startswith("<|im_start|>user\n" + Q)
    assert "<think>\n\n</think>\n\n" + A in s.text
    assert s.text[slice(*s.question_span)] == Q
    with pytest.raises(ParamError, match="needs a tokenizer with a chat template"):
        get_template("qwen3").prompt(Q, tok)


def test_slow_tokenizer_is_refused():
    class Slow:
        is_fast = False

    with pytest.raises(ParamError, match="no offset mapping"):
        encode_qa(Slow(), TEMPLATES["plain"], Q, A)


def test_too_long_rows_are_errors_or_skipped_and_counted(micro_tokenizer):
    rows = [{"question": Q, "answer": A}, {"question": Q, "answer": A * 10}]
    with pytest.raises(DataError, match=r"x.json: row 2: \d+ tokens exceed data.max_length=40"):
        encode_rows(micro_tokenizer, TEMPLATES["plain"], rows, 40, "x.json")
    skipped = []
    out = encode_rows(micro_tokenizer, TEMPLATES["plain"], rows, 40, "x.json", skip_too_long=True,
                      on_skip=skipped.append)
    assert len(out) == 1 and skipped == [2]


def test_passages_label_every_token_after_bos_and_too_long_ones_are_named(micro_tokenizer):
    texts = ["A short passage.", "A much longer passage about a writer " * 10]
    short = encode_texts(micro_tokenizer, texts[:1], 64, "corpus.json")[0]
    assert short.labels[0] == IGNORE_INDEX and short.labels[1:] == short.input_ids[1:]
    with pytest.raises(DataError, match=r"corpus.json: retain passage 2: \d+ tokens exceed data.max_length=64"):
        encode_texts(micro_tokenizer, texts, 64, "corpus.json", "retain passage")
    assert [s.text for s in encode_texts(micro_tokenizer, texts, 64, "corpus.json", skip_too_long=True)] == texts[:1]


@requires_tofu
def test_real_tofu_questions_round_trip(micro_tokenizer):
    from pipeline.data.tofu import load_split

    for row in load_split(TOFU_DIR, "forget10")[:50]:
        s = encode_qa(micro_tokenizer, TEMPLATES["phi"], row["question"], row["answer"])
        assert micro_tokenizer.decode(s.input_ids[s.prompt_length : -1]) == row["answer"]
        assert s.text[slice(*s.question_span)] == row["question"]
