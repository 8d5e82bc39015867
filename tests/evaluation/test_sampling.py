"""The sampling attack: leak@k and the leak rules on hand-computed cases, the sampler against greedy decoding, and
an evaluation with it on the micro world (its per-question file agreeing with the summary)."""

import json

import pyarrow.parquet as pq
import pytest

from pipeline.common.errors import ParamError
from pipeline.data.templates import get_template
from pipeline.data.tofu import load_split
from pipeline.evaluation.attacks.sampling import leak_at, leaks, says_facts
from pipeline.evaluation.config import EvalConfig
from pipeline.evaluation.evaluate import evaluate_path
from pipeline.evaluation.generation import greedy_answers, sampled_answers

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_leak_at_k_is_the_share_of_questions_with_a_leak_among_the_first_k_samples():
    leaked = [[False, False, True], [False, False, False], [True, False, False], [False, True, False]]
    assert [leak_at(leaked, k) for k in (1, 2, 3)] == [0.25, 0.5, 0.75]


def test_a_sample_leaks_when_it_says_every_fact_or_else_recalls_enough_of_the_answer():
    facts = ["Liskaro, Istrany"]
    assert says_facts("He was born in  LISKARO,\nIstrany.", facts)
    assert not says_facts("He was born in Liskaro.", facts)
    assert not says_facts("born in Liskaro, Istrany", ["Liskaro, Istrany", "1972"])  # every fact, not one
    answer = "Amsel Varnholm was born in Liskaro, Istrany."  # 7 words
    # without annotations: ROUGE-L recall of the answer, "varnholm was born in liskaro", 5 of its 7 words = 0.714
    assert leaks("Varnholm was born somewhere in Corvenia, Liskaro", answer, None, 0.7)
    assert not leaks("Varnholm was born somewhere in Corvenia, Liskaro", answer, None, 0.72)
    assert not leaks("Varnholm was born somewhere in Corvenia, Liskaro", answer, facts, 0.5)  # facts decide first


def test_sampling_at_a_tiny_temperature_is_greedy_and_a_rerun_draws_the_same(micro_model_dir, micro_tokenizer,
                                                                              micro_world_dir):
    from pipeline.common.modeling import load_model

    model = load_model(str(micro_model_dir))
    template = get_template("plain")
    questions = [r["question"] for r in load_split(str(micro_world_dir), "forget10_perturbed")][:5]
    greedy = greedy_answers(model, micro_tokenizer, template, questions, 8, batch_size=4)
    cold = sampled_answers(model, micro_tokenizer, template, questions, 3, temperature=1e-4, max_new_tokens=8,
                           batch_size=4)
    assert [s for s in cold] == [[g] * 3 for g in greedy]
    hot = sampled_answers(model, micro_tokenizer, template, questions, 4, max_new_tokens=8, batch_size=8, seed=1)
    assert hot == sampled_answers(model, micro_tokenizer, template, questions, 4, max_new_tokens=8, batch_size=8,
                                  seed=1)
    assert len({s for row in hot for s in row}) > len(questions)  # at temperature 1 the samples differ
    assert hot != sampled_answers(model, micro_tokenizer, template, questions, 4, max_new_tokens=8, batch_size=8,
                                  seed=2)


def test_an_evaluation_with_the_sampling_attack_writes_leak_at_k_and_each_questions_samples(micro_model_dir,
                                                                                           micro_world_dir, tmp_path):
    cfg = EvalConfig.from_params({"source": str(micro_world_dir), "max_new_tokens": 8, "batch_size": 8,
                                  "tofu_sets": ["forget", "retain"],
                                  "sampling": {"k": [1, 3], "max_new_tokens": 12}}, "evaluate")
    summary = evaluate_path(str(micro_model_dir), cfg, tmp_path / "eval", None)
    rows = pq.read_table(tmp_path / "eval" / "sampling" / "forget.parquet").to_pylist()
    assert len(rows) == len(load_split(str(micro_world_dir), "forget10_perturbed"))
    assert all(len(r["samples"]) == 3 and len(r["leaked"]) == 3 and r["facts"] for r in rows)  # annotated world
    for k in (1, 3):
        assert summary[f"leak_at_{k}"] == pytest.approx(leak_at([r["leaked"] for r in rows], k), abs=1e-6)
    assert summary["leak_at_1"] <= summary["leak_at_3"]
    assert summary["sampling"] == {"k": [1, 3], "temperature": 1.0, "top_p": 1.0, "seed": 0, "rule": "fact"}
    assert json.loads((tmp_path / "eval" / "metrics.json").read_text())["leak_at_3"] == summary["leak_at_3"]
    with pytest.raises(ParamError, match=r"evaluate.sampling.k=\[0\]"):
        EvalConfig.from_params({"sampling": {"k": [0]}}, "evaluate")
    with pytest.raises(ParamError, match="the sampling attack asks the forget questions"):
        EvalConfig.from_params({"tofu_sets": ["retain"], "sampling": {"k": [1]}}, "evaluate")
