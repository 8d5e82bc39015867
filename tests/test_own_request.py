"""The worked example of docs/own-data.md, on the tiny model: 20 facts about one author forgotten by the CLI's
commands and by the Python API, which call the same functions and so make the same model; what the user gets
back (the model card, the before/after tables); and the API's own-data settings are configs/own-data.yaml's."""

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from pipeline.common.params import load_params

from tests.conftest import REPO, load_weights

FACTS = REPO / "docs" / "examples" / "varnholm_facts.jsonl"
pytestmark = pytest.mark.slow  # two tunings of 2 trials, two unlearning runs and four evaluations


def _settings(tmp_path: Path, micro_world_dir: Path, micro_model_dir: Path) -> list[str]:
    """The worked example's overrides for a quick run on the tiny model (the docs run the demo's target)."""
    return [f"data.source={tmp_path / 'own_data'}", f"data.retain={micro_world_dir / 'retain90.json'}",
            f"attribution.model={micro_model_dir}", f"reference.model={micro_model_dir}",
            f"unlearn.model={micro_model_dir}", "unlearn.train.epochs=1", "evaluate.max_new_tokens=16",
            "attribution.tagger=spacy", "tune.bisect.max_trials=2", "tune.bisect.probe_past=[]"]


def test_the_worked_example_by_the_cli_and_by_python_makes_the_same_model(tmp_path, micro_world_dir,
                                                                         micro_model_dir, monkeypatch):
    from stages.cli import run

    monkeypatch.chdir(REPO)  # the docs' relative paths
    sets = [a for s in _settings(tmp_path, micro_world_dir, micro_model_dir) for a in ("-S", s)]
    common = ["--overlay", "configs/own-data.yaml", *sets]
    cli = tmp_path / "cli"
    steps = [["own-data", *common],
             ["attribute", *common, "--out", str(cli / "attribution"), "--metrics", str(cli / "attribution.json")],
             ["reference", *common, "--out", str(cli / "reference"), "--metrics", str(cli / "reference.json")],
             ["evaluate", "target", *common, "--model", str(micro_model_dir), "--out", str(cli / "eval/before")],
             ["tune", "--run", "s_npo_ens", *common, "--shards", str(cli / "attribution"), "--reference",
              str(cli / "reference"), "--target-results", str(cli / "eval/before.json"), "--out", str(cli / "tuning")],
             ["unlearn", "s_npo_ens", *common, "--shards", str(cli / "attribution"), "--reference",
              str(cli / "reference"), "--lr-from", str(cli / "tuning/choice.json"), "--out", str(cli / "unlearn")],
             ["evaluate", "s_npo_ens", *common, "--model", str(cli / "unlearn/seed0/model"), "--out",
              str(cli / "eval/after")],
             ["export", "s_npo_ens", *common, "--model", str(cli / "unlearn/seed0/model"), "--before",
              str(cli / "eval/before"), "--after", str(cli / "eval/after"), "--out", str(cli / "export")]]
    for step in steps:
        assert run(step) == 0, step[0]

    # what the user gets back: save_pretrained's layout, the model card, every forget item before and after
    export = cli / "export"
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md"} <= {p.name for p in export.iterdir()}
    card = (export / "README.md").read_text()
    assert "docs/examples/varnholm_facts.jsonl` (20 pairs" in card and "method: `npo`, weighting: `soft`" in card
    assert "Not measured on this data: truth_ratio" in card and "tokenunlearn 0.1.0" in card
    forget = pq.read_table(export / "before_after" / "forget.parquet").to_pylist()
    facts = [json.loads(line) for line in FACTS.read_text().splitlines()]
    assert [r["question"] for r in forget] == [f["question"] for f in facts]
    assert all(0 <= r["probability_after"] <= 1 and isinstance(r["comes_out_after"], bool) for r in forget)
    assert len(pq.read_table(export / "before_after" / "retain.parquet")) == 15  # the micro world: 15, under 20

    # the same request from Python, on a model object and the facts as records
    from pipeline.api import ForgetRequest
    from pipeline.common.modeling import load_model, load_tokenizer

    params = load_params("params.yaml", [], [s for s in _settings(tmp_path, micro_world_dir, micro_model_dir)
                                             if not s.startswith("data.source")])
    request = ForgetRequest(load_model(micro_model_dir), load_tokenizer(micro_model_dir), params=params,
                            work_dir=tmp_path / "api")
    manifest = request.prepare(forget=facts, retain=micro_world_dir / "retain90.json")
    assert manifest["sets"]["forget"]["rows"] == 20
    scores = request.attribute()
    assert scores["sample_id"].nunique() == 20 and {"delta", "entropy", "phi"} <= set(scores.columns)
    lr = request.tune("s_npo_ens")  # the CLI's tune on the same functions: the same trials, the same rate
    cli_choice = json.loads((cli / "tuning" / "choice.json").read_text())["runs"]["s_npo_ens"]
    assert lr == cli_choice["chosen"]["lr"] and len(cli_choice["trials"]) == 2
    unlearned = request.unlearn("s_npo_ens")
    assert type(unlearned).__name__ == "LlamaForCausalLM"
    summary = request.evaluate()
    assert 0 <= summary["forget_es"] <= 1 and "model_utility" in summary["skipped"]
    request.export(tmp_path / "api" / "export")
    assert (tmp_path / "api" / "export" / "README.md").is_file()
    # the evaluation during training, on the plain splits: forget and retain ES, the same rows by both roads
    watched = (cli / "unlearn.monitor" / "seed0.csv").read_text()
    assert watched.splitlines()[0] == "step,eval_forget_es,eval_retain_es,eval_retain_probability,eval_retain_rouge"
    assert (tmp_path / "api" / "monitor" / "s_npo_ens" / "seed0.csv").read_text() == watched
    # the same functions on the same inputs: the same weights as the CLI's
    cli_weights, api_weights = load_weights(cli / "unlearn/seed0/model"), load_weights(request.unlearned)
    assert cli_weights.keys() == api_weights.keys()
    assert all((cli_weights[k] == api_weights[k]).all() for k in cli_weights)
    # a new kernel on the same work_dir and data: unlearn trains at the rate tuned before, as `--lr-from` reads it
    again = ForgetRequest(str(micro_model_dir), params=params, work_dir=tmp_path / "api")
    again.prepare(forget=facts, retain=micro_world_dir / "retain90.json")
    again.unlearn("s_npo_ens")
    assert again.tuned == {"s_npo_ens": lr}
    assert all((load_weights(again.unlearned)[k] == cli_weights[k]).all() for k in cli_weights)
    # other data: what was made from the last is cleared, so nothing stale is read
    again.prepare(forget=facts[:10], retain=micro_world_dir / "retain90.json")
    assert not (tmp_path / "api" / "tuning").exists() and not (tmp_path / "api" / "eval").exists()


