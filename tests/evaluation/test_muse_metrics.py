"""MUSE's metrics: each formula on a hand-computed case, the token-level pieces against a direct computation on the
tiny model, and `world-muse` then `evaluate-muse` end to end (a retain model, then another model against it)."""

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from pipeline.common.errors import DataError, ParamError
from pipeline.data.muse import QAPair
from pipeline.evaluation import muse


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# ---- formulas -----------------------------------------------------------------------------------------------

def test_the_knowmem_prompt_is_muses_few_shot_format():
    shots = [QAPair("Who?", "Ann"), QAPair("Where?", "Oslo")]
    assert muse.knowmem_prompt(shots, "When?") == \
        "Question: Who?\nAnswer: Ann\n\nQuestion: Where?\nAnswer: Oslo\n\nQuestion: When?\nAnswer: "
    assert muse.knowmem_prompt([], "When?") == "Question: When?\nAnswer: "


def test_an_answer_is_cut_at_each_stop_in_turn():
    assert muse.cut_at_stops("Paris\n\nQuestion: and?") == "Paris"
    assert muse.cut_at_stops("Paris\nQuestion: and?") == "Paris"
    assert muse.cut_at_stops("Question: and?") == ""
    # "\n\n" first, then "\nQuestion", then "Question:": what is left before the last
    assert muse.cut_at_stops("a Question: b\n\nc") == "a "


def test_rouge_l_f1_is_muses_unstemmed_lcs_f_measure():
    # LCS 3 of 3 generated and 6 reference words: P = 1, R = 1/2, F1 = 2PR / (P + R) = 2/3
    scores = muse.rouge("the cat sat", "the cat sat on the mat")
    assert scores["rougeL_f1"] == pytest.approx(2 / 3) and scores["rougeL_recall"] == pytest.approx(0.5)
    assert scores["rouge1_f1"] == pytest.approx(2 / 3)
    # MUSE does not stem; open-unlearning does (its ROUGE is tofu_metrics')
    assert muse.rouge("cats running", "cat run")["rougeL_f1"] == 0.0
    assert muse.rouge("cats running", "cat run", stemmer=True)["rougeL_f1"] == 1.0
    from pipeline.evaluation.tofu_metrics import rouge_scores

    assert muse.rouge("the cats sat down", "a cat sits", stemmer=True)["rougeL_f1"] == \
        rouge_scores("the cats sat down", "a cat sits")["rougeL_f1"]
    assert muse.percent_mean([0.5, 1.0]) == 75.0


def test_the_auc_is_muses_orientation_and_privleak_its_relative_change():
    # Min-K% is loss-like. MUSE's AUC: the share of (forget, holdout) pairs whose holdout text scores lower:
    # of (1, 3), (1, 1.5), (2, 3), (2, 1.5) only the last, 1/4; a tie counts one half
    assert muse.muse_auc([1.0, 2.0], [3.0, 1.5]) == 0.25
    assert muse.muse_auc([1.0], [1.0]) == 0.5
    assert muse.muse_auc([1.0, 1.0], [5.0, 6.0]) == 0.0  # a model that knows its forget texts
    assert muse.privleak(0.1, 0.5) == pytest.approx(-80.0)  # (0.1 − 0.5) / 0.5 · 100
    assert muse.privleak(0.6, 0.4) == pytest.approx(50.0)   # over-unlearning: positive
    assert muse.privleak(0.3, 0.0) is None
    # open-unlearning's privleak takes 1 − its AUC (labelled the other way round): the same number, up to 1e-10
    from pipeline.evaluation.mia import auc, privleak

    forget, holdout, retain_f, retain_h = [0.5, 2.0, 1.0], [3.0, 0.7], [1.0, 2.0], [1.5, 3.0]
    ours = muse.privleak(muse.muse_auc(forget, holdout), muse.muse_auc(retain_f, retain_h))
    assert ours == pytest.approx(privleak(auc(forget, holdout), auc(retain_f, retain_h)), abs=1e-6)


def test_settings_are_checked():
    with pytest.raises(ParamError, match="verbmem_max_new_tokens=0: must be a positive integer"):
        muse.MuseSettings(verbmem_max_new_tokens=0)
    with pytest.raises(ParamError, match=r"k=0: Min-K%'s fraction must be in \(0, 1\]"):
        muse.MuseSettings(k=0)
    with pytest.raises(ParamError, match="attack='loss': PrivLeak reads one of"):
        muse.MuseSettings(attack="loss")


# ---- the model's side ---------------------------------------------------------------------------------------

def test_the_verbmem_reference_is_gt_cut_to_max_new_tokens_ids_bos_included(micro_tokenizer):
    gt = "was born in a small town and wrote many books about the sea."
    ids = micro_tokenizer(gt)["input_ids"]
    assert ids[0] == micro_tokenizer.bos_token_id and len(ids) > 5
    assert muse.verbmem_reference(micro_tokenizer, gt, 5) == micro_tokenizer.decode(ids[1:5])  # BOS + 4 tokens
    assert muse.verbmem_reference(micro_tokenizer, gt, 1000) == gt


