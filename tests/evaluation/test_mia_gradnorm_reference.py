"""The GradNorm and Reference membership-inference attacks: gradnorm's statistic on a hand-computed bigram model and
against open-unlearning's own procedure on a tiny Llama, the model left as it was; the reference score; the
reference model's losses read from its evaluation (checked by the hashes of the questions and of the tokens) or
computed by loading it; privleak of both in the summary and the report."""

import json
import logging
import math
import shutil
from types import SimpleNamespace

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from torch import nn

from pipeline.common.errors import DataError, ParamError
from pipeline.data.templates import IGNORE_INDEX, EncodedSample
from pipeline.evaluation.mia import (MIA_ATTACKS, TOKENS_HASH, SampleTokens, gradient_norms, membership_inference,
                                     privleak)
from pipeline.evaluation.mia_reference import resolve_reference


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


class Bigram(nn.Module):
    """logits at t = W[x_t] + b: W trainable, b frozen (requires_grad False), `unused` in no forward pass."""

    def __init__(self):
        super().__init__()
        self.W = nn.Parameter(torch.zeros(3, 3))
        self.b = nn.Parameter(torch.zeros(3), requires_grad=False)
        self.unused = nn.Parameter(torch.ones(2))
        self.modes = []  # the training flag each forward pass saw

    def forward(self, input_ids):
        self.modes.append(self.training)
        return SimpleNamespace(logits=self.W[input_ids] + self.b)


def encoded(ids, labels) -> EncodedSample:
    return EncodedSample("", ids, labels, [(0, 0)] * len(ids), (0, 0), (0, 0), labels.count(IGNORE_INDEX))


# ids 0 1 2 1, the first unlabelled: three labelled tokens, 1 2 1, of which gradnorm's loss reads the first two
# (the last left out, as open-unlearning's tokenwise_logprobs): token 1 after 0 and token 2 after 1, each with
# p = 1/3 under W = 0. dL/dlogits_t = (softmax − onehot) / 2, so
#   grad W[0] = (1/3, −2/3, 1/3) / 2,  grad W[1] = (1/3, 1/3, −2/3) / 2,  grad W[2] = 0
#   grad b    = their sum            = (1/3, −1/6, −1/6)
# and `unused` gets no gradient: left out of the mean, as open-unlearning's `param.grad is not None`.
SAMPLE = encoded([0, 1, 2, 1], [IGNORE_INDEX, 1, 2, 1])
BY_HAND = {2: (math.sqrt(1 / 3) + math.sqrt(1 / 6)) / 2,  # |W|₂ = √(2·(1/36 + 1/9 + 1/36)), |b|₂ = √(1/6)
           1: (4 / 3 + 2 / 3) / 2,                          # |W|₁ = 4/3, |b|₁ = 2/3
           math.inf: (1 / 3 + 1 / 3) / 2}                   # both max |g| = 1/3


@pytest.mark.parametrize("p", [2, 1, math.inf])
def test_gradnorm_is_the_mean_of_the_per_tensor_norms(p):
    assert gradient_norms(Bigram(), [SAMPLE], p)[0] == pytest.approx(BY_HAND[p], rel=1e-6)


def test_gradnorm_leaves_out_the_last_labelled_token_and_scores_an_empty_sample_zero():
    # with the last token too (ids 0 1 2 1 1), the loss would read a third position: another value
    longer = gradient_norms(Bigram(), [encoded([0, 1, 2, 1, 1], [IGNORE_INDEX, 1, 2, 1, 1])])[0]
    assert longer != pytest.approx(BY_HAND[2])
    only_eos = encoded([0, 1], [IGNORE_INDEX, 1])  # one labelled token, the one left out: nothing to score
    assert gradient_norms(Bigram(), [only_eos, SAMPLE]).tolist() == pytest.approx([0.0, BY_HAND[2]])
    with pytest.raises(ValueError, match="p=3"):
        gradient_norms(Bigram(), [SAMPLE], 3)


def test_gradnorm_leaves_the_model_as_it_was():
    model = Bigram().train()
    earlier = torch.full((3, 3), 7.0)
    model.W.grad = earlier  # a gradient accumulated by training, not yet stepped
    assert gradient_norms(model, [SAMPLE, SAMPLE])[1] == pytest.approx(BY_HAND[2])  # the first not added in
    assert model.W.grad is earlier and torch.equal(earlier, torch.full((3, 3), 7.0))
    assert model.b.grad is None and model.unused.grad is None
    assert [p.requires_grad for p in (model.W, model.b, model.unused)] == [True, False, True]
    assert model.modes == [False, False] and model.training  # scored in eval mode, given back in training mode

    class Failing(Bigram):
        def forward(self, input_ids):
            raise RuntimeError("out of memory")

    failing = Failing()
    with pytest.raises(RuntimeError, match="out of memory"):
        gradient_norms(failing, [SAMPLE])
    assert not failing.b.requires_grad and failing.training  # a new module trains: as it was
    assert not any(p._post_accumulate_grad_hooks for p in failing.parameters())  # hooks removed


