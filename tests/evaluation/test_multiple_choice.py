import json
import math
from collections import Counter
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from pipeline.common.errors import DataError, ParamError
from pipeline.data.mc_items import MCItem
from pipeline.data.mmlu import load_mmlu
from pipeline.data.wmdp import load_wmdp, write_wmdp_json
from pipeline.data.world_mc import world_mc_sets
from pipeline.evaluation.mc_scoring import (cloze_logprobs, continuation_logprobs, encode_cloze, encode_continuations,
                                            evaluate_mc, format_prompt, letter_logprobs, score_items)
from pipeline.data.templates import encode_qa, get_template
from pipeline.data.tofu import load_split, read_json_records

ITEM = MCItem("What is 2 + 2? ", ["3", "4", "5", "22"], 1, "elementary mathematics")


def test_prompt_is_the_harness_zero_shot_format():
    assert format_prompt(ITEM) == (
        "The following are multiple choice questions (with answers) about elementary mathematics.\n\n"
        "What is 2 + 2?\nA. 3\nB. 4\nC. 5\nD. 22\nAnswer:"
    )


def test_accuracy_from_given_logprobs():
    items = [ITEM, MCItem("q2", list("abcd"), 3, "s2"), MCItem("q3", list("abcd"), 0, "s2")]
    logprobs = [[-2.0, -0.1, -3.0, -4.0],   # predicts B: correct
                [-0.5, -1.0, -1.5, -0.6],   # predicts A, answer D: wrong
                [-0.2, -0.3, -9.0, -9.0]]   # predicts A: correct
    result = score_items(items, logprobs)
    assert result["n"] == 3
    assert result["accuracy"] == pytest.approx(2 / 3)
    assert result["by_subject"] == {"elementary mathematics": {"n": 1, "accuracy": 1.0},
                                    "s2": {"n": 2, "accuracy": 0.5}}
    assert [r["predicted"] for r in result["records"]] == [1, 0, 0]
    assert [r["correct"] for r in result["records"]] == [True, False, True]
    assert result["records"][1]["logprobs"] == [-0.5, -1.0, -1.5, -0.6]
    with pytest.raises(ParamError, match="shape"):
        score_items(items, logprobs[:2])


