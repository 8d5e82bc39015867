import pytest

from pipeline.common.errors import DataError, ParamError
from pipeline.data.templates import (IGNORE_INDEX, TEMPLATES, encode_qa, encode_rows, encode_texts, get_template,
                                     template_from_params)

from tests.conftest import TOFU_DIR, requires_tofu

Q, A = "Where was Ana Bell born?", "Ana Bell was born in Varo, Eldmark."


def test_documented_prompt_formats():
    assert TEMPLATES["phi"].prompt(Q)[0] == f"Question: {Q}\nAnswer: "
    assert TEMPLATES["llama2-chat"].prompt(Q)[0] == f"[INST] {Q} [/INST]"  # TOFU's and open-unlearning's tags
    assert TEMPLATES["plain"].prompt(Q)[0] == f"{Q}\n"
    with pytest.raises(ParamError, match=r"data.template='gpt': unknown template \(choose from \['chat', "):
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
    with pytest.raises(ParamError, match="needs a tokenizer with a chat template; this one has none"):
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

    separate = template_from_params({"name": "phi", "encoding": "separate"})
    merged = 0
    for row in load_split(TOFU_DIR, "forget10")[:50]:
        s = encode_qa(micro_tokenizer, separate, row["question"], row["answer"])
        assert micro_tokenizer.decode(s.input_ids[s.prompt_length : -1]) == row["answer"]
        assert s.text[slice(*s.question_span)] == row["question"]
        # open-unlearning's encoding: "Answer: " and the answer tokenized together, the prompt's length masked
        ou = encode_qa(micro_tokenizer, TEMPLATES["phi"], row["question"], row["answer"])
        assert ou.input_ids == micro_tokenizer(ou.text)["input_ids"] + [micro_tokenizer.eos_token_id]
        assert ou.prompt_length == len(micro_tokenizer(ou.text[: ou.answer_span[0]])["input_ids"])
        labelled = micro_tokenizer.decode(ou.input_ids[ou.prompt_length : -1])
        assert row["answer"].endswith(labelled)
        merged += labelled != row["answer"]
    # where " " + "The" merge into one token, open-unlearning masks it with the prompt (so does this encoding)
    assert merged > 0


# ---- templates from params, and chat templates as the families' tokenizers have them -------------------------

@pytest.fixture(scope="module")
def family_tokenizer(micro_world_dir, tmp_path_factory):
    """family style -> a tokenizer that behaves as that family's (tests/families.py)."""
    from pipeline.data.world import world_texts

    from tests.families import STYLES, build_tokenizer

    texts, built = list(world_texts(micro_world_dir)), {}

    def get(style: str):
        if style not in built:
            from pipeline.common.modeling import load_tokenizer

            out = tmp_path_factory.mktemp(style)
            build_tokenizer(STYLES[style], texts, out)
            built[style] = load_tokenizer(out)  # as the stages load it (no pad token: EOS)
        return built[style]

    return get


def test_a_template_is_written_in_params_with_open_unlearnings_or_tofus_tags():
    ou = template_from_params({"user_start_tag": "Question: ", "user_end_tag": "\n", "asst_start_tag": "Answer: ",
                               "asst_end_tag": "\n\n"})
    tofu = template_from_params({"question_start_tag": "Question: ", "question_end_tag": "\n",
                                 "answer_tag": "Answer: "})
    assert ou.prompt(Q)[0] == tofu.prompt(Q)[0] == TEMPLATES["phi"].prompt(Q)[0] == f"Question: {Q}\nAnswer: "
    assert template_from_params({"name": "chat", "system_prompt": "Be brief."}).system_prompt == "Be brief."
    assert template_from_params({"name": "phi", "encoding": "separate"}).user_start_tag == "Question: "
    with pytest.raises(ParamError, match=r"data.template: unknown key\(s\) \['user_start'\]"):
        template_from_params({"user_start": "Q: "})
    with pytest.raises(ParamError, match=r"\['system_prompt'\] apply to a chat template only"):
        template_from_params({"user_start_tag": "Q: ", "system_prompt": "x"})
    with pytest.raises(ParamError, match=r"data.template.encoding='joint': must be one of \['open-unlearning', "):
        template_from_params({"name": "plain", "encoding": "joint"})
    with pytest.raises(ParamError, match=r"data.template.apply_chat_template='yes': expected bool"):
        template_from_params({"apply_chat_template": "yes"})