def test_the_apis_own_data_settings_are_the_overlays():
    from pipeline.api import OWN_DATA

    overlay = yaml.safe_load((REPO / "configs" / "own-data.yaml").read_text())
    overlay.pop("data")  # the files: the API takes them as arguments
    assert overlay == OWN_DATA


def _biographies(world_dir: Path) -> dict[str, list[dict]]:
    """The world's biography passages as a passage request: the forget10 authors' to forget, the other trained
    authors' to keep, the holdout authors' (never trained on) for membership inference."""
    rows = [json.loads(line) for line in (world_dir / "biographies.json").read_text().splitlines()]
    return {"forget": [{"text": r["text"]} for r in rows if "forget10" in r["forget_splits"]],
            "retain": [{"text": r["text"]} for r in rows if r["group"] == "trained" and not r["forget_splits"]],
            "holdout": [{"text": r["text"]} for r in rows if r["group"] == "holdout"]}


def test_a_passage_request_by_the_cli_and_by_python(tmp_path, micro_world_dir, micro_model_dir, monkeypatch):
    """Documents to forget: stage one in corpus mode, the retain term on the kept passages, and an evaluation of
    verbatim memorization (each passage's first part prompting its rest) with membership inference against the
    holdout passages; the CLI (over configs/own-passages.yaml) and the API make the same model."""
    from stages.cli import run

    monkeypatch.chdir(REPO)
    sets = _biographies(micro_world_dir)
    files = {}
    for name, rows in sets.items():
        files[name] = tmp_path / "input" / f"{name}.jsonl"
        files[name].parent.mkdir(exist_ok=True)
        files[name].write_text("".join(json.dumps(r) + "\n" for r in rows))
    source = tmp_path / "own_data"
    settings = [s for s in _settings(tmp_path, micro_world_dir, micro_model_dir) if not s.startswith("data.")]
    settings += [f"data.source={source}", *(f"data.{n}={f}" for n, f in files.items()),
                 f"attribution.corpus={source}/forget_corpus.jsonl", f"reference.corpus={source}/retain_corpus.jsonl",
                 f"unlearn.defaults.retain_corpus={source}/retain_corpus.jsonl", "evaluate.mia.attacks=[loss,min_k]"]
    common = ["--overlay", "configs/own-data.yaml", "--overlay", "configs/own-passages.yaml",
              *[a for s in settings for a in ("-S", s)]]
    cli = tmp_path / "cli"
    steps = [["own-data", *common],
             ["attribute", *common, "--out", str(cli / "attribution"), "--metrics", str(cli / "attribution.json")],
             ["reference", *common, "--out", str(cli / "reference"), "--metrics", str(cli / "reference.json")],
             ["unlearn", "s_npo_ens", *common, "--shards", str(cli / "attribution"), "--reference",
              str(cli / "reference"), "--out", str(cli / "unlearn")],
             ["evaluate", "s_npo_ens", *common, "--model", str(cli / "unlearn/seed0/model"), "--out",
              str(cli / "eval/after")]]
    for step in steps:
        assert run(step) == 0, step[0]

    # the probes: each forget passage is its first part and its rest, verbatim
    probes = [json.loads(line) for line in (source / "forget.json").read_text().splitlines()]
    assert [p["question"] + p["answer"] for p in probes] == [r["text"] for r in sets["forget"]]
    attribution = json.loads((cli / "attribution.json").read_text())
    assert attribution["config"]["mode"] == "corpus" and attribution["samples"] == len(sets["forget"])
    summary = json.loads((cli / "eval/after/metrics.json").read_text())
    assert 0 <= summary["forget_es"] <= 1 and 0 <= summary["retain_es"] <= 1
    assert 0 <= summary["mia"]["min_k"]["auc"] <= 1  # forget passages against the holdout ones
    assert "truth_ratio" in summary["skipped"]

    from pipeline.api import ForgetRequest
    from pipeline.common.modeling import load_model, load_tokenizer

    params = load_params("params.yaml", [], [s for s in _settings(tmp_path, micro_world_dir, micro_model_dir)
                                             if not s.startswith("data.")]
                         + ["evaluate.mia={holdout_split: holdout, attacks: [loss, min_k]}"])
    request = ForgetRequest(load_model(micro_model_dir), load_tokenizer(micro_model_dir), params=params,
                            work_dir=tmp_path / "api")
    request.prepare(**sets)
    assert request.params["attribution"]["mode"] == "corpus" and request.params["evaluate"]["mia"]["holdout_split"]
    request.attribute()
    request.unlearn("s_npo_ens")
    cli_weights, api_weights = load_weights(cli / "unlearn/seed0/model"), load_weights(request.unlearned)
    assert all((cli_weights[k] == api_weights[k]).all() for k in cli_weights)


def test_the_apis_passage_settings_are_the_overlays():
    from pipeline.api import HOLDOUT, passage_settings
    from pipeline.common.params import apply_overlay

    overlay = yaml.safe_load((REPO / "configs" / "own-passages.yaml").read_text())
    for name in ("forget", "retain", "holdout"):  # the files: the API takes them as arguments
        overlay["data"].pop(name)
    assert overlay == apply_overlay(passage_settings("artifacts/own_data"), HOLDOUT)
