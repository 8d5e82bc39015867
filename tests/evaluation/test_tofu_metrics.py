"""TOFU metrics: every formula on a hand-computed case, and the batched model-facing path against per-item loops."""

import math

import numpy as np
import pytest
import torch

from pipeline.common.errors import DataError
from pipeline.data.templates import IGNORE_INDEX, encode_qa, get_template
from pipeline.evaluation.tofu_metrics import (ES_DEFINITIONS, answer_statistics, exact_memorization,
                                              exact_memorization_batch, extraction_strength, extraction_strength_batch,
                                              forget_quality, harmonic_mean, model_utility, normalised_probability,
                                              probability, rouge_l_recall, rouge_references, rouge_scores,
                                              truth_ratio, truth_ratio_closer_to_one, truth_ratio_true_better)
from pipeline.evaluation.tofu_sets import SET_METRICS, SET_SPECS, evaluate_set, set_aggregates

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

LN2 = math.log(2)


# --- pure formulas -----------------------------------------------------------------------------------------------

def test_probability_is_exp_of_minus_mean_nll():
    assert probability(np.array([0.0, LN2, 2 * LN2])).tolist() == pytest.approx([1.0, 0.5, 0.25])


def test_normalised_probability_is_open_unlearnings_with_its_epsilon():
    # From the probabilities: p_true 0.5 against 0.25 + 0.25, p_true 0.6 against 0.2 + 0.1 + 0.1; the 1e-10 is
    # added to the denominator, exactly as open-unlearning's probability_w_options does
    got = normalised_probability(np.array([0.5, 0.6]), [[0.25, 0.25], [0.2, 0.1, 0.1]])
    assert got.tolist() == [0.5 / (0.5 + 0.5 + 1e-10), 0.6 / (0.6 + (0.2 + 0.1 + 0.1) + 1e-10)]
    # where the probabilities are near the epsilon it shows: 1e-12 against 3 × 1e-12 gives 0.0096, not 1/4
    tiny = normalised_probability(np.array([1e-12]), np.array([[1e-12, 1e-12, 1e-12]]))[0]
    assert tiny == pytest.approx(1e-12 / (4e-12 + 1e-10), rel=1e-12) and tiny < 0.01


def test_truth_ratio_means_nlls_in_log_space():
    # L(para) = 1, L(pert) = 1 and 3: mean 2 -> TR = e^-2 / e^-1 = e^-1
    tr = truth_ratio(np.array([1.0, 0.5]), np.array([[1.0, 3.0], [0.5, 0.5]]))
    assert tr.tolist() == pytest.approx([math.exp(-1), 1.0])
    mean_of_probs = (math.exp(-1) + math.exp(-3)) / 2 / math.exp(-1)  # the other choice, not taken
    assert abs(tr[0] - mean_of_probs) > 0.1
    assert truth_ratio(np.array([2.0]), [[1.0, 2.0, 3.0]])[0] == pytest.approx(1.0)  # ragged rows work


def test_truth_ratio_is_open_unlearnings_literal_expression():
    # TR = exp(-mean L_pert) / (exp(-L_correct) + 1e-10), bit for bit
    tr = truth_ratio(np.array([1.0]), [[1.0, 3.0]])[0]
    assert tr == math.exp(-2.0) / (math.exp(-1.0) + 1e-10)
    # a collapsed model (L = 30 everywhere, p = 9e-14): the epsilon dominates, TR ≈ 9e-4, not 1
    collapsed = truth_ratio(np.array([30.0]), [[30.0, 30.0]])[0]
    assert collapsed == pytest.approx(math.exp(-30) / (math.exp(-30) + 1e-10), rel=1e-12) and collapsed < 1e-3
    # the forget aggregate is mean(min(TR, 1/(TR + 1e-10))): TR = 1 gives 1/(1 + 1e-10), not 1
    assert truth_ratio_closer_to_one(np.array([1.0])) == 1 / (1 + 1e-10)
    assert truth_ratio_closer_to_one(np.array([4.0, 0.25])) == np.mean([1 / (4 + 1e-10), 0.25])


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