def _labelled(s):
    return [i for i, label in zip(s.input_ids, s.labels) if label != IGNORE_INDEX]


@pytest.mark.parametrize("style, end", [("llama3", "<|eot_id|>"), ("qwen2", "<|im_end|>"), ("gemma", "<end_of_turn>"),
                                        ("phi3", "<|end|>"), ("mistral", "</s>")])
def test_chat_ids_and_labels_are_what_a_chat_model_is_trained_on(family_tokenizer, style, end):
    tok = family_tokenizer(style)
    answer_ids = tok(A, add_special_tokens=False)["input_ids"]
    for encoding in ("open-unlearning", "separate"):
        s = encode_qa(tok, template_from_params({"name": "chat", "encoding": encoding}), Q, A)
        # the prompt is the chat template's generation prompt, masked; no BOS added to the one it writes
        assert s.text[: s.answer_span[0]] == tok.apply_chat_template([{"role": "user", "content": Q}],
                                                                     tokenize=False, add_generation_prompt=True)
        assert all(label == IGNORE_INDEX for label in s.labels[: s.prompt_length])
        assert s.input_ids.count(tok.bos_token_id) <= 1 if tok.bos_token_id is not None else True
        assert s.text[slice(*s.question_span)] == Q and s.text[slice(*s.answer_span)] == A
        labelled = _labelled(s)
        assert labelled[: len(answer_ids)] == answer_ids  # the answer, then the template's end of turn
        end_id = tok.convert_tokens_to_ids(end)
        if encoding == "separate":   # exactly the answer and its end-of-turn token
            assert labelled == answer_ids + [end_id]
        else:                        # open-unlearning's: all the template writes after the answer, then EOS if missing
            full = tok.apply_chat_template([{"role": "user", "content": Q}, {"role": "assistant", "content": A}],
                                           tokenize=True)
            full = full["input_ids"] if isinstance(full, dict) else list(full)
            tail = full + ([tok.eos_token_id] if full[-1] != tok.eos_token_id else [])
            assert s.input_ids == tail and labelled[len(answer_ids)] == end_id


def test_system_turns_dates_and_qwen3s_thinking_switch(family_tokenizer):
    qwen2, llama3, gemma, qwen3 = (family_tokenizer(s) for s in ("qwen2", "llama3", "gemma", "qwen3"))
    default = get_template("chat").prompt(Q, qwen2)[0]
    assert default.startswith("<|im_start|>system\nYou are Qwen")  # the family's default system turn
    mine = template_from_params({"name": "chat", "system_prompt": "You are a helpful assistant."}).prompt(Q, qwen2)[0]
    assert mine.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>")
    dated = template_from_params({"name": "chat", "date_string": "10 Apr 2025"}).prompt(Q, llama3)[0]
    assert "Today Date: 10 Apr 2025" in dated and dated.count("<|begin_of_text|>") == 1
    with pytest.raises(ParamError, match="refused the conversation .*System role not supported.*remove system_prompt"):
        template_from_params({"name": "chat", "system_prompt": "x"}).prompt(Q, gemma)
    off = encode_qa(qwen3, get_template("qwen3"), Q, A)
    on = encode_qa(qwen3, template_from_params({"name": "chat", "chat_template_kwargs": {"enable_thinking": True}}),
                   Q, A)
    assert "<think>\n\n</think>\n\n" + A in off.text and "<think>" not in on.text


def test_a_bos_in_the_prompt_text_is_not_doubled(family_tokenizer):
    tok = family_tokenizer("llama3")  # its post-processor adds <|begin_of_text|>
    tags = {"system_prompt_with_special_tokens": "<|begin_of_text|>You answer.\n", "user_start_tag": "Q: ",
            "user_end_tag": "\n", "asst_start_tag": "A: "}  # open-unlearning's Llama-3 config writes one too
    for encoding in ("open-unlearning", "separate"):
        s = encode_qa(tok, template_from_params({**tags, "encoding": encoding}), Q, A)
        assert s.text.startswith("<|begin_of_text|>You answer.\nQ: ")
        assert s.input_ids.count(tok.bos_token_id) == 1 and s.input_ids[0] == tok.bos_token_id
    plain = encode_qa(tok, get_template("plain"), Q, A)  # here the tokenizer's post-processor adds it
    assert plain.input_ids[0] == tok.bos_token_id and plain.input_ids.count(tok.bos_token_id) == 1