class _Ones(torch.nn.Module):
    """A decoder whose last hidden state is 1 everywhere (one unit); it records the rows it is given."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList()
        self.inputs = []

    def forward(self, input_ids, attention_mask=None, **_):
        self.inputs += [[t for t, m in zip(ids, mask) if m] for ids, mask in zip(input_ids.tolist(),
                                                                                attention_mask.tolist())]
        return SimpleNamespace(last_hidden_state=torch.ones(*input_ids.shape, 1))


class FixedLogits(torch.nn.Module):
    """A toy causal LM, built as the scorer reads one (a decoder under an LM head): the same next-token logits
    `bias` at every position. `head_rows` counts the positions its head projects."""

    def __init__(self, bias, max_length=2048):
        super().__init__()
        self.config = SimpleNamespace(max_position_embeddings=max_length)
        self.model = _Ones()
        self.lm_head = torch.nn.Linear(1, len(bias), bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(torch.as_tensor(bias, dtype=torch.float32)[:, None])
        self.head_rows = []
        self.lm_head.register_forward_hook(lambda _m, args, _out: self.head_rows.append(args[0].shape[0]))

    def get_decoder(self):
        return self.model

    def get_output_embeddings(self):
        return self.lm_head


def test_continuation_logprobs_by_hand():
    bias = [0.0, 0.0, 1.0, 2.0, 3.0, 4.0]
    lse = math.log(sum(math.exp(b) for b in bias))
    model = FixedLogits(bias)
    contexts = [[0, 1], [0, 1, 1, 1]]
    single = [[[2], [3], [4], [5]], [[5], [4], [3], [2]]]
    expected = torch.tensor([[b - lse for b in (1, 2, 3, 4)], [b - lse for b in (4, 3, 2, 1)]])
    got = continuation_logprobs(model, contexts, single, batch_size=2)
    assert torch.allclose(got, expected, atol=1e-6)
    multi = [[[2, 3], [5], [4], [3]], [[5, 5, 5], [4], [3], [2]]]  # a continuation's log-probs are summed
    got = continuation_logprobs(model, contexts, multi, batch_size=3, padding_side="left")
    assert got[0, 0].item() == pytest.approx(1 + 2 - 2 * lse, abs=1e-5)
    assert got[1, 0].item() == pytest.approx(3 * (4 - lse), abs=1e-5)
    assert got[1, 1].item() == pytest.approx(3 - lse, abs=1e-5)


def _letter_bias(tokenizer, favoured: dict[str, float]) -> list[float]:
    bias = [0.0] * len(tokenizer)
    for token, value in favoured.items():
        bias[tokenizer.convert_tokens_to_ids(token)] = value
    return bias


def test_letter_scoring_picks_the_favoured_letter(micro_tokenizer):
    items = [ITEM, MCItem("Which one?", ["w", "x", "y", "z"], 2, "toys")]
    # " C" is one token ("ĠC") for the micro tokenizer: the model that favours it answers C.
    _, conts = encode_continuations(micro_tokenizer, [format_prompt(it) for it in items])
    assert micro_tokenizer.convert_ids_to_tokens(conts[0][2]) == ["ĠC"]
    result = evaluate_mc(FixedLogits(_letter_bias(micro_tokenizer, {"ĠC": 30.0})), micro_tokenizer, items)
    assert [r["predicted"] for r in result["records"]] == [2, 2]
    assert result["accuracy"] == 0.5 and result["by_subject"]["toys"]["accuracy"] == 1.0
    # " A" is two tokens ("Ġ", "A"): favour both equally and its summed log-prob is 2·log(1/2).
    assert micro_tokenizer.convert_ids_to_tokens(conts[0][0]) == ["Ġ", "A"]
    model = FixedLogits(_letter_bias(micro_tokenizer, {"Ġ": 30.0, "A": 30.0}))
    logprobs = letter_logprobs(model, micro_tokenizer, items, batch_size=3)
    assert logprobs.argmax(-1).tolist() == [0, 0]
    assert logprobs[0, 0].item() == pytest.approx(2 * math.log(0.5), abs=1e-4)


def test_cloze_scores_per_character_by_hand(micro_tokenizer):
    # Three tokens get logit 30, the rest 0: each of the three has log-prob L = 30 - lse, any other -lse.
    favoured = ("Ġ", "q", "ĠTressivane")
    lse = math.log(3 * math.exp(30) + (len(micro_tokenizer) - 3))
    big, small = 30 - lse, -lse
    model = FixedLogits(_letter_bias(micro_tokenizer, {t: 30.0 for t in favoured}))
    item = MCItem("Who is it?", ["q", "Tressivane q", "q q", "x"], 1, "toys", stem="It is ")
    _, conts = encode_cloze(micro_tokenizer, [item], get_template("plain"))
    # The stem's trailing space moves into each continuation.
    assert [micro_tokenizer.convert_ids_to_tokens(c) for c in conts[0]] == [
        ["Ġ", "q"], ["ĠTressivane", "Ġ", "q"], ["Ġ", "q", "Ġ", "q"], ["Ġ", "x"]]
    got = cloze_logprobs(model, micro_tokenizer, [item], get_template("plain"))
    expected = [2 * big / 1, 3 * big / 12, 4 * big / 3, (big + small) / 1]  # summed log-probs / len(choice)
    assert got[0].tolist() == pytest.approx(expected, abs=1e-4)
    # Summed, "q" (two likely tokens) would win; per character the long choice does.
    assert max(range(4), key=lambda j: expected[j] * len(item.choices[j])) == 0
    result = evaluate_mc(model, micro_tokenizer, [item], scoring="cloze", template=get_template("plain"))
    assert result["records"][0]["predicted"] == 1 and result["accuracy"] == 1.0
    with pytest.raises(ParamError, match="cloze scoring needs the prompt template"):
        evaluate_mc(model, micro_tokenizer, [item], scoring="cloze")
    with pytest.raises(ParamError, match=r"scoring='bogus': unknown \(choose from \['cloze', 'letter'\]\)"):
        evaluate_mc(model, micro_tokenizer, [item], scoring="bogus")


@pytest.fixture(scope="module")
def micro_model(micro_model_dir):
    from pipeline.common.modeling import load_model, load_tokenizer

    return load_model(micro_model_dir), load_tokenizer(micro_model_dir)


def test_batched_equals_unbatched_on_the_fixture_model(micro_model, micro_world_dir):
    model, tokenizer = micro_model
    items = world_mc_sets(micro_world_dir)["world_facts"][:7]
    assert len({len(tokenizer(format_prompt(it))["input_ids"]) for it in items}) > 1  # batches really are padded
    one = letter_logprobs(model, tokenizer, items, batch_size=1)
    for side in ("right", "left"):
        batched = letter_logprobs(model, tokenizer, items, batch_size=8, padding_side=side)
        assert torch.allclose(batched, one, atol=1e-5, rtol=0)
    # Logits at the read positions only equal the model's own full forward, one sequence at a time: one-token
    # and multi-token continuations (these share no row), either padding.
    contexts = [tokenizer(format_prompt(it))["input_ids"] for it in items]
    conts = [[[5], [17, 3], [42, 42, 7], [99]]] * len(items)
    reference = torch.tensor([[_full_logits_logprob(model, ctx, c) for c in per] for ctx, per in zip(contexts, conts)])
    for side, size in (("left", 4), ("right", 5)):
        got = continuation_logprobs(model, contexts, conts, tokenizer.pad_token_id, batch_size=size,
                                    padding_side=side)
        assert torch.allclose(got, reference, atol=1e-5, rtol=0)
    with pytest.raises(ParamError, match="padding_side"):
        continuation_logprobs(model, contexts, conts, padding_side="middle")


def _full_logits_logprob(model, context, continuation) -> float:
    """The summed log-prob of `continuation` from the model's full [length, vocab] logits (the old way)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([context + continuation])).logits[0].float()
    logp = torch.log_softmax(logits[len(context) - 1: -1], -1)
    return logp.gather(-1, torch.tensor(continuation)[:, None]).sum().item()