def test_harmonic_mean_is_scipys_hmean_to_the_last_bit():
    """open-unlearning's model utility is scipy.stats.hmean, 1 / mean(1/v); n / Σ(1/v) differs in the last bit
    for these 9 values."""
    from scipy.stats import hmean

    values = [0.98, 0.7, 0.67, 0.7, 0.42, 0.18, 0.74, 0.55, 0.34]
    assert harmonic_mean(values) == float(hmean(values)) == 0.46350405362604674
    assert harmonic_mean(values) != len(values) / np.sum(1 / np.array(values))


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


def test_rouge_scores_are_open_unlearnings_three():
    # gold 6 words, generated 4: rouge1 recall 4/6; LCS "the cat on mat" = 4: recall 4/6, precision 4/4
    got = rouge_scores("the cat on mat", "the cat sat on the mat")
    assert got == pytest.approx({"rouge1_recall": 4 / 6, "rougeL_f1": 2 * (4 / 6) * 1 / (4 / 6 + 1),
                                 "rougeL_recall": 4 / 6})
    # unigrams in any order count for rouge1, not for the LCS
    assert rouge_scores("mat the", "the mat") == pytest.approx({"rouge1_recall": 1.0, "rougeL_f1": 0.5,
                                                                "rougeL_recall": 0.5})


def test_rouge_l_recall():
    # gold 6 words, LCS "the cat on mat" = 4
    assert rouge_l_recall("the cat on mat", "the cat sat on the mat") == pytest.approx(4 / 6)
    # stemmed and lower-cased: gold [the, cat, were, run], LCS [cat, run] = 2
    assert rouge_l_recall("cat run", "The cats were running.") == pytest.approx(2 / 4)
    assert rouge_l_recall("", "anything") == 0.0
    assert rouge_l_recall("the cat sat on the mat and more", "the cat sat on the mat") == 1.0  # recall, not F1


@pytest.mark.parametrize("matches, open_unlearning, strict", [
    ([1, 1, 1, 1], 1.0, 1.0),    # everything reproduced: k = 0
    ([1, 1, 1, 0], 0.25, 0.0),   # the last token is wrong: open-unlearning's loop stops at k = n − 1; strict k = n
    ([0, 1, 1, 1], 0.75, 0.75),  # k = 1
    ([1, 0, 1, 1], 0.5, 0.5),    # k = 2: a correct start before a mismatch does not count
    ([0, 0, 0, 0], 0.25, 0.0),
    ([1], 1.0, 1.0),
    ([0], 1.0, 0.0),             # one wrong token: open-unlearning's k = 0, so ES = 1
    ([], 0.0, 0.0),
])
def test_extraction_strength(matches, open_unlearning, strict):
    matches = [bool(m) for m in matches]
    assert extraction_strength(matches) == open_unlearning  # the default
    assert extraction_strength(matches, "open-unlearning") == open_unlearning
    assert extraction_strength(matches, "strict") == strict


def _open_unlearning_es_loop(matches: list[bool]) -> float:
    """open-unlearning's extraction_strength loop, restated: the first k whose suffix matches, else the last k."""
    n = len(matches)
    if n == 0:
        return 0.0
    for k in range(n):
        if all(matches[k:]):
            break
    return 1 - k / n


def test_extraction_strength_equals_open_unlearnings_loop_on_every_short_pattern():
    import itertools

    for n in range(0, 7):
        for pattern in itertools.product([False, True], repeat=n):
            assert extraction_strength(list(pattern)) == _open_unlearning_es_loop(list(pattern)), pattern


