"""TOFU metrics: every formula on a hand-computed case, and the batched model-facing path against per-item loops."""

import math

import numpy as np
import pytest
import torch

from pipeline.common.errors import DataError
from pipeline.data.templates import IGNORE_INDEX, encode_qa, get_template
from pipeline.evaluation.tofu_metrics import (SET_METRICS, SET_SPECS, answer_statistics, evaluate_set,
                                              extraction_strength, extraction_strength_batch, forget_quality,
                                              harmonic_mean, model_utility, normalised_probability, probability,
                                              rouge_l_recall, truth_ratio, truth_ratio_closer_to_one,
                                              truth_ratio_true_better)

LN2 = math.log(2)


# --- pure formulas -----------------------------------------------------------------------------------------------

def test_probability_is_exp_of_minus_mean_nll():
    assert probability(np.array([0.0, LN2, 2 * LN2])).tolist() == pytest.approx([1.0, 0.5, 0.25])


def test_normalised_probability():
    # p_true 0.5 against 0.25 + 0.25 -> 0.5 ; p_true 0.6 against 0.2 + 0.1 + 0.1 -> 0.6
    nll = lambda *p: [-math.log(x) for x in p]
    got = normalised_probability(np.array(nll(0.5, 0.6)), [nll(0.25, 0.25), nll(0.2, 0.1, 0.1)])
    assert got.tolist() == pytest.approx([0.5, 0.6])
    # tiny probabilities (NLL 1000) do not underflow to 0/0: equal NLLs give 1/(1+K)
    assert normalised_probability(np.array([1000.0]), np.array([[1000.0, 1000.0, 1000.0]]))[0] == pytest.approx(0.25)


def test_truth_ratio_means_nlls_in_log_space():
    # L(para) = 1, L(pert) = 1 and 3: mean 2 -> TR = e^-2 / e^-1 = e^-1
    tr = truth_ratio(np.array([1.0, 0.5]), np.array([[1.0, 3.0], [0.5, 0.5]]))
    assert tr.tolist() == pytest.approx([math.exp(-1), 1.0])
    mean_of_probs = (math.exp(-1) + math.exp(-3)) / 2 / math.exp(-1)  # the other choice, not taken
    assert abs(tr[0] - mean_of_probs) > 0.1
    assert truth_ratio(np.array([2.0]), [[1.0, 2.0, 3.0]])[0] == pytest.approx(1.0)  # ragged rows work


def test_truth_ratio_aggregates():
    tr = np.array([0.5, 2.0, 1.0])
    assert truth_ratio_closer_to_one(tr) == pytest.approx((0.5 + 0.5 + 1.0) / 3)
    assert truth_ratio_true_better(tr) == pytest.approx((0.5 + 0.0 + 0.0) / 3)
    assert truth_ratio_closer_to_one(np.array([0.0, 1.0])) == pytest.approx(0.5)  # TR 0 counts as 0, no error
    assert SET_SPECS["forget"].tr_aggregate is truth_ratio_closer_to_one
    assert all(SET_SPECS[k].tr_aggregate is truth_ratio_true_better for k in ("retain", "real_authors", "world_facts"))


def test_forget_quality():
    same = [0.2, 0.5, 0.9, 1.3, 2.0]
    fq = forget_quality(same, list(same))
    assert fq.pvalue == pytest.approx(1.0) and fq.log10_pvalue == pytest.approx(0.0)
    low, high = np.linspace(0.0, 1.0, 20), np.linspace(10.0, 11.0, 20)
    fq = forget_quality(low, high)
    # fully separated samples of 20 and 20: exact two-sided p = 2 / C(40, 20)
    assert fq.pvalue == pytest.approx(2 / math.comb(40, 20), rel=1e-6)
    assert fq.log10_pvalue == pytest.approx(math.log10(fq.pvalue))
    with pytest.raises(DataError, match="empty"):
        forget_quality([], same)


def test_harmonic_mean():
    assert harmonic_mean([1.0, 0.5, 0.25]) == pytest.approx(3 / (1 + 2 + 4))
    assert harmonic_mean([0.7, 0.0, 0.9]) == 0.0
    with pytest.raises(DataError):
        harmonic_mean([0.5, -0.1])


