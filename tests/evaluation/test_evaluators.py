"""The evaluator interface: each benchmark or attack returns its share of the summary and its files, merged in order;
a key that is no registered metric stops the evaluation before anything is written."""

import json

import pytest

from pipeline.common.errors import TokenUnlearnError
from pipeline.evaluation import evaluate
from pipeline.evaluation.config import EvalConfig
from pipeline.evaluation.evaluator import Evaluator, Part, merge
from pipeline.evaluation.registry import MUSE, TOFU


def test_a_part_extends_the_sections_it_shares_and_keeps_its_order():
    summary = {"model": "m", "forget": {"n": 2, "truth_ratio": 0.5}}
    merge(summary, {"forget": {"para_extraction_strength": 0.25}, "forget_para_es": 0.25, "mc_a": 1.0,
                    "multiple_choice": {"a": {"n": 4}}, "mc_b": 0.5})
    assert summary == {"model": "m", "forget": {"n": 2, "truth_ratio": 0.5, "para_extraction_strength": 0.25},
                       "forget_para_es": 0.25, "mc_a": 1.0, "multiple_choice": {"a": {"n": 4}}, "mc_b": 0.5}
    assert list(summary) == ["model", "forget", "forget_para_es", "mc_a", "multiple_choice", "mc_b"]


def test_the_evaluators_run_in_the_summarys_order_and_only_where_the_params_ask():
    names = [kind.name for kind in evaluate.EVALUATORS]
    # the built-in ones, in the order their keys appear (a new evaluator goes after them, or where it belongs)
    assert names[:6] == ["tofu", "paraphrase", "mia", "multiple_choice", "lm_eval", "quantization"]
    cfg = EvalConfig(source="s", tofu_sets=["forget"], multiple_choice={}, mia=None)
    assert [k.name for k in evaluate.EVALUATORS if k().enabled(cfg)] == ["tofu"]


class _Counts(Evaluator):
    """A benchmark of one number, its key chosen by the test, and one file."""

    name, benchmark, key = "counts", TOFU, "forget_em"

    def enabled(self, cfg):
        return True

    def run(self, model, ctx):
        return Part({self.key: 0.5}, {"counts/n.json": lambda path: path.write_text(json.dumps(len(ctx.items)))})


@pytest.fixture
def forget_only(micro_world_dir):
    return EvalConfig(source=str(micro_world_dir), tofu_sets=["forget"], multiple_choice={}, max_new_tokens=4)


def test_a_new_evaluator_is_one_class_in_the_list(micro_model_dir, forget_only, tmp_path, monkeypatch):
    monkeypatch.setattr(evaluate, "EVALUATORS", (*evaluate.EVALUATORS, _Counts))
    summary = evaluate.evaluate_model(str(micro_model_dir), forget_only, tmp_path / "e", None)
    assert list(summary)[-1] == "forget_em" and summary["forget_em"] == 0.5  # after TOFU's, as merged
    assert json.loads((tmp_path / "e" / "counts" / "n.json").read_text()) == 1  # the TOFU items it was handed
    assert json.loads((tmp_path / "e" / "metrics.json").read_text())["forget_em"] == 0.5


def test_an_unregistered_key_stops_the_evaluation_before_it_writes(micro_model_dir, forget_only, tmp_path,
                                                                   monkeypatch):
    monkeypatch.setattr(_Counts, "key", "forget_speed")
    monkeypatch.setattr(evaluate, "EVALUATORS", (*evaluate.EVALUATORS, _Counts))
    with pytest.raises(TokenUnlearnError, match=r"\['forget_speed'\] are no metric of pipeline/evaluation/registry"):
        evaluate.evaluate_model(str(micro_model_dir), forget_only, tmp_path / "e", None)
    assert not (tmp_path / "e").exists()


def test_muse_keys_are_checked_against_muses_metrics():
    from pipeline.evaluation.registry import check_registered

    check_registered({"verbmem_f": 12.0, "knowmem_f": 3.0, "knowmem_r": 40.0, "utility_preserved": 40.0}, "m", MUSE)
    with pytest.raises(TokenUnlearnError, match=r"\['forget_es'\]"):
        check_registered({"forget_es": 0.5}, "m", MUSE)