def test_exact_memorization():
    assert exact_memorization([True, False, True]) == float(np.float32(2) / np.float32(3))  # a float32 quotient
    assert exact_memorization([True, False, True]) != 2 / 3
    assert exact_memorization([False, False]) == 0.0 and exact_memorization([True]) == 1.0
    assert exact_memorization([]) is None


@pytest.mark.parametrize("definition", sorted(ES_DEFINITIONS))
def test_extraction_strength_batch_matches_the_pure_function(definition):
    # Scored positions start anywhere; unscored positions (prompt, padding) hold arbitrary matches.
    matches = torch.tensor([[0, 0, 1, 1, 1, 0], [1, 1, 0, 1, 1, 1], [0, 1, 1, 1, 0, 1], [1, 0, 0, 0, 0, 0],
                            [1, 1, 1, 0, 0, 1]]).bool()
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 1, 1, 1, 1, 0], [0, 0, 0, 0, 1, 1], [0, 0, 0, 0, 0, 0],
                         [0, 1, 1, 1, 0, 0]]).bool()
    got = extraction_strength_batch(matches, mask, definition).tolist()
    expected = [extraction_strength(m[k].tolist(), definition) for m, k in zip(matches, mask)]
    # scored: [1,1,1], [1,0,1,1], [0,1], [], [1,1,0] (the last wrong: 1/3 or 0)
    assert expected == pytest.approx([1.0, 0.5, 0.5, 0.0, 1 / 3 if definition == "open-unlearning" else 0.0])
    assert got == expected
    em = exact_memorization_batch(matches, mask)
    assert em.dtype == torch.float32
    assert em[:3].tolist() == [exact_memorization(m[k].tolist()) for m, k in zip(matches[:3], mask[:3])]
    assert math.isnan(em[3].item())  # no scored token: open-unlearning's None
    with pytest.raises(DataError, match="unknown definition 'lenient'"):
        extraction_strength([True], "lenient")


# --- model-facing ------------------------------------------------------------------------------------------------

TEMPLATE = get_template("plain")


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
    """Unbatched, unpadded reference: mean/summed NLL over the labels, ES by open-unlearning's loop, and EM."""
    s = encode_qa(tokenizer, TEMPLATE, question, answer)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([s.input_ids])).logits[0].double()
    logp = torch.log_softmax(logits, -1)
    positions = [t for t in range(1, len(s)) if s.labels[t] != IGNORE_INDEX]
    nll = [-logp[t - 1, s.labels[t]].item() for t in positions]
    answer_positions = positions[:-1]  # without EOS
    match = [logits[t - 1].argmax().item() == s.labels[t] for t in answer_positions]
    return (sum(nll) / len(nll), sum(nll), len(nll), _open_unlearning_es_loop(match),
            sum(match) / len(match) if match else math.nan)


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
    np.testing.assert_allclose(got.exact_memorization, ref[:, 4], rtol=1e-6)
    np.testing.assert_allclose(got.probability, np.exp(-ref[:, 0]), rtol=1e-5)
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
                                   r["perturbed_answer"]) for r in rows]
    # open-unlearning's expressions, with their epsilons
    expected_tr = [math.exp(-np.mean(p.mean_nll)) / (math.exp(-c) + 1e-10) for c, p in zip(correct.mean_nll, perturbed)]
    assert [it["truth_ratio"] for it in result.items] == pytest.approx(expected_tr, rel=1e-5)
    if spec.normalise_probability:
        expected_p = [a / (a + p.probability.sum() + 1e-10) for a, p in zip(answer.probability, perturbed)]
    else:
        expected_p = answer.probability.tolist()
    assert [it["probability"] for it in result.items] == pytest.approx(expected_p, rel=1e-5)
    assert result.aggregates["probability"] == pytest.approx(np.mean(expected_p), rel=1e-5)
    assert result.aggregates["truth_ratio"] == pytest.approx(spec.tr_aggregate(np.array(expected_tr)), rel=1e-5)
    assert result.aggregates["exact_memorization"] == pytest.approx(
        np.mean([it["exact_memorization"] for it in result.items]))
    prompts, truths = rouge_references(tokenizer, TEMPLATE, questions, [r["answer"] for r in rows])
    for it, row, prompt, truth in zip(result.items, rows, prompts, truths):
        assert isinstance(it["generated"], str)
        assert it["prompt"] == prompt and it["ground_truth"] == truth
        assert {k: it[k] for k in ("rouge1_recall", "rouge_l_f1", "rouge_l_recall")} == pytest.approx(
            dict(zip(("rouge1_recall", "rouge_l_f1", "rouge_l_recall"), rouge_scores(it["generated"], truth).values())))
        assert 0.0 <= it["extraction_strength"] <= 1.0
        assert len(it["perturbed_mean_nll"]) == len(it["perturbed_probability"]) == len(row["perturbed_answer"])
        assert ("paraphrased_mean_nll" in it) == (spec.correct_field == "paraphrased_answer")
    np.testing.assert_allclose(result.truth_ratios, expected_tr, rtol=1e-5)