def test_model_utility():
    sets = {s: {"probability": 0.5, "rouge_l_recall": 0.5, "truth_ratio": 0.5, "extraction_strength": 0.0}
            for s in ("retain", "real_authors", "world_facts")}
    assert model_utility(sets) == pytest.approx(0.5)  # extraction strength is not a sub-metric
    sets["world_facts"]["rouge_l_recall"] = 0.25
    assert model_utility(sets) == pytest.approx(9 / (8 * 2 + 4))
    sets["retain"]["truth_ratio"] = 0.0
    assert model_utility(sets) == 0.0
    del sets["real_authors"]["probability"]
    with pytest.raises(DataError, match=r"'real_authors\.probability' is missing"):
        model_utility(sets)
    with pytest.raises(DataError, match=r"'world_facts\.probability' is missing"):
        model_utility({k: v for k, v in sets.items() if k != "world_facts"} | {"real_authors": sets["retain"]})


def test_rouge_l_recall():
    # gold 6 words, LCS "the cat on mat" = 4
    assert rouge_l_recall("the cat on mat", "the cat sat on the mat") == pytest.approx(4 / 6)
    # stemmed and lower-cased: gold [the, cat, were, run], LCS [cat, run] = 2
    assert rouge_l_recall("cat run", "The cats were running.") == pytest.approx(2 / 4)
    assert rouge_l_recall("", "anything") == 0.0
    assert rouge_l_recall("the cat sat on the mat and more", "the cat sat on the mat") == 1.0  # recall, not F1


@pytest.mark.parametrize("matches, expected", [
    ([1, 1, 1, 1], 1.0),    # everything reproduced: k = 0
    ([1, 1, 1, 0], 0.0),    # the last token is wrong: k = |y|
    ([0, 1, 1, 1], 0.75),   # k = 1
    ([1, 0, 1, 1], 0.5),    # k = 2: a correct start before a mismatch does not count
    ([0, 0, 0, 0], 0.0),
    ([1], 1.0),
    ([0], 0.0),
    ([], 0.0),
])
def test_extraction_strength(matches, expected):
    assert extraction_strength([bool(m) for m in matches]) == pytest.approx(expected)


def test_extraction_strength_batch_matches_the_pure_function():
    # Scored positions start anywhere; unscored positions (prompt, padding) hold arbitrary matches.
    matches = torch.tensor([[0, 0, 1, 1, 1, 0], [1, 1, 0, 1, 1, 1], [0, 1, 1, 1, 0, 1], [1, 0, 0, 0, 0, 0]]).bool()
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 1, 1, 1, 1, 0], [0, 0, 0, 0, 1, 1], [0, 0, 0, 0, 0, 0]]).bool()
    got = extraction_strength_batch(matches, mask).tolist()
    expected = [extraction_strength(m[k].tolist()) for m, k in zip(matches, mask)]
    assert expected == pytest.approx([1.0, 0.5, 0.5, 0.0])  # scored: [1,1,1], [1,0,1,1], [0,1], []
    assert got == pytest.approx(expected)


# --- model-facing ------------------------------------------------------------------------------------------------

TEMPLATE = get_template("plain")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny model is several times faster on one thread than on contended OpenMP threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model_and_tokenizer(micro_model_dir):
    from pipeline.common.modeling import load_model, load_tokenizer

    return load_model(micro_model_dir).eval(), load_tokenizer(micro_model_dir)


@pytest.fixture(scope="module")
def splits(micro_world_dir):
    from pipeline.data.tofu import load_split

    names = {"forget": "forget10_perturbed", "retain": "retain_perturbed", "real_authors": "real_authors_perturbed",
             "world_facts": "world_facts_perturbed"}
    return {kind: load_split(micro_world_dir, name) for kind, name in names.items()}


