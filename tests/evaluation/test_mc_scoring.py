"""Multiple-choice scoring as the harness does it: its max length, its left truncation per (item, choice), logits
only at the positions read, and a progress bar over items."""

from types import SimpleNamespace

import pytest
import torch

from pipeline.common.errors import DataError
from pipeline.data.mc_items import MCItem
from pipeline.evaluation.mc_scoring import (TOKENIZER_INFINITY, cloze_logprobs, continuation_logprobs,
                                            encode_continuations, evaluate_mc, format_prompt, harness_windows,
                                            letter_logprobs, resolve_max_length)
from pipeline.data.templates import get_template

from tests.evaluation.test_multiple_choice import FixedLogits


@pytest.mark.parametrize("config, tokenizer_max, expected", [
    ({"n_positions": 1024, "max_position_embeddings": 4096}, 2048, 1024),   # GPT-2's name first
    ({"max_position_embeddings": 4096}, 2048, 4096),                         # the tokenizer's is not used then
    ({"n_positions": None, "n_ctx": 512}, 2048, 512),                         # a None value counts as unset
    ({"max_position_embeddings": 1200, "text_config": {"max_position_embeddings": 32768}}, None, 32768),
    ({}, 300, 300),                                                           # no config value: the tokenizer's
    ({}, TOKENIZER_INFINITY, 2048),                                           # ... unless unset: the fallback
    ({}, None, 2048),
])
def test_max_length_is_resolved_as_the_harness_does(config, tokenizer_max, expected):
    text = config.pop("text_config", None)
    cfg = SimpleNamespace(**config, **({"text_config": SimpleNamespace(**text)} if text else {}))
    tokenizer = SimpleNamespace(model_max_length=tokenizer_max) if tokenizer_max else None
    assert resolve_max_length(cfg, tokenizer) == expected


def test_windows_are_the_harness_inputs_per_item_and_choice():
    ctx = list(range(1, 11))
    windows, requests = harness_windows([ctx, [1, 2]], [[[20], [21, 22], [23]], [[20], [21, 22], [23]]], 6)
    # (ctx + cont)[-7:][:-1]: one-token choices share the row ctx[-6:]; a two-token one needs its own.
    assert windows[0] == (5, 6, 7, 8, 9, 10) and windows[1] == (6, 7, 8, 9, 10, 21)
    assert [r for i, _, r, _ in requests if i == 0] == [0, 1, 0]
    assert windows[2:] == [(1, 2), (1, 2, 21)]  # short items are not cut
    assert harness_windows([ctx], [[[20]]], None)[0] == [tuple(ctx)]  # no limit
    with pytest.raises(DataError, match=r"item 1: choice 2's continuation has 2 tokens, more than the model's "
                                        r"max_length 1; raise the set's `max_length:`"):
        harness_windows([ctx], [[[20], [21, 22]]], 1)


def test_the_scorer_feeds_the_windows_and_projects_only_the_positions_it_reads():
    bias = [0.0, 0.0, 1.0, 2.0, 3.0, 4.0, 0.5] + [0.0] * 20
    model = FixedLogits(bias, max_length=5)
    contexts = [list(range(7, 19)), [7, 8]]
    conts = [[[2], [3, 4], [5], [6]], [[2], [3, 4], [5], [6]]]
    got = continuation_logprobs(model, contexts, conts, batch_size=8, max_length=5)
    fed = sorted(map(tuple, model.model.inputs))
    assert fed == sorted([(14, 15, 16, 17, 18), (15, 16, 17, 18, 3), (7, 8), (7, 8, 3)])  # 4 rows, not 8
    assert model.head_rows == [2 * 3]  # 3 positions an item (the last of the shared row, two of the other), not 4 x 5
    lse = torch.logsumexp(torch.tensor(bias), 0).item()
    expected = [1 - lse, 2 + 3 - 2 * lse, 4 - lse, 0.5 - lse]  # bias[2], bias[3] + bias[4], bias[5], bias[6]
    assert got[0].tolist() == pytest.approx(expected, abs=1e-5) and got[1].tolist() == pytest.approx(expected, abs=1e-5)


def test_the_lm_head_sees_only_continuation_positions_of_a_real_model(micro_model_dir, micro_tokenizer):
    from pipeline.common.modeling import load_model

    model = load_model(micro_model_dir).eval()
    rows = []
    model.lm_head.register_forward_hook(lambda _m, args, _out: rows.append(tuple(args[0].shape)))
    items = [MCItem(f"Question {k}: which one of these is it, really?", ["w", "x", "y", "z"], k % 4, "toys")
             for k in range(6)]
    contexts, conts = encode_continuations(micro_tokenizer, [format_prompt(it) for it in items])
    letter_logprobs(model, micro_tokenizer, items, batch_size=3)
    # Per batch of rows: one hidden vector per distinct position read ([positions, hidden]), never [batch, length,
    # hidden]; letters that share a row (" B", " C" after the same prefix) read its positions once.
    windows, requests = harness_windows(contexts, conts, 128)
    read = {(r, len(windows[r]) - len(cont) + t) for _, _, r, cont in requests for t in range(len(cont))}
    assert all(len(shape) == 2 for shape in rows)
    assert sum(shape[0] for shape in rows) == len(read) < len(items) * len(contexts[0])
    rows.clear()
    items = [MCItem("Who wrote it?", ["Ana Lopez", "Bo", "Cy Dee", "Ed"], 0, "toys", stem="It was ")] * 2
    cloze_logprobs(model, micro_tokenizer, items, get_template("plain"), batch_size=4)
    assert all(len(shape) == 2 for shape in rows) and sum(s[0] for s in rows) < 8 * 10


def test_long_sets_show_a_bar_over_items(micro_tokenizer, capsys, monkeypatch):
    monkeypatch.setattr("pipeline.common.progress._is_terminal", lambda stream: True)  # a terminal: a bar
    items = [MCItem(f"Question {k}?", ["a", "b", "c", "d"], k % 4, "toys") for k in range(300)]
    model = FixedLogits([0.0] * len(micro_tokenizer))
    result = evaluate_mc(model, micro_tokenizer, items, batch_size=64, desc="multiple choice wmdp_bio")
    assert result["n"] == 300 and result["max_length"] == 2048
    err = capsys.readouterr().err
    assert "multiple choice wmdp_bio:" in err and "0/300" in err and "item" in err