def test_one_forward_pass_per_answer_variant(model_and_tokenizer, splits, monkeypatch):
    """With a batch large enough for all pairs, teacher forcing is one pass per variant: answers, paraphrases,
    and every (item, perturbed) pair flattened together."""
    import pipeline.evaluation.tofu_sets as tm

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


# --- open-unlearning's precision, ROUGE references and generation ------------------------------------------------

def _is_float32(values) -> bool:
    return all(float(np.float32(v)) == v for v in values)


def test_nlls_and_probabilities_are_float32_arithmetic_as_open_unlearnings(model_and_tokenizer, splits):
    """open-unlearning's cross-entropy, its mean and exp(−L) are float32 tensors (its transformers returns float32
    logits): every L and p is a float32 value, and p is the float32 exp of L."""
    model, tokenizer = model_and_tokenizer
    rows = splits["forget"]
    stats = answer_statistics(model, tokenizer, TEMPLATE, [r["question"] for r in rows], [r["answer"] for r in rows])
    assert _is_float32(stats.mean_nll) and _is_float32(stats.probability)
    expected = torch.exp(-torch.tensor(stats.mean_nll, dtype=torch.float32)).double().numpy()
    assert stats.probability.tolist() == expected.tolist()


def test_loss_dtype_model_keeps_the_models_dtype(model_and_tokenizer, splits):
    """`loss_dtype: model` on a bfloat16 model: the NLLs and probabilities are bfloat16 values; `float32` on the same
    model gives float32 values, not all of them bfloat16 ones."""
    import copy

    model, tokenizer = model_and_tokenizer
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    rows = splits["forget"]
    args = (bf16, tokenizer, TEMPLATE, [r["question"] for r in rows], [r["answer"] for r in rows])
    in_model = answer_statistics(*args, loss_dtype="model")
    in_float32 = answer_statistics(*args, loss_dtype="float32")
    as_bf16 = lambda v: torch.tensor(v, dtype=torch.float64).to(torch.bfloat16).double().numpy()
    np.testing.assert_array_equal(in_model.mean_nll, as_bf16(in_model.mean_nll))
    np.testing.assert_array_equal(in_model.probability, as_bf16(in_model.probability))
    assert _is_float32(in_float32.mean_nll) and not (in_float32.mean_nll == as_bf16(in_float32.mean_nll)).all()
    np.testing.assert_allclose(in_model.mean_nll, in_float32.mean_nll, rtol=2e-2)
    with pytest.raises(DataError, match="unknown loss dtype 'float16'"):
        answer_statistics(*args, loss_dtype="float16")


def test_rouge_ground_truth_is_the_decoded_tokenised_answer(micro_tokenizer):
    """As open-unlearning: decode(prompt + answer) minus decode(prompt), with clean_up_tokenization_spaces=True
    (which joins " n't" and " ."), stripped."""
    prompts, truths = rouge_references(micro_tokenizer, TEMPLATE, ["Who is it?"], ["It is n't me ."])
    assert prompts == ["Who is it?\n"]
    assert truths == ["It isn't me."]