def _per_item(model, tokenizer, question, answer):
    """Unbatched, unpadded reference: mean/summed NLL over the labels, and ES by the definition's own loop."""
    s = encode_qa(tokenizer, TEMPLATE, question, answer)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([s.input_ids])).logits[0].double()
    logp = torch.log_softmax(logits, -1)
    positions = [t for t in range(1, len(s)) if s.labels[t] != IGNORE_INDEX]
    nll = [-logp[t - 1, s.labels[t]].item() for t in positions]
    answer_positions = positions[:-1]  # without EOS
    match = [logits[t - 1].argmax().item() == s.labels[t] for t in answer_positions]
    n = len(match)
    k = next(k for k in range(n + 1) if all(match[k:]))
    return sum(nll) / len(nll), sum(nll), len(nll), (1 - k / n if n else 0.0)


def test_batched_statistics_equal_per_item_computation(model_and_tokenizer, splits):
    model, tokenizer = model_and_tokenizer
    rows = splits["forget"] + splits["real_authors"][:3]
    questions = [r["question"] for r in rows for _ in r["perturbed_answer"]]
    answers = [p for r in rows for p in r["perturbed_answer"]]
    assert len({len(a) for a in answers}) > 1  # lengths differ, so batches are padded
    got = answer_statistics(model, tokenizer, TEMPLATE, questions, answers, batch_size=4)
    ref = np.array([_per_item(model, tokenizer, q, a) for q, a in zip(questions, answers)])
    np.testing.assert_allclose(got.mean_nll, ref[:, 0], atol=1e-5)
    np.testing.assert_allclose(got.sum_nll, ref[:, 1], atol=1e-4)
    np.testing.assert_array_equal(got.n_tokens, ref[:, 2])
    np.testing.assert_allclose(got.extraction_strength, ref[:, 3], atol=1e-12)
    one_batch = answer_statistics(model, tokenizer, TEMPLATE, questions, answers, batch_size=len(answers))
    np.testing.assert_allclose(one_batch.mean_nll, got.mean_nll, atol=1e-5)


def test_memorised_answer_has_full_extraction_strength(model_and_tokenizer, splits):
    """Overfit a copy of the tiny model on one answer: its ES is 1 and its probability near 1, greedy decoding
    reproduces it (ROUGE-L recall 1), while the other rows stay unmemorised."""
    import copy

    from pipeline.data.batching import pad_batch

    model, tokenizer = model_and_tokenizer
    rows = splits["forget"]
    target = rows[0]
    model = copy.deepcopy(model).train()
    sample = encode_qa(tokenizer, TEMPLATE, target["question"], target["answer"])
    batch = pad_batch([sample], tokenizer.pad_token_id)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(60):
        opt.zero_grad()
        model(**batch).loss.backward()
        opt.step()
    stats = answer_statistics(model, tokenizer, TEMPLATE, [target["question"]], [target["answer"]])
    assert stats.extraction_strength[0] == 1.0
    assert probability(stats.mean_nll)[0] > 0.9
    answer_tokens = len(sample) - sample.prompt_length  # answer and EOS: enough to reproduce it and stop
    result = evaluate_set(model, tokenizer, TEMPLATE, rows, "forget", batch_size=2, max_new_tokens=answer_tokens)
    assert result.items[0]["extraction_strength"] == 1.0
    assert result.items[0]["rouge_l_recall"] == 1.0
    assert result.items[0]["generated"] == target["answer"]
    assert result.aggregates["extraction_strength"] == pytest.approx(
        np.mean([it["extraction_strength"] for it in result.items]))