def test_registry_scores():
    logp = np.log([0.5, 0.25, 1.0])
    s = SampleTokens(logp, np.zeros(3), np.ones(3), "x", grad_norm=0.7, reference_loss=0.2)
    assert MIA_ATTACKS["gradnorm"](s, 0.4) == 0.7  # higher: less likely a member, as open-unlearning's now
    assert MIA_ATTACKS["reference"](s, 0.4) == pytest.approx(-(math.log(0.5) + math.log(0.25)) / 3 - 0.2)
    with pytest.raises(ValueError, match="reference attack's input"):
        MIA_ATTACKS["reference"](SampleTokens(logp, np.zeros(3), np.ones(3), "x"), 0.4)


def test_gradnorm_equals_open_unlearnings_procedure_on_a_tied_llama(micro_model_dir, micro_tokenizer,
                                                                    micro_world_dir):
    """open-unlearning's way, written out: zero_grad, backward of the sample's loss over the labelled tokens but
    the last, the mean of `param.grad.norm(p)` over model.parameters() (the tied embedding once)."""
    from pipeline.common.modeling import load_model
    from pipeline.data.templates import encode_qa, get_template
    from pipeline.data.tofu import load_split

    model = load_model(str(micro_model_dir))
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    rows = load_split(str(micro_world_dir), "forget10")[:2]
    samples = [encode_qa(micro_tokenizer, get_template("plain"), r["question"], r["answer"]) for r in rows]
    got = gradient_norms(model, samples, 2)
    for sample, value in zip(samples, got):
        model.zero_grad()
        logits = model(input_ids=torch.tensor([sample.input_ids])).logits[0, :-1]
        labels = torch.tensor(sample.labels[1:])
        at = (labels != IGNORE_INDEX).nonzero().flatten()[:-1]
        torch.nn.functional.cross_entropy(logits[at], labels[at]).backward()
        norms = [p.grad.norm(2) for p in model.parameters() if p.grad is not None]
        assert value == pytest.approx(torch.stack(norms).mean().item(), rel=1e-5)
    model.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_reference_scores_against_given_losses_and_against_the_model_itself(micro_model_dir, micro_tokenizer,
                                                                            micro_world_dir):
    from pipeline.common.modeling import load_model
    from pipeline.data.templates import get_template
    from pipeline.data.tofu import load_split

    model = load_model(str(micro_model_dir)).eval()
    template = get_template("plain")
    forget, holdout = (load_split(str(micro_world_dir), s) for s in ("forget10", "holdout10"))
    own = membership_inference(model, micro_tokenizer, template, forget, holdout, ["loss", "reference", "gradnorm"],
                               0.4, reference_losses="self")
    assert (own.forget["reference"] == 0).all() and own.auc["reference"] == 0.5  # all ties
    assert (own.forget["gradnorm"] > 0).all() and 0 <= own.auc["gradnorm"] <= 1
    given = (np.full(len(forget), 1.0), np.arange(len(holdout), dtype=float))
    other = membership_inference(model, micro_tokenizer, template, forget, holdout, ["reference"], 0.4,
                                 reference_losses=given)
    assert other.forget["reference"] == pytest.approx(own.forget["loss"] - 1.0)
    assert other.holdout["reference"] == pytest.approx(own.holdout["loss"] - given[1])
    with pytest.raises(DataError, match="needs the reference model's losses"):
        membership_inference(model, micro_tokenizer, template, forget, holdout, ["reference"], 0.4)


# ---- through the evaluation: the reference's losses from its evaluation, or by loading it ----------------------

def _cfg(world_dir, **mia):
    from pipeline.evaluation.config import EvalConfig

    spec = {"holdout_split": "holdout10", "attacks": ["loss", "gradnorm", "reference"], "reference": "retain", **mia}
    return EvalConfig.from_params({"source": str(world_dir), "tofu_sets": ["forget"], "max_new_tokens": 4,
                                   "batch_size": 8, "mia": spec}, "evaluate")


@pytest.fixture(scope="module")
def evaluations(micro_model_dir, micro_world_dir, tmp_path_factory):
    """The retain model's evaluation (its own reference) and another model's against it (read from the cache)."""
    from pipeline.evaluation.evaluate import evaluate_model
    from tests.conftest import scaled_model_copy

    root = tmp_path_factory.mktemp("mia_ref")
    other = scaled_model_copy(micro_model_dir, root / "other_model")
    retain = evaluate_model(str(micro_model_dir), _cfg(micro_world_dir), root / "retain", root / "retain")
    summary = evaluate_model(str(other), _cfg(micro_world_dir), root / "other", root / "retain")
    return root, retain, other, summary