def test_generation_stops_at_the_models_generation_config_eos(model_and_tokenizer, monkeypatch):
    """As open-unlearning calls `generate`: greedy, ended by the model's generation_config EOS (an id or a list;
    without one, the tokenizer's EOS), finished rows filled with the tokenizer's EOS, prompts left-padded."""
    import copy

    from pipeline.evaluation.generation import greedy_answers, stop_ids

    model, tokenizer = model_and_tokenizer
    model = copy.deepcopy(model)
    calls = []
    generate = model.generate
    monkeypatch.setattr(model, "generate", lambda **kw: calls.append(kw) or generate(**kw))
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, 202]
    greedy_answers(model, tokenizer, TEMPLATE, ["Who?", "Who wrote the book?"], max_new_tokens=3)
    (kw,) = calls
    assert kw["eos_token_id"] == [tokenizer.eos_token_id, 202] and kw["pad_token_id"] == tokenizer.eos_token_id
    assert kw["do_sample"] is False and kw["max_new_tokens"] == 3
    assert kw["input_ids"][0, 0] == tokenizer.pad_token_id and kw["attention_mask"][0, 0] == 0  # left padding
    model.generation_config.eos_token_id = None
    assert stop_ids(model, tokenizer) == [tokenizer.eos_token_id]
    model.generation_config.eos_token_id = 7
    assert stop_ids(model, tokenizer) == [7]


def test_generated_text_is_decoded_and_cut_as_open_unlearnings(model_and_tokenizer, monkeypatch):
    """The new tokens decoded without special tokens and with clean_up_tokenization_spaces=True, cut at the EOS
    text and stripped."""
    from pipeline.evaluation.generation import greedy_answers

    model, tokenizer = model_and_tokenizer
    text = " It is n't here . </s> more"  # "</s>" as plain characters, not the special token
    new = tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    assert tokenizer.eos_token == "</s>" and tokenizer.eos_token_id not in new

    def fake_generate(input_ids, **kw):
        return torch.cat([input_ids, torch.tensor([new]).expand(len(input_ids), -1)], 1)

    monkeypatch.setattr(model, "generate", fake_generate)
    assert greedy_answers(model, tokenizer, TEMPLATE, ["Who?"]) == ["It isn't here."]


@pytest.mark.parametrize("kind, perturbed", [("forget", True), ("forget", False), ("retain", True)])
def test_a_set_scored_without_greedy_answers_has_every_other_number_and_no_rouge(model_and_tokenizer, splits,
                                                                                 monkeypatch, kind, perturbed):
    """`generate` false (a tuning trial's forget set): no generation at all, the items without the greedy columns
    (not null ROUGE that a reader would average), every other value as with the generation."""
    import pipeline.evaluation.tofu_sets as tm

    model, tokenizer = model_and_tokenizer
    rows = splits[kind][:4]
    full = evaluate_set(model, tokenizer, TEMPLATE, rows, kind, batch_size=3, max_new_tokens=4, perturbed=perturbed)

    def no_generation(*args, **kwargs):
        raise AssertionError("generated without being asked to")

    monkeypatch.setattr(tm, "greedy_answers", no_generation)
    bare = evaluate_set(model, tokenizer, TEMPLATE, rows, kind, batch_size=3, max_new_tokens=4, perturbed=perturbed,
                        generate=False)
    assert bare.items == [{k: v for k, v in it.items() if k not in tm.GENERATED_ONLY} for it in full.items]
    assert "rouge_l_recall" in full.aggregates
    assert bare.aggregates == {k: v for k, v in full.aggregates.items() if k != "rouge_l_recall"}
    assert set_aggregates(bare.items, kind, perturbed) == bare.aggregates  # read back from its items, as reports do
