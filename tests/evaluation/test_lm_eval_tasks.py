"""`evaluate.lm_eval`: lm-eval's own tasks in an evaluation. Its params and its summary keys are checked on
hand-written lm-eval output (no lm-eval needed); then the project's WMDP scorer and lm-eval, running a local task
(lm-eval's own wmdp_bio YAML pointed at a JSON Lines file of the same items), give the same accuracy, the same
stderr and, item by item, the same choice and log-likelihoods on a tiny random model saved to disk. That part needs
lm-eval 0.4.13 (tests/lm_eval_site.py: installed once into `.cache/`, never into the venv; skipped where it cannot
be installed) and runs the evaluation in a subprocess with it on PYTHONPATH, offline."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest

from pipeline.common.errors import ParamError
from pipeline.common.modeling import build_model, save_model
from pipeline.evaluation import lm_eval_tasks
from pipeline.evaluation.config import EvalConfig
from pipeline.evaluation.lm_eval_tasks import LMEvalSpec, flat_metrics

from tests.conftest import REPO, cli_env
from tests.lm_eval_site import OFFLINE, lm_eval_site


def _cfg(spec) -> EvalConfig:
    return EvalConfig.from_params({"tofu_sets": [], "lm_eval": spec}, "evaluate")


def test_off_by_default_and_checked_key_by_key():
    assert EvalConfig().lm_eval_spec is None and _cfg(None).lm_eval_spec is None
    spec = _cfg({"tasks": ["gsm8k", "mmlu"], "num_fewshot": 5, "limit": 0.1, "batch_size": "auto",
                 "include_path": "tasks"}).lm_eval_spec
    assert spec.tasks == ["gsm8k", "mmlu"] and spec.limit == 0.1 and spec.batch_size == "auto"
    assert spec.include_paths == (str(Path("tasks").resolve()),)  # relative to the working directory
    for bad, message in [({"tasks": []}, r"evaluate\.lm_eval\.tasks=\[\]: expected a non-empty list"),
                         ({"tasks": ["a", "a"]}, r"tasks=\['a', 'a'\]: expected a non-empty list of distinct"),
                         ({"tasks": ["a"], "num_fewshot": -1}, r"evaluate\.lm_eval\.num_fewshot=-1: must be null"),
                         ({"tasks": ["a"], "limit": 1.5}, r"limit=1\.5: must be null, a count of at least 1 or a "
                                                          r"fraction in \(0, 1\)"),
                         ({"tasks": ["a"], "batch_size": "big"}, r"batch_size='big': must be null, at least 1 or"),
                         ({"tasks": ["a"], "include_path": [3]}, r"include_path=\[3\]: expected a directory"),
                         ({"tasks": ["a"], "fewshot": 5}, r"evaluate\.lm_eval\.fewshot: unknown parameter")]:
        with pytest.raises(ParamError, match=message):
            _cfg(bad)


def test_without_lm_eval_the_error_names_the_param_and_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` raises ImportError, as where it is absent
    with pytest.raises(ParamError, match=r"^evaluate\.lm_eval: needs lm-evaluation-harness, which is not installed "
                                         r".*pip install -e '\.\[lmeval\]'` \(lm-eval\[hf\]==0\.4\.13\)"):
        lm_eval_tasks.task_manager(LMEvalSpec(tasks=["gsm8k"]))


def test_pyproject_pins_the_tested_lm_eval_in_the_extra():
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras[lm_eval_tasks.EXTRA] == [f"lm-eval[hf]=={lm_eval_tasks.TESTED_VERSION}"]


def _entry(**cfg):
    return SimpleNamespace(cfg=cfg)


def test_the_include_path_alone_serves_when_it_holds_every_task_a_group_names():
    index = {"g": _entry(group="g", task=["a", "h", {"task": "inline"}]), "h": _entry(group="h", task=["b"]),
             "a": _entry(task="a"), "b": _entry(task="b")}
    assert lm_eval_tasks._self_contained(index, ["g"]) and lm_eval_tasks._self_contained(index, ["a", "b"])
    del index["b"]  # h names a task the folder lacks (a built-in one, say): lm-eval's own index is needed
    assert not lm_eval_tasks._self_contained(index, ["g"]) and not lm_eval_tasks._self_contained(index, ["gsm8k"])


def test_unknown_tasks_and_include_paths_are_named(monkeypatch, tmp_path):
    manager = SimpleNamespace(task_index={"gsm8k": _entry(task="gsm8k")}, all_tasks=["gsm8k", "mmlu"])
    monkeypatch.setattr(lm_eval_tasks, "_lm_eval", lambda: None)  # as if installed
    monkeypatch.setattr(lm_eval_tasks, "_task_manager", lambda paths, defaults: manager)
    with pytest.raises(ParamError, match=r"evaluate\.lm_eval\.tasks: \['gsm8kk', 'zzz'\] are not lm-eval tasks, "
                                         r"groups or tags \(gsm8kk: did you mean gsm8k\?; `lm-eval ls tasks`"):
        lm_eval_tasks.task_manager(LMEvalSpec(tasks=["gsm8k", "gsm8kk", "zzz"]))
    with pytest.raises(ParamError, match=r"evaluate\.lm_eval\.include_path: \[.*nowhere'\] is not a directory"):
        lm_eval_tasks.task_manager(LMEvalSpec(tasks=["gsm8k"], include_path=str(tmp_path / "nowhere")))
    assert lm_eval_tasks.task_manager(LMEvalSpec(tasks=["gsm8k"], include_path=str(tmp_path))) is manager


# lm-eval 0.4.13's output for [gsm8k, mmlu] (cut down): groups hold subtasks; filters; "N/A" and NaN stderrs.
OUTPUT = {
    "results": {
        "gsm8k": {"alias": "gsm8k", "exact_match,strict-match": 0.25, "exact_match_stderr,strict-match": 0.125,
                  "exact_match,flexible-extract": 0.5, "exact_match_stderr,flexible-extract": "N/A"},
        "mmlu": {"alias": "mmlu", "acc,none": 0.4, "acc_stderr,none": 0.01, "sample_len": 3},
        "mmlu_humanities": {"alias": " - humanities", "acc,none": 0.3, "acc_stderr,none": 0.02},
        "mmlu_anatomy": {"alias": "  - anatomy", "acc,none": 0.5, "acc_stderr,none": float("nan")},
    },
    "group_subtasks": {"mmlu": ["mmlu_humanities"], "mmlu_humanities": ["mmlu_anatomy"]},
}


def test_summary_keys_are_the_top_level_tasks_metrics_filters_and_stderrs():
    assert lm_eval_tasks.top_level(OUTPUT) == ["gsm8k", "mmlu"]
    assert flat_metrics(OUTPUT) == {
        "lmeval_gsm8k_exact_match_strict_match": 0.25, "lmeval_gsm8k_exact_match_strict_match_stderr": 0.125,
        "lmeval_gsm8k_exact_match_flexible_extract": 0.5,  # its "N/A" stderr left out
        "lmeval_mmlu_acc": 0.4, "lmeval_mmlu_acc_stderr": 0.01}
    tag = {"results": {"wmdp_bio": {"acc,none": 0.3}, "wmdp_chem": {"acc,none": 0.2}}, "group_subtasks": {}}
    assert flat_metrics(tag) == {"lmeval_wmdp_bio_acc": 0.3, "lmeval_wmdp_chem_acc": 0.2}  # a tag: its tasks
    clash = {"results": {"a_b": {"c,none": 1.0}, "a": {"b_c,none": 0.0}}, "group_subtasks": {}}
    with pytest.raises(ParamError, match=r"would both be the summary's lmeval_a_b_c"):
        flat_metrics(clash)


def test_the_report_shows_the_lmeval_columns():
    from pipeline.studies.report import Row, check_summary, results_table

    summary = {"forget_es": 0.5, "mc_bio": 0.25, "lmeval_gsm8k_exact_match_strict_match": 0.125,
               "lmeval_gsm8k_exact_match_strict_match_stderr": 0.1, "seeds": [0]}
    markdown, table = results_table([Row("target", "before unlearning", "", "", check_summary(summary, "x.json"))])
    assert markdown.splitlines()[0].endswith("| bio acc | lm-eval gsm8k_exact_match_strict_match |")
    assert markdown.splitlines()[2].endswith("| 0.250 | 0.125 |")
    assert "lmeval_gsm8k_exact_match_strict_match,lmeval_gsm8k_exact_match_strict_match_std" in table
    with pytest.raises(Exception, match=r"x\.json: lmeval_gsm8k_exact_match_strict_match"):
        check_summary({"lmeval_gsm8k_exact_match_strict_match": float("nan")}, "x.json")


# ---- the project's scorer against lm-eval, on the same items ----------------------------------------------------

WORDS = "cell virus gene port key acid salt heat code host file node wall base DNA RNA gas ion".split()


def _items(n: int = 16) -> list[dict]:
    rng = random.Random(1)
    return [{"question": f"Which {rng.choice(WORDS)} binds the {rng.choice(WORDS)} of the {rng.choice(WORDS)}?",
             "choices": [" ".join(rng.sample(WORDS, 2)) for _ in range(4)], "answer": k % 4} for k in range(n)]


# The evaluation of the test's subprocess: lm-eval on its PYTHONPATH, as if the extra were installed.
EVALUATE = r"""
import json, logging, sys
from pathlib import Path
from types import SimpleNamespace
logging.basicConfig(level=logging.INFO)
from pipeline.evaluation.config import EvalConfig
from pipeline.evaluation.evaluate import evaluate_path
job = json.load(sys.stdin)
evaluate_path(job["model"], EvalConfig.from_params(job["cfg"], "evaluate"), Path(job["out"]), None)
"""


@pytest.fixture(scope="module")
def evaluated(micro_tokenizer, tmp_path_factory):
    """A tiny random Llama (large init, so the letters depend on the context) evaluated on 16 items by the project's
    letter scoring and by lm-eval's wmdp_bio YAML over the same file (the test's task includes it)."""
    site = lm_eval_site()
    tmp = tmp_path_factory.mktemp("lm_eval_tasks")
    config = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 4, "max_position_embeddings": 256, "initializer_range": 0.5}
    save_model(build_model(config, micro_tokenizer, seed=0), micro_tokenizer, tmp / "model")
    items = tmp / "bio.jsonl"
    items.write_text("".join(json.dumps(r) + "\n" for r in _items()))
    (tmp / "tasks").mkdir()
    harness_bio = site / "lm_eval" / "tasks" / "wmdp" / "wmdp_bio.yaml"  # its prompt, choices, metric: unchanged
    (tmp / "tasks" / "local_bio.yaml").write_text(textwrap.dedent(f"""\
        include: {harness_bio}
        task: local_bio
        dataset_path: json
        dataset_name: null
        dataset_kwargs:
          data_files:
            test: {items}
        """))
    # cloze: the same items, each choice the continuation of the question and a stem, scored by the project's cloze
    # scoring and by experiments/lmeval's task YAML (its prompt, continuation and acc_norm: unchanged)
    cloze = tmp / "cloze.jsonl"
    cloze.write_text("".join(json.dumps({**r, "stem": "Its name is "}) + "\n" for r in _items()))
    (tmp / "tasks" / "local_cloze.yaml").write_text(textwrap.dedent(f"""\
        include: {REPO / "experiments" / "lmeval" / "tasks" / "world_forget_cloze.yaml"}
        task: local_cloze
        dataset_kwargs:
          data_files:
            test: {cloze}
        """))
    cfg = {"source": str(tmp / "no_world"), "tofu_sets": [],
           "multiple_choice": {"bio": {"format": "wmdp", "source": str(items), "subject": "biology"},
                               "cloze": {"format": "wmdp", "source": str(cloze), "subject": "biology",
                                         "scoring": "cloze"}},
           "lm_eval": {"tasks": ["local_bio", "local_cloze"], "include_path": str(tmp / "tasks"), "batch_size": 5}}
    job = {"model": str(tmp / "model"), "cfg": cfg, "out": str(tmp / "eval")}
    env = {**cli_env(), **OFFLINE, "PYTHONPATH": f"{REPO}:{site}", "HF_HOME": str(tmp / "hf"),
           "TOKENIZERS_PARALLELISM": "false"}
    res = subprocess.run([sys.executable, "-c", EVALUATE], input=json.dumps(job), capture_output=True, text=True,
                         env=env, cwd=tmp, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return tmp / "eval", res.stderr


def _items_of_both(out, name: str) -> tuple[list[dict], dict[int, dict]]:
    """Set `name`'s items as the project scored them (mc/NAME.parquet) and lm-eval's samples of task local_NAME,
    by item index."""
    ours = pq.read_table(out / "mc" / f"{name}.parquet").to_pylist()
    theirs = {r["doc_id"]: r for r in map(json.loads, (out / "lm_eval" / f"samples_local_{name}.jsonl").open())}
    return ours, theirs


@pytest.mark.slow
def test_the_project_scorer_and_lm_eval_agree_on_the_same_items(evaluated):
    out, log_text = evaluated
    summary = json.loads((out / "metrics.json").read_text())
    ours, theirs = _items_of_both(out, "bio")
    assert len(ours) == len(theirs) == 16
    correct = [float(r["correct"]) for r in ours]
    assert 0 < sum(correct) < 16 and len({r["predicted"] for r in ours}) > 1  # a test that can fail
    for r in ours:  # item by item: the same choice, the same log-likelihood of each letter
        lls = [ll for ll, _greedy in theirs[r["index"]]["filtered_resps"]]
        assert max(range(4), key=lls.__getitem__) == r["predicted"], r["index"]
        assert max(abs(a - b) for a, b in zip(lls, r["logprobs"])) <= 1e-4, r["index"]
        assert theirs[r["index"]]["acc"] == float(r["correct"])
    acc = sum(correct) / 16
    assert summary["mc_bio"] == pytest.approx(acc, abs=1e-6)
    assert summary["lmeval_local_bio_acc"] == pytest.approx(acc, abs=1e-6)  # the summary's 6 digits
    # lm-eval's stderr of a mean: the sample standard deviation (ddof 1) over sqrt(n)
    sd = math.sqrt(sum((c - acc) ** 2 for c in correct) / 15)
    assert summary["lmeval_local_bio_acc_stderr"] == pytest.approx(sd / math.sqrt(16), abs=1e-6)
    lm = summary["lm_eval"]
    assert lm["version"] == "0.4.13" and lm["n"] == {"local_bio": 16, "local_cloze": 16}
    assert lm["n_shot"] == {"local_bio": 0, "local_cloze": 0}
    assert lm["results"]["local_bio"]["acc,none"] == summary["lmeval_local_bio_acc"]
    results = json.loads((out / "lm_eval" / "results.json").read_text())
    assert results["results"]["local_bio"]["acc,none"] == acc  # lm-eval's own, unrounded
    assert results["results"]["local_bio"]["acc_stderr,none"] == pytest.approx(sd / math.sqrt(16), rel=1e-12)
    assert "lm-eval" in log_text and "local_bio_acc" in log_text


@pytest.mark.slow
def test_the_cloze_task_of_experiments_lmeval_and_the_project_cloze_scorer_agree(evaluated):
    """The project keeps cloze log-likelihoods per character of the choice (acc_norm's ranking); lm-eval keeps sums."""
    out, _ = evaluated
    summary = json.loads((out / "metrics.json").read_text())
    ours, theirs = _items_of_both(out, "cloze")
    items = _items()
    assert len(ours) == len(theirs) == 16 and len({r["predicted"] for r in ours}) > 1
    for r in ours:
        chars = [len(c) for c in items[r["index"]]["choices"]]
        lls = [ll for ll, _greedy in theirs[r["index"]]["filtered_resps"]]
        assert max(abs(a * n - b) for a, n, b in zip(r["logprobs"], chars, lls)) <= 1e-4, r["index"]
        assert max(range(4), key=lambda j: lls[j] / chars[j]) == r["predicted"], r["index"]
        assert theirs[r["index"]]["acc_norm"] == float(r["correct"])
    assert summary["lmeval_local_cloze_acc_norm"] == pytest.approx(summary["mc_cloze"], abs=1e-6)