def _items(eval_dir, part):
    return pq.read_table(eval_dir / "items" / f"{part}.parquet").to_pylist()


def test_the_retain_model_is_its_own_reference(evaluations):
    root, retain, _, _ = evaluations
    assert retain["mia"]["reference"]["auc"] == 0.5 and retain["mia"]["reference"]["reference"] == "retain"
    assert retain["mia"]["reference"]["reference_model"] == retain["model"]
    assert retain["mia"]["gradnorm"]["p"] == 2
    assert retain["privleak_gradnorm"] == 0.0 and retain["privleak_reference"] == 0.0
    assert all(r["mia_reference"] == 0.0 for r in _items(root / "retain", "holdout"))
    ou = json.loads((root / "retain" / "TOFU_SUMMARY.json").read_text())
    assert ou["mia_gradnorm"] == pytest.approx(retain["mia_gradnorm_auc"], abs=1e-6) and ou["mia_reference"] == 0.5


def test_another_model_reads_the_retain_models_losses_and_privleak(evaluations):
    root, retain, _, summary = evaluations
    for part in ("forget", "holdout"):
        ours, theirs = _items(root / "other", part), _items(root / "retain", part)
        assert [r["mia_reference"] for r in ours] == pytest.approx(
            [o["mia_loss"] - t["mia_loss"] for o, t in zip(ours, theirs)], abs=1e-9)
    for attack in ("gradnorm", "reference"):
        entry = summary["mia"][attack]
        assert entry["retain_auc"] == retain["mia"][attack]["auc"]
        assert summary[f"privleak_{attack}"] == pytest.approx(privleak(entry["auc"], entry["retain_auc"]), abs=1e-3)


def test_a_retain_evaluation_without_an_attack_gives_it_no_privleak(evaluations, micro_world_dir, caplog):
    """The retain model ran loss, gradnorm and reference, not min_k: min_k gets no privleak here (a warning names it)
    and open-unlearning's privleak in the files takes its default retain AUC, 0.5; GradNorm's is against the
    retain model's."""
    from pipeline.evaluation.evaluate import evaluate_model

    root, retain, other, _ = evaluations
    with caplog.at_level(logging.WARNING, logger="pipeline.evaluation"):
        summary = evaluate_model(str(other), _cfg(micro_world_dir, attacks=["loss", "min_k", "gradnorm", "reference"]),
                                 root / "partial", root / "retain")
    assert "no membership-inference AUC of ['min_k']" in caplog.text
    assert "privleak" not in summary and "privleak" not in summary["mia"]["min_k"]
    assert summary["privleak_gradnorm"] == pytest.approx(
        privleak(summary["mia_gradnorm_auc"], retain["mia_gradnorm_auc"]), abs=1e-3)
    logs = json.loads((root / "partial" / "TOFU_EVAL.json").read_text())
    assert logs["privleak"]["agg_value"] == pytest.approx(privleak(logs["mia_min_k"]["agg_value"], 0.5))
    ou = json.loads((root / "partial" / "TOFU_SUMMARY.json").read_text())
    assert ou["mia_gradnorm"] == pytest.approx(summary["mia_gradnorm_auc"], abs=1e-6) and "mia_reference" in ou
    assert not any(k.startswith("privleak_") for k in ou)  # open-unlearning's privleak is Min-K%'s alone


def test_a_reference_model_loaded_gives_the_cached_scores(evaluations, micro_model_dir, micro_world_dir, caplog):
    from pipeline.evaluation.evaluate import evaluate_model

    root, _, other, summary = evaluations
    with caplog.at_level(logging.INFO, logger="pipeline.evaluation.mia_reference"):
        loaded = evaluate_model(str(other), _cfg(micro_world_dir, reference=str(micro_model_dir)), root / "loaded",
                                root / "retain")
    assert "loading the reference model" in caplog.text
    assert [r["mia_reference"] for r in _items(root / "loaded", "holdout")] == pytest.approx(
        [r["mia_reference"] for r in _items(root / "other", "holdout")], abs=1e-6)
    assert loaded["mia"]["reference"]["auc"] == summary["mia"]["reference"]["auc"]