@pytest.mark.parametrize("kind", sorted(SET_SPECS))
def test_evaluate_set_on_the_micro_world(model_and_tokenizer, splits, kind):
    model, tokenizer = model_and_tokenizer
    rows = splits[kind][:4]
    result = evaluate_set(model, tokenizer, TEMPLATE, rows, kind, batch_size=3, max_new_tokens=6)
    assert len(result.items) == len(rows) and set(result.aggregates) == set(SET_METRICS)
    # The truth ratio's denominator is the paraphrase for forget/retain and the answer itself for the others.
    spec = SET_SPECS[kind]
    questions = [r["question"] for r in rows]
    correct = answer_statistics(model, tokenizer, TEMPLATE, questions, [r[spec.correct_field] for r in rows])
    answer = answer_statistics(model, tokenizer, TEMPLATE, questions, [r["answer"] for r in rows])
    perturbed = [answer_statistics(model, tokenizer, TEMPLATE, [r["question"]] * len(r["perturbed_answer"]),
                                   r["perturbed_answer"]).mean_nll for r in rows]
    expected_tr = [math.exp(c - np.mean(p)) for c, p in zip(correct.mean_nll, perturbed)]
    assert [it["truth_ratio"] for it in result.items] == pytest.approx(expected_tr, rel=1e-5)
    if spec.normalise_probability:
        expected_p = [math.exp(-a) / (math.exp(-a) + np.exp(-p).sum()) for a, p in zip(answer.mean_nll, perturbed)]
    else:
        expected_p = np.exp(-answer.mean_nll).tolist()
    assert [it["probability"] for it in result.items] == pytest.approx(expected_p, rel=1e-5)
    assert result.aggregates["probability"] == pytest.approx(np.mean(expected_p), rel=1e-5)
    assert result.aggregates["truth_ratio"] == pytest.approx(spec.tr_aggregate(np.array(expected_tr)), rel=1e-5)
    for it, row in zip(result.items, rows):
        assert isinstance(it["generated"], str)
        assert it["rouge_l_recall"] == pytest.approx(rouge_l_recall(it["generated"], row["answer"]))
        assert 0.0 <= it["extraction_strength"] <= 1.0
    np.testing.assert_allclose(result.truth_ratios, expected_tr, rtol=1e-5)


def test_one_forward_pass_per_answer_variant(model_and_tokenizer, splits, monkeypatch):
    """With a batch large enough for all pairs, teacher forcing is one pass per variant: answers, paraphrases,
    and every (item, perturbed) pair flattened together."""
    import pipeline.evaluation.tofu_metrics as tm

    model, tokenizer = model_and_tokenizer
    monkeypatch.setattr(tm, "greedy_answers", lambda m, t, tpl, qs, **kw: ["" for _ in qs])
    calls = []
    handle = model.register_forward_hook(lambda mod, args, out: calls.append(1))
    try:
        evaluate_set(model, tokenizer, TEMPLATE, splits["forget"], "forget", batch_size=1000)
        assert len(calls) == 3
        calls.clear()
        evaluate_set(model, tokenizer, TEMPLATE, splits["world_facts"], "world_facts", batch_size=1000)
        assert len(calls) == 2  # the answer is its own "paraphrase"
    finally:
        handle.remove()


def test_forget_quality_and_utility_from_evaluated_sets(model_and_tokenizer, splits):
    model, tokenizer = model_and_tokenizer
    results = {k: evaluate_set(model, tokenizer, TEMPLATE, splits[k][:3], k, batch_size=8, max_new_tokens=4)
               for k in ("forget", "retain", "real_authors", "world_facts")}
    assert forget_quality(results["forget"].truth_ratios, results["forget"].truth_ratios).pvalue == pytest.approx(1.0)
    utility = model_utility({k: r.aggregates for k, r in results.items()})
    values = [results[s].aggregates[m] for s in ("retain", "real_authors", "world_facts")
              for m in ("probability", "rouge_l_recall", "truth_ratio")]
    assert utility == pytest.approx(harmonic_mean(values))


@pytest.mark.parametrize("kind, field", [("forget", "paraphrased_answer"), ("retain", "perturbed_answer"),
                                         ("real_authors", "answer"), ("world_facts", "question")])
def test_bad_row_names_set_row_and_field(splits, kind, field):
    rows = [dict(r) for r in splits[kind][:3]]
    del rows[1][field]
    with pytest.raises(DataError, match=rf"my_{kind}: row 2: .*'{field}'"):
        evaluate_set(None, None, TEMPLATE, rows, kind, name=f"my_{kind}")
    rows[1][field] = [] if field == "perturbed_answer" else 3
    with pytest.raises(DataError, match=rf"{kind}: row 2: .*'{field}'"):
        evaluate_set(None, None, TEMPLATE, rows, kind)


def test_unknown_kind():
    with pytest.raises(DataError, match="unknown set kind 'holdout'"):
        evaluate_set(None, None, TEMPLATE, [{"question": "q"}], "holdout")