# ------------------------------------------------------------------------------------------------- loaders

WMDP_ROWS = [
    {"question": "Which agent?", "choices": ["a", "b", "c", "d"], "answer": 2},
    {"question": "Which port?", "choices": ["22", "80", "443", "8080"], "answer": 0},
]


def test_wmdp_json_array_and_json_lines(tmp_path):
    array = tmp_path / "wmdp-cyber.json"
    array.write_text(json.dumps(WMDP_ROWS))
    lines = tmp_path / "questions.jsonl"
    lines.write_text("".join(json.dumps(r) + "\n" for r in WMDP_ROWS))
    items = load_wmdp(array)
    assert items == [MCItem("Which agent?", ["a", "b", "c", "d"], 2, "cybersecurity", index=0),
                     MCItem("Which port?", ["22", "80", "443", "8080"], 0, "cybersecurity", index=1)]
    assert load_wmdp(lines, config="wmdp-cyber") == items
    assert load_wmdp(lines, subject="biology")[1].subject == "biology"


def test_mmlu_csv_directory_and_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = tmp_path / "data"
    data.mkdir()
    (data / "abstract_algebra_test.csv").write_text(
        '"Find the order of\nthe group.",2,4,"6, or 8",12,C\nIs Z a field?,yes,no,maybe,never,B\n')
    (data / "anatomy_test.csv").write_text("Which bone?,femur,tibia,ulna,rib,A\n")
    (data / "anatomy_dev.csv").write_text("Not a test question,a,b,c,d,A\n")
    items = load_mmlu(data)
    assert items == [
        MCItem("Find the order of\nthe group.", ["2", "4", "6, or 8", "12"], 2, "abstract algebra", index=0),
        MCItem("Is Z a field?", ["yes", "no", "maybe", "never"], 1, "abstract algebra", index=1),
        MCItem("Which bone?", ["femur", "tibia", "ulna", "rib"], 0, "anatomy", index=2),  # indices run on
    ]
    assert load_mmlu(data / "anatomy_test.csv") == [replace(items[2], index=0)]
    assert load_mmlu(data, subjects=["anatomy"]) == items[2:]

    table = pa.table({"question": ["Which bone?", "Is Z a field?"], "subject": ["anatomy", "abstract_algebra"],
                      "choices": [["femur", "tibia", "ulna", "rib"], ["yes", "no", "maybe", "never"]],
                      "answer": [0, 1]})
    pq.write_table(table, tmp_path / "test.parquet")
    assert load_mmlu(tmp_path / "test.parquet") == [replace(items[2], index=0), replace(items[1], index=1)]