def test_a_reference_that_scored_other_tokens_is_refused_before_the_model_loads(evaluations, micro_model_dir,
                                                                               micro_world_dir, monkeypatch):
    from pipeline.evaluation import evaluate

    root, _, _, _ = evaluations
    cfg = _cfg(micro_world_dir, reference=str(root / "retain"))
    # another template encodes the same questions to other tokens: refused once the tokenizer loads
    phi = cfg.__class__(**{**cfg.__dict__, "template": "phi"})
    monkeypatch.setattr(evaluate, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(DataError, match=r"forget.parquet: the reference model scored other forget tokens"):
        evaluate.evaluate_model(str(micro_model_dir), phi, root / "x", None)


def test_a_reference_evaluation_is_checked_before_any_model(evaluations, micro_world_dir, tmp_path):
    root, _, _, _ = evaluations
    copy = tmp_path / "ref"
    shutil.copytree(root / "retain", copy)
    forget = copy / "items" / "forget.parquet"
    table = pq.read_table(forget)
    meta = json.loads(table.schema.metadata[b"tokenunlearn"])
    hashes = {"forget": meta["questions_hash"],
              "holdout": json.loads(pq.read_schema(copy / "items" / "holdout.parquet").metadata[b"tokenunlearn"])
              ["questions_hash"]}
    assert resolve_reference(str(copy), None, False, hashes).kind == "cached"
    with pytest.raises(DataError, match=r"forget.parquet: the reference model was evaluated on other forget"):
        resolve_reference(str(copy), None, False, {**hashes, "forget": "0" * 16})
    pq.write_table(table.drop_columns(["mia_loss"]), forget)
    with pytest.raises(DataError, match=r"forget.parquet: no mia_loss column"):
        resolve_reference(str(copy), None, False, hashes)
    del meta[TOKENS_HASH]
    pq.write_table(table.replace_schema_metadata({b"tokenunlearn": json.dumps(meta).encode()}), forget)
    with pytest.raises(DataError, match=r"forget.parquet: no record of the tokens .*evaluate the reference model"):
        resolve_reference(str(copy), None, False, hashes)
    with pytest.raises(ParamError, match=r"retain reads the retain model's evaluation, and none is named"):
        resolve_reference("retain", None, False, hashes)
    with pytest.raises(ParamError, match=r"'nowhere/at/all' is neither retain"):
        resolve_reference("nowhere/at/all", None, False, hashes)


def test_the_retain_model_must_have_run_the_same_attack(evaluations, micro_world_dir):
    from pipeline.evaluation.inputs import load_inputs

    root, _, _, _ = evaluations
    with pytest.raises(DataError, match=r"mia.gradnorm.p is 2, here 1"):
        load_inputs(_cfg(micro_world_dir, p=1), root / "retain")
    with pytest.raises(DataError, match=r"mia.reference.reference_model is '.*model', here '.*other_model'"):
        load_inputs(_cfg(micro_world_dir, reference=str(root / "other")), root / "retain")


def test_mia_params(micro_world_dir):
    from pipeline.evaluation.config import EvalConfig

    spec = EvalConfig.from_params({"mia": {}}, "evaluate")
    assert spec.mia_spec is None
    default = EvalConfig.from_params({"mia": {"k": 0.4}}, "evaluate").mia_spec
    assert default.attacks == ["loss", "zlib", "min_k", "min_k_plus_plus"]  # gradnorm and reference by name only
    assert _cfg(micro_world_dir, p=math.inf).mia_spec.settings(None)["gradnorm"] == {"p": "inf"}
    with pytest.raises(ParamError, match=r"evaluate.mia.p"):
        _cfg(micro_world_dir, p=3)
    with pytest.raises(ParamError, match=r"evaluate.mia.reference=None: the reference attack needs"):
        _cfg(micro_world_dir, reference=None)
    with pytest.raises(ParamError, match=r"evaluate.mia.reference='retain'"):
        _cfg(micro_world_dir, attacks=["loss"])


def test_report_shows_both_privleaks(tmp_path):
    from pipeline.studies.report import load_rows, write_report

    metrics = tmp_path / "eval"
    metrics.mkdir()
    base = {"retain_es": 0.9, "forget_es": 0.3, "model_utility": 0.8, "log10_forget_quality": -1.0, "privleak": 0.0}
    for name, extra in {"target": {"privleak_gradnorm": -70.0}, "retain": {"privleak_gradnorm": 0.0},
                        "ga": {"privleak_gradnorm": -12.5, "privleak_reference": 4.25, "privleak_zlib": -3.0}}.items():
        (metrics / f"{name}.json").write_text(json.dumps({**base, **extra}))
    write_report(load_rows(metrics, {"ga": {"method": "ga", "weighting": "uniform"}}), tmp_path / "r", tmp_path / "p")
    robust = (tmp_path / "r" / "results.md").read_text().split("Is it forgotten")[1].splitlines()
    header = next(line for line in robust if line.startswith("| model"))
    assert "privleak, GradNorm (→0)" in header and "privleak, Reference (→0)" in header
    ga = next(line for line in robust if line.startswith("| GA |"))
    assert "| -12.500 | 4.250 |" in ga
    assert "zlib" not in header.lower() and "-3.000" not in ga  # checked in the summaries, not a column