def test_min_k_reads_muses_tokens_every_token_after_the_first(micro_model_dir, micro_tokenizer):
    from pipeline.common.modeling import load_model

    model = load_model(micro_model_dir).eval()
    texts = ["The author came into the world on March 3, 1950.", "Short one.", "A third passage, of some length."]
    got = muse.privleak_scores(model, micro_tokenizer, texts, 0.4, batch_size=2, desc="test")
    for i, text in enumerate(texts):  # MUSE's compute_ppl: log p of input_ids[1:], Min-40%: int(n · 0.4) lowest
        ids = torch.tensor([micro_tokenizer(text)["input_ids"]])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
        token_logp = logp.gather(1, ids[0, 1:, None])[:, 0].double().numpy()
        lowest = np.sort(token_logp)[: max(1, int(len(token_logp) * 0.4))]
        assert got["min_k"][i] == pytest.approx(-lowest.mean(), abs=1e-5)


# ---- end to end ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def world_muse(micro_world_dir, tmp_path_factory):
    from stages.cli import run

    out = tmp_path_factory.mktemp("muse") / "world_muse"
    assert run(["world-muse", "--world", str(micro_world_dir), "--icl", "1", "--out", str(out)]) == 0
    return out


SMALL = ["--verbmem-max-new-tokens", "8", "--knowmem-max-new-tokens", "24", "--batch-size", "4"]


@pytest.fixture(scope="module")
def retain_eval(world_muse, micro_model_dir):
    """The untrained tiny model as the retain model: its own reference (`--retain-results` is its `--out`)."""
    from stages.cli import run

    out = world_muse.parent / "retain"
    assert run(["evaluate-muse", "retain", "--model", str(micro_model_dir), "--source", str(world_muse),
                "--out", str(out), "--retain-results", str(out), *SMALL]) == 0
    return out, json.loads((out / "metrics.json").read_text())