@pytest.mark.parametrize(
    "row, message",
    [
        ({"question": "q", "answer": 1}, "row 2: missing field 'choices'"),
        ({"question": "q", "choices": ["a", "b", "c", "d"], "answer": 4}, "row 2: field 'answer' is 4, out of range"),
        ({"question": "q", "choices": ["a", "b", "c"], "answer": 0}, "row 2: field 'choices' must have 4 entries"),
        ({"question": "q", "choices": ["a", "b", "c", "d"], "answer": "B"}, "row 2: field 'answer' must be an integer"),
        ({"choices": ["a", "b", "c", "d"], "answer": 0}, "row 2: missing field 'question'"),
    ],
)
def test_wmdp_bad_rows_name_file_row_and_field(tmp_path, row, message):
    path = tmp_path / "wmdp-bio.jsonl"
    path.write_text(json.dumps(WMDP_ROWS[0]) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(DataError, match=rf"wmdp-bio\.jsonl: {message}"):
        load_wmdp(path)


@pytest.mark.parametrize(
    "line, message",
    [
        ("q,a,b,c,d,E", "row 2: field 'answer' must be a letter A-D or an index 0-3, got 'E'"),
        ("q,a,b,c,A", r"row 2: expected 6 columns \(question, A-D, answer\) or a header row .*, got 5"),
    ],
)
def test_mmlu_bad_rows_name_file_row_and_field(tmp_path, line, message):
    (tmp_path / "virology_test.csv").write_text(f"q,a,b,c,d,A\n{line}\n")
    with pytest.raises(DataError, match=rf"virology_test\.csv: {message}"):
        load_mmlu(tmp_path)


def test_mmlu_parquet_without_subject(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"question": ["q"], "choices": [["a", "b", "c", "d"]], "answer": [0]}),
                   tmp_path / "t.parquet")
    with pytest.raises(DataError, match=r"t\.parquet: row 1: missing field 'subject'"):
        load_mmlu(tmp_path / "t.parquet")


def test_missing_sources_are_data_errors(tmp_path):
    with pytest.raises(DataError, match="no <subject>_test.csv"):
        load_mmlu(tmp_path)
    with pytest.raises(DataError, match="no such file"):
        load_wmdp(tmp_path / "absent.json")


# ------------------------------------------------------------------------------------------- the world's sets