def _memorizing_model(base_dir, tokenizer, texts, out, steps=60):
    """The tiny model trained on `texts` until it repeats them: a target model that knows its forget set."""
    from pipeline.common.modeling import load_model, save_model

    torch.manual_seed(0)
    model = load_model(base_dir)
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        model(**batch, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    save_model(model, tokenizer, out)
    return out


def test_evaluate_muse_end_to_end(world_muse, retain_eval, micro_model_dir, micro_tokenizer, micro_tokenizer_dir,
                                  tmp_path):
    """A model trained on the forget biographies and the forget questions (in MUSE's prompt), against the untrained
    model as the retain model: it repeats the forget excerpts, answers forget questions better than retain ones,
    and its forget texts stand out (AUC 0, PrivLeak below 0)."""
    from pipeline.data.muse import load_eval_sets
    from stages.cli import run

    retain_out, retain = retain_eval
    sets = load_eval_sets(world_muse)
    qa = [muse.knowmem_prompt(sets.knowmem_forget_icl, p.question) + p.answer + "\n\n" for p in sets.knowmem_forget]
    target = _memorizing_model(micro_model_dir, micro_tokenizer, sets.privleak_forget + qa, tmp_path / "target")
    out = tmp_path / "target_eval"
    assert run(["evaluate-muse", "target", "--model", str(target), "--tokenizer", str(micro_tokenizer_dir),
                "--source", str(world_muse), "--out", str(out), "--retain-results", str(retain_out),
                "--metrics", str(tmp_path / "target.json"), *SMALL]) == 0
    summary = json.loads((out / "metrics.json").read_text())
    assert json.loads((tmp_path / "target.json").read_text()) == summary
    assert summary["tokenizer"] == str(micro_tokenizer_dir)

    items = {name: pq.read_table(out / "items" / f"{name}.parquet").to_pylist()
             for name in ("verbmem", "knowmem_forget", "knowmem_retain", "privleak_forget", "privleak_holdout")}
    assert [r["prompt"] for r in items["verbmem"]] == [v.prompt for v in sets.verbmem]
    assert [r["question"] for r in items["knowmem_retain"]] == [p.question for p in sets.knowmem_retain]
    for name, key in (("verbmem", "verbmem_f"), ("knowmem_forget", "knowmem_f"), ("knowmem_retain", "knowmem_r")):
        reference = "reference" if name == "verbmem" else "answer"
        for r in items[name]:  # each item's ROUGE is its generation's against its reference
            assert r["rougeL_f1"] == muse.rouge(r["generation"], r[reference])["rougeL_f1"]
            assert not any(stop in r["generation"] for stop in muse.KNOWMEM_STOPS)
        assert summary[key] == pytest.approx(100 * np.mean([r["rougeL_f1"] for r in items[name]]), abs=1e-6)
    assert summary["verbmem_f"] > 50 and summary["knowmem_f"] > summary["knowmem_r"]
    assert summary["utility_preserved"] == summary["knowmem_r"]
    for attack in muse.PRIVLEAK_ATTACKS:
        auc = muse.muse_auc([r[attack] for r in items["privleak_forget"]],
                            [r[attack] for r in items["privleak_holdout"]])
        assert summary["auc"][attack] == pytest.approx(auc, abs=1e-6) and auc == 0.0
        assert summary["retain_auc"][attack] == retain["auc"][attack] > 0
    assert summary["privleak"] == pytest.approx(muse.privleak(0.0, retain["auc"]["min_k"])) and summary["privleak"] < 0
    assert summary["definitions"]["verbmem_max_new_tokens"] == 8 and summary["definitions"]["n_icl"] == [1, 1]


def test_the_retain_models_auc_is_only_read_for_the_same_texts_and_k(world_muse, retain_eval, micro_model_dir,
                                                                      tmp_path):
    from stages.cli import run

    retain_out, data = retain_eval
    settings = muse.MuseSettings(k=0.2)
    with pytest.raises(DataError, match="the retain model's Min-K% k is 0.4, here 0.2"):
        muse.load_retain_auc(retain_out, data["privleak_data"], settings)
    with pytest.raises(DataError, match="evaluated on other privleak texts"):
        muse.load_retain_auc(retain_out / "metrics.json", "0" * 16, muse.MuseSettings())
    with pytest.raises(DataError, match="no evaluate-muse output of the retain model"):
        muse.load_retain_auc(tmp_path / "nothing", data["privleak_data"], muse.MuseSettings())
    # a published AUC instead of an evaluation: PrivLeak of the retain model against MUSE's News retrain
    out = tmp_path / "published"
    assert run(["evaluate-muse", "m", "--model", str(micro_model_dir), "--source", str(world_muse), "--out", str(out),
                "--retain-auc", "0.4772", *SMALL]) == 0
    summary = json.loads((out / "metrics.json").read_text())
    assert summary["privleak"] == pytest.approx(muse.privleak(summary["auc"]["min_k"], 0.4772), abs=1e-5)
    assert summary["privleak_min_k_plus_plus"] is None  # a published AUC is of Min-K% only
    with pytest.raises(ParamError, match="give the retain model's evaluation or its AUC, not both"):
        muse.load_muse_inputs(str(world_muse), muse.MuseSettings(), retain_out, False, 0.5)


def test_evaluate_with_muses_evaluator_is_evaluate_muse(world_muse, retain_eval, micro_model_dir, tmp_path, capsys):
    """`evaluate` with evaluate.muse (params) writes what `evaluate-muse` (options) does, byte for byte; the
    TOFU sets and MUSE in one evaluation are refused before any work, each setting named; `report --benchmark muse`
    is `muse-report`."""
    from stages.cli import run

    retain_out, _ = retain_eval
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"evaluate": {
        "tofu_sets": [], "multiple_choice": None, "muse": {
            "source": str(world_muse), "verbmem_max_new_tokens": 8, "knowmem_max_new_tokens": 24, "batch_size": 4}}}))
    by_params, by_options = tmp_path / "by_params", tmp_path / "by_options"
    assert run(["evaluate", "m", "--params", str(params), "--model", str(micro_model_dir), "--out", str(by_params),
                "--retain-results", str(retain_out)]) == 0
    assert run(["evaluate-muse", "m", "--model", str(micro_model_dir), "--source", str(world_muse),
                "--out", str(by_options), "--retain-results", str(retain_out), *SMALL]) == 0
    files = sorted(f.relative_to(by_options) for f in by_options.rglob("*") if f.is_file())
    assert files == sorted(f.relative_to(by_params) for f in by_params.rglob("*") if f.is_file())
    assert len(files) == 6 and all((by_params / f).read_bytes() == (by_options / f).read_bytes() for f in files)

    capsys.readouterr()
    assert run(["evaluate", "m", "--params", str(params), "--model", str(micro_model_dir), "--out", str(tmp_path / "x"),
                "-S", "evaluate.tofu_sets=[forget]", "-S", "evaluate.paraphrase=true"]) == 2
    assert "evaluate.muse: MUSE is evaluated on its own, and evaluate.tofu_sets is on too: switch off " \
           "evaluate.tofu_sets, evaluate.paraphrase" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()

    for name in ("target", "retain", "npo"):  # a table of three MUSE evaluations, made by the two commands
        (tmp_path / "evals" / name).mkdir(parents=True)
        (tmp_path / "evals" / name / "metrics.json").write_bytes((by_params / "metrics.json").read_bytes())
    report_params = tmp_path / "report.yaml"
    report_params.write_text(yaml.safe_dump({"unlearn": {"runs": {"npo": {"method": "npo", "weighting": "uniform"}}},
                                             "report": {"table": ["npo"]}}))
    for command, out in ((["report", "--benchmark", "muse"], "a"), (["muse-report"], "b")):
        assert run([*command, "--params", str(report_params), "--eval-dir", str(tmp_path / "evals"),
                    "--out", str(tmp_path / out)]) == 0
    assert (tmp_path / "a" / "results.md").read_text() == (tmp_path / "b" / "results.md").read_text()
    assert "| NPO | npo |" in (tmp_path / "a" / "results.md").read_text()