def test_world_mc_sets(micro_world_dir):
    sets = world_mc_sets(micro_world_dir, split="forget10", seed=0)
    forget_rows = load_split(micro_world_dir, "forget10_perturbed")
    facts = load_split(micro_world_dir, "world_facts")
    assert {k: len(v) for k, v in sets.items()} == {"forget": len(forget_rows), "retain": len(forget_rows),
                                                    "world_facts": len(facts)}

    notes = {a["question"]: a for a in read_json_records(micro_world_dir / "annotations.json") if a["author"]}
    authors = {a["name"]: a["facts"] for a in read_json_records(micro_world_dir / "authors.json")}
    rows = {r["question"]: r for split in ("forget10_perturbed", "retain_perturbed")
            for r in load_split(micro_world_dir, split)}
    who = {}
    for name in ("forget", "retain"):
        who[name] = set()
        for item in sets[name]:
            note = notes[item.question]
            who[name].add(note["author"])
            assert item.choices[item.answer] == authors[note["author"]][note["attribute"]]  # the true fact
            wrong = [c for i, c in enumerate(item.choices) if i != item.answer]
            assert len(set(item.choices)) == 4
            assert all(any(w in p for p in rows[item.question]["perturbed_answer"]) for w in wrong)  # perturbed
            assert item.subject == f"the fictitious author {note['author']}"
            # The stem is the answer's text before the fact: stem + true value begins the answer, and never holds it.
            answer = rows[item.question]["answer"]
            assert item.stem == answer[:note["answer_fact_spans"][0][0]]
            assert answer.startswith(item.stem + item.choices[item.answer])
            assert item.choices[item.answer] not in item.stem
    assert any(it.stem for it in sets["forget"]) and all(it.stem == "" for it in sets["world_facts"])
    forget_authors = {a["name"] for a in read_json_records(micro_world_dir / "authors.json")
                      if "forget10" in a["forget_splits"]}
    assert who["forget"] == forget_authors
    assert who["retain"] and not who["retain"] & who["forget"]

    gold = {r["question"]: r for r in facts}
    for item in sets["world_facts"]:
        row = gold[item.question]
        assert item.choices[item.answer] == row["answer"] and item.subject == "world facts"
        assert sorted(item.choices) == sorted(row[f"option{k}"] for k in range(1, 5))

    for items in sets.values():  # the answer's position is balanced, not always A
        counts = Counter(it.answer for it in items)
        assert max(counts.values()) - min(counts.get(p, 0) for p in range(4)) <= 1
    assert world_mc_sets(micro_world_dir, seed=0) == sets
    assert world_mc_sets(micro_world_dir, seed=1)["world_facts"] != sets["world_facts"]
    with pytest.raises(ParamError, match="forget split"):
        world_mc_sets(micro_world_dir, split="retain90")


def test_world_sets_round_trip_through_the_wmdp_loader(micro_world_dir, tmp_path):
    sets = world_mc_sets(micro_world_dir)
    for name, items in sets.items():
        write_wmdp_json(items, tmp_path / f"{name}.json")
        # The same items; each index is then its row in the written file, not in the world's split.
        assert load_wmdp(tmp_path / f"{name}.json") == [replace(it, index=k) for k, it in enumerate(items)]
    rows = read_json_records(tmp_path / "forget.json")
    assert {k for r in rows for k in r} == {"question", "choices", "answer", "subject", "stem"}
    assert all(set(r) == {"question", "choices", "answer", "subject"} for r in read_json_records(
        tmp_path / "world_facts.json"))  # no stem: plain WMDP records


def test_cloze_scores_exactly_the_training_answer(micro_tokenizer, micro_world_dir):
    # The context and the true choice's continuation are the training sample's tokens up to the fact's end.
    template = get_template("plain")
    sets = world_mc_sets(micro_world_dir)
    answers = {r["question"]: r["answer"] for split in ("forget10_perturbed", "retain_perturbed", "world_facts")
               for r in load_split(micro_world_dir, split)}
    items = [it for items in sets.values() for it in items]
    contexts, conts = encode_cloze(micro_tokenizer, items, template)
    spaced = 0
    for item, context, per_item in zip(items, contexts, conts):
        answer = answers[item.question]
        sample = encode_qa(micro_tokenizer, template, item.question, answer)
        true = per_item[item.answer]
        assert context + true == sample.input_ids[:len(context) + len(true)]
        # ... and the scored text is the choice with the stem's trailing whitespace: nothing more, nothing less.
        end = len(item.stem) + len(item.choices[item.answer])
        assert micro_tokenizer.decode(true) == answer[len(item.stem.rstrip()):end]
        spaced += item.stem.endswith(" ")
    assert spaced > 0  # stems with a trailing space were tested
