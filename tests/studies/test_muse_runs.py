"""The MUSE pipelines' pieces: the forget set split into requests (disjoint, covering, deterministic), the corpora
as passage files, finetuning on them, the chain of models between requests (and configs/sequential.yaml's), MUSE's
table and the series' CSV, Markdown and plots on hand-made evaluate-muse outputs, and both pipelines as DVC parses
them."""

import csv
import json
import shutil
from dataclasses import asdict

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from pipeline.common.errors import DataError, ParamError
from pipeline.data.muse_requests import Request, load_requests, split_requests, write_muse_corpora
from pipeline.studies import muse_report
from pipeline.studies.muse_report import Entry

from tests.conftest import REPO, micro_params

# ---- the split into requests --------------------------------------------------------------------------------


def test_requests_are_disjoint_cover_the_forget_set_and_are_the_same_for_a_seed():
    authors = [f"a{i}" for i in range(7)]
    groups = split_requests(authors, 3, seed=0)
    assert sorted(a for g in groups for a in g) == sorted(authors)           # covering, nothing twice
    assert sorted(len(g) for g in groups) == [2, 2, 3]                       # sizes differ by at most one
    assert all(g == sorted(g, key=authors.index) for g in groups)            # each in the forget set's order
    assert split_requests(authors, 3, seed=0) == groups                      # deterministic
    assert any(split_requests(authors, 3, seed=s) != groups for s in range(1, 5))  # the seed decides
    assert sorted(map(len, split_requests(authors, 7, seed=0))) == [1] * 7  # one author a request
    with pytest.raises(ParamError, match=r"requests=8: split 7 forget authors into 1 to 7 requests"):
        split_requests(authors, 8, seed=0)
    with pytest.raises(ParamError, match="requests=0"):
        split_requests(authors, 0, seed=0)
    with pytest.raises(ParamError, match="names an author twice"):
        split_requests(["a", "a"], 1, seed=0)


@pytest.fixture(scope="module")
def world20(world_spec, tmp_path_factory):
    """A world of 20 authors: forget10 holds 2 of them, so it splits into 2 requests."""
    from pipeline.data.world import WorldConfig, generate_world, write_world

    out = tmp_path_factory.mktemp("w20") / "world"
    write_world(generate_world(world_spec, WorldConfig(n_authors=20, questions_per_author=3, seed=7)), out)
    return out


def test_the_corpora_are_world_muses_partition_and_the_requests_hold_their_authors_items(world20, tmp_path):
    from pipeline.data.muse import load_eval_sets, write_world_as_muse
    from pipeline.data.tofu import load_passages
    from stages.cli import run

    out = tmp_path / "corpora"
    assert run(["muse-corpora", "--world", str(world20), "--requests", "2", "--seed", "3", "--out", str(out)]) == 0
    summary = write_world_as_muse(world20, tmp_path / "world_muse", "forget10")
    manifest = json.loads((out / "corpora.json").read_text())
    assert manifest["authors"] == summary["authors"] and manifest["seed"] == 3
    for part, authors in summary["authors"].items():
        assert [p["author"] for p in load_passages(out / f"{part}.json")] == authors
    requests = load_requests(out)
    forget = summary["authors"]["forget"]
    assert [r.name for r in requests] == ["request1", "request2"] and len(forget) == 2
    assert sorted(a for r in requests for a in r.authors) == sorted(forget)
    sets = load_eval_sets(tmp_path / "world_muse")
    # the requests' items are exactly the forget items of evaluate-muse's source, each in one request
    assert sorted(q for r in requests for q in r.questions) == sorted(p.question for p in sets.knowmem_forget)
    assert sorted(t for r in requests for t in r.texts) == sorted(sets.privleak_forget)
    assert sorted(p for r in requests for p in r.verbmem_prompts) == sorted(v.prompt for v in sets.verbmem)
    for k, r in enumerate(requests, 1):  # attribution (split forget10) reads each file whole
        assert [p["author"] for p in load_passages(out / f"request{k}.json", "forget10")] == list(r.authors)
    assert [p["author"] for p in load_passages(out / "first2.json")] == forget
    assert [p["author"] for p in load_passages(out / "first1.json")] == list(requests[0].authors)
    # the same seed, the same files
    assert run(["muse-corpora", "--world", str(world20), "--requests", "2", "--seed", "3", "--out",
                str(tmp_path / "again")]) == 0
    assert (tmp_path / "again" / "corpora.json").read_bytes() == (out / "corpora.json").read_bytes()
    # without --requests: the corpora alone, and no requests to read
    assert run(["muse-corpora", "--world", str(world20), "--out", str(tmp_path / "plain")]) == 0
    assert not (tmp_path / "plain" / "request1.json").exists()
    with pytest.raises(DataError, match="no requests"):
        load_requests(tmp_path / "plain")
    bad = json.loads((out / "corpora.json").read_text())
    bad["requests"][1]["authors"] = bad["requests"][0]["authors"]
    (tmp_path / "plain" / "corpora.json").write_text(json.dumps(bad))
    with pytest.raises(DataError, match=r"requests\[2\]: author\(s\) .* in an earlier request too"):
        load_requests(tmp_path / "plain")


def test_finetuning_reads_the_corpora_beside_the_splits_and_keeps_old_fingerprints(world20, micro_tokenizer_dir,
                                                                                    tmp_path):
    from pipeline.data.templates import IGNORE_INDEX
    from pipeline.training.finetune import job_from_params, job_record, load_samples
    from pipeline.common.modeling import load_tokenizer

    write_muse_corpora(world20, tmp_path / "c")
    params = micro_params(world20, micro_tokenizer_dir)
    params["finetune"]["models"]["m"]["splits"] = ["forget10"]
    plain = job_from_params(params, "m")
    assert plain.corpora == [] and "corpora" not in job_record(plain)  # a model without corpora: as before
    assert job_record(plain) == {k: v for k, v in asdict(plain).items() if k != "corpora"}
    tokenizer = load_tokenizer(micro_tokenizer_dir)
    qa = load_samples(plain, tokenizer)
    params["finetune"]["models"]["m"]["corpora"] = [str(tmp_path / "c" / "forget.json")]
    job = job_from_params(params, "m")
    samples = load_samples(job, tokenizer)
    assert job_record(job)["corpora"] == job.corpora
    passages = [json.loads(line)["text"] for line in (tmp_path / "c" / "forget.json").read_text().splitlines()]
    assert [s.text for s in samples] == [s.text for s in qa] + passages
    for s in samples[len(qa):]:  # a passage: every token after the first is learned
        assert s.labels == [IGNORE_INDEX] + s.input_ids[1:]
    params["finetune"]["models"]["m"]["corpora"] = "forget.json"
    with pytest.raises(ParamError, match=r"finetune.models.m.corpora: a list of passage files"):
        job_from_params(params, "m")


# ---- the chain of models ------------------------------------------------------------------------------------

def _chain(runs, k):
    return {f"{r}_r{i}": {"run": r, "request": i, "after": f"{r}_n1" if i == 2 else f"{r}_r{i - 1}"}
            for r in runs for i in range(2, k + 1)}


def test_each_request_starts_from_the_model_the_request_before_left():
    chain = _chain(["npo", "t_npo"], 4)
    assert muse_report.chain_order(["npo", "t_npo"], chain, 4) == {
        "npo": ["npo_n1", "npo_r2", "npo_r3", "npo_r4"], "t_npo": ["t_npo_n1", "t_npo_r2", "t_npo_r3", "t_npo_r4"]}
    wrong = {**chain, "npo_r3": {"run": "npo", "request": 3, "after": "npo_n1"}}  # skips request 2's model
    with pytest.raises(ParamError, match=r"sequential.chain.npo_r3.after='npo_n1': request 3 of run npo starts "
                                         r"from the model after request 2, 'npo_r2'"):
        muse_report.chain_order(["npo", "t_npo"], wrong, 4)
    with pytest.raises(ParamError, match="run npo has 0 entries for request 4"):
        muse_report.chain_order(["npo", "t_npo"], {k: v for k, v in chain.items() if k != "npo_r4"}, 4)
    with pytest.raises(ParamError, match=r"sequential.chain.t_npo_r2.run='t_npo': not a run of sequential.runs"):
        muse_report.chain_order(["npo"], chain, 4)
    # a chain that starts at request 1 is told so, not blamed on a missing run
    with pytest.raises(ParamError, match=r"sequential.chain.npo_r1.request=1: request 1 of every run is RUN_n1"):
        muse_report.chain_order(["npo"], {"npo_r1": {"run": "npo", "request": 1, "after": "target"}, **chain}, 4)
    with pytest.raises(ParamError, match=r"sequential.chain.npo_r5.request=5: a request from 2 to 4"):
        muse_report.chain_order(["npo", "t_npo"], {**chain, "npo_r5": {"run": "npo", "request": 5, "after": "npo_r4"}},
                                4)


def test_the_sequential_pipelines_chain_and_dvc_yaml_pass_each_model_on():
    """configs/sequential.yaml's chain is the chain (K >= 4), and experiments/sequential/dvc.yaml starts each request's
    attribution and unlearning from its `after`'s model, the size series and request 1 from the target."""
    spec = muse_report.read_series_spec(REPO / "configs" / "sequential.yaml")
    assert spec["requests"] >= 4 and spec["sizes"] == list(range(1, spec["requests"] + 1))
    assert spec["chain"] == _chain(spec["runs"], spec["requests"])
    stages = yaml.safe_load((REPO / "experiments" / "sequential" / "dvc.yaml").read_text())["stages"]
    after = "artifacts/sequential/unlearn/${item.after}/seed0/model"
    assert f"-S unlearn.model={after}" in stages["unlearn_chain"]["do"]["cmd"]
    assert f"-S attribution.model={after}" in stages["attribute_chain"]["do"]["cmd"]
    assert "artifacts/sequential/unlearn/${item.after}" in stages["unlearn_chain"]["do"]["deps"]
    assert "-S unlearn.model" not in stages["unlearn_size"]["cmd"]  # configs/muse.yaml's: the target
    muse = yaml.safe_load((REPO / "configs" / "muse.yaml").read_text())
    assert muse["unlearn"]["model"] == muse["attribution"]["model"] == "artifacts/muse/models/target"
    assert set(spec["runs"]) <= set(muse["report"]["table"]) <= set(muse["unlearn"]["runs"])


# ---- reports on hand-made evaluations -----------------------------------------------------------------------

R1 = Request("request1", ("A",), ("text a",), ("qa1", "qa2"), ("pa",))
R2 = Request("request2", ("B",), ("text b",), ("qb1",), ("pb",))


def _evaluation(out, verbmem, knowmem, forget, holdout, knowmem_r=50.0, privleak=-10.0):
    """An evaluate-muse output: metrics.json and the items the report reads."""
    (out / "items").mkdir(parents=True)
    tables = {"verbmem": ("prompt", verbmem, "rougeL_f1"), "knowmem_forget": ("question", knowmem, "rougeL_f1"),
              "privleak_forget": ("text", forget, "min_k"), "privleak_holdout": ("text", holdout, "min_k")}
    for name, (key, values, column) in tables.items():
        pq.write_table(pa.table({key: list(values), column: [float(v) for v in values.values()]}),
                       out / "items" / f"{name}.parquet")
    summary = {"verbmem_f": 100 * sum(verbmem.values()) / len(verbmem),
               "knowmem_f": 100 * sum(knowmem.values()) / len(knowmem), "knowmem_r": knowmem_r,
               "privleak": privleak, "privleak_min_k_plus_plus": None, "auc": {"min_k": 0.25},
               "definitions": {"attack": "min_k"}}
    (out / "metrics.json").write_text(json.dumps(summary))
    return out


HOLDOUT = {"h1": 2.0, "h2": 0.5}


def _model(root, name, a, b):
    """A model whose verbmem and knowmem ROUGE is `a` on request 1's items and `b` on request 2's; request 1's text
    scores 1.0 (one of the two holdout texts below it), request 2's 3.0 (both)."""
    return _evaluation(root / name, {"pa": a, "pb": b}, {"qa1": a, "qa2": a / 2, "qb1": b},
                       {"text a": 1.0, "text b": 3.0}, HOLDOUT)


def test_a_requests_metrics_are_its_items_means_and_its_privleak_against_the_retain_models(tmp_path):
    model = muse_report.read_items(_model(tmp_path, "m", 0.8, 0.4))
    retain = muse_report.read_items(_evaluation(tmp_path / "retain", {"pa": 0.1, "pb": 0.1},
                                                {"qa1": 0.1, "qa2": 0.1, "qb1": 0.1},
                                                {"text a": 3.0, "text b": 1.5}, {"h1": 2.0, "h2": 2.5}))
    got = muse_report.part_metrics(model, retain, R1, "m")
    # VerbMem 100 · 0.8; KnowMem 100 · (0.8 + 0.4) / 2; AUC: of (1.0, 2.0), (1.0, 0.5) one holdout text scores
    # lower, 0.5; the retain model's: both (3.0 > 2.0, 2.5), 1.0; PrivLeak (0.5 − 1) / 1 · 100
    assert got == pytest.approx({"verbmem_f": 80.0, "knowmem_f": 60.0, "privleak": -50.0})
    both = muse_report.part_metrics(model, retain, muse_report.union([R1, R2], "both"), "m")
    # AUC over 4 pairs: text a 1 of 2, text b 2 of 2 -> 0.75; retain: text a 2, text b 0 (1.5 < 2.0, 2.5) -> 0.5
    assert both == pytest.approx({"verbmem_f": 60.0, "knowmem_f": 100 * (0.8 + 0.4 + 0.4) / 3, "privleak": 50.0})
    with pytest.raises(DataError, match="request9's question 'qz' is not among the evaluation's items"):
        muse_report.part_metrics(model, retain, Request("request9", (), ("text a",), ("qz",), ()), "m")
    # a part without verbmem items (single-sentence passages) has no VerbMem
    assert muse_report.part_metrics(model, retain, Request("r", (), ("text a",), ("qa1",), ()), "m")["verbmem_f"] \
        is None


def _read_csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def test_the_series_report_on_hand_made_evaluations(tmp_path):
    """Two requests, one run: the target, request 1 (npo_n1), request 2 after it (npo_r2), both at once (npo_n2)."""
    root = tmp_path / "eval"
    _model(root, "target", 0.9, 0.9)
    _model(root, "npo_n1", 0.2, 0.8)
    _model(root, "npo_r2", 0.3, 0.1)
    _model(root, "npo_n2", 0.4, 0.4)
    _evaluation(root / "retain", {"pa": 0.1, "pb": 0.1}, {"qa1": 0.1, "qa2": 0.1, "qb1": 0.1},
                {"text a": 3.0, "text b": 1.5}, {"h1": 2.0, "h2": 2.5}, knowmem_r=40.0, privleak=0.0)
    spec = {"requests": 2, "seed": 0, "runs": ["npo"], "sizes": [1, 2], "chain": _chain(["npo"], 2)}
    sequential, sizes = muse_report.series_points(spec, {"npo": "NPO"}, [R1, R2], root, root / "target")
    assert [(p.x, p.eval_dir.name) for p, _ in sequential] == [(0, "target"), (1, "npo_n1"), (2, "npo_r2")]
    assert [(p.x, p.eval_dir.name) for p, _ in sizes] == [(1, "npo_n1"), (2, "npo_n2")]  # x: authors forgotten
    out = tmp_path / "report"
    muse_report.write_series_report(sequential, sizes, [R1, R2], root / "retain", out)

    rows = {(r["x"], r["scope"]): r for r in _read_csv(out / "sequential.csv")}
    assert set(rows) == {(x, s) for x in "012" for s in ("all", "request1", "request2")} | \
        {("1", "unlearned"), ("2", "unlearned")}
    assert float(rows["1", "request1"]["verbmem_f"]) == pytest.approx(20.0)     # request 1 forgotten...
    assert float(rows["1", "request2"]["verbmem_f"]) == pytest.approx(80.0)     # ...request 2 not yet
    assert float(rows["2", "request1"]["verbmem_f"]) == pytest.approx(30.0)     # request 1 after request 2
    assert float(rows["2", "unlearned"]["knowmem_f"]) == pytest.approx(100 * (0.3 + 0.15 + 0.1) / 3, abs=1e-4)
    assert float(rows["0", "all"]["knowmem_r"]) == 50.0 and rows["1", "request1"]["knowmem_r"] == ""
    assert float(rows["1", "request1"]["privleak"]) == pytest.approx(-50.0)
    size = {(r["x"], r["scope"]): r for r in _read_csv(out / "size.csv")}
    assert float(size["2", "unlearned"]["verbmem_f"]) == pytest.approx(40.0) and ("1", "request1") not in size
    text = (out / "results.md").read_text()
    assert "| run | requests unlearned | VerbMem ↓ | KnowMem forget ↓ | KnowMem retain ↑ | PrivLeak → 0 |" \
        in text
    assert "| NPO | 2 | 22.5 | 10.0 |" in text  # KnowMem forget of each request after the second
    assert "| NPO | 2 | 30.0 | 10.0 |" in text  # and VerbMem
    assert "**PrivLeak** → 0:" in text
    for png in ("sequential.png", "sequential_requests.png", "size.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(DataError, match="the corpora hold 2 requests, sequential.requests is 3"):
        muse_report.series_points({**spec, "requests": 3}, {"npo": "NPO"}, [R1, R2], root, root / "target")
    with pytest.raises(ParamError, match=r"sequential.sizes=\[2\]"):
        muse_report.series_points({**spec, "sizes": [2]}, {"npo": "NPO"}, [R1, R2], root, root / "target")


def test_muses_table_and_the_stages_on_hand_made_evaluations(tmp_path):
    from stages.cli import run

    root = tmp_path / "eval"
    for name, (a, b) in {"target": (0.9, 0.9), "retain": (0.1, 0.1), "npo": (0.5, 0.5), "t_npo": (0.2, 0.3),
                         "npo_n1": (0.2, 0.8), "npo_n2": (0.4, 0.4)}.items():
        _model(root, name, a, b)
    args = ["--params", str(REPO / "params.yaml"), "--overlay", str(REPO / "configs" / "muse.yaml")]
    assert run(["muse-report", *args, "-S", "report.table=[npo, t_npo]", "--eval-dir", str(root),
                "--out", str(tmp_path / "table")]) == 0
    table = (tmp_path / "table" / "results.md").read_text()
    assert "| model | run | VerbMem ↓ | KnowMem forget ↓ | KnowMem retain ↑ | PrivLeak → 0 | " \
        "PrivLeak Min-K%++ → 0 |" in table
    assert "| before unlearning | target | 90.0 | 75.0 | 50.0 | -10.0 | n/a |" in table
    assert "| T-NPO | t_npo | 25.0 |" in table and "**KnowMem retain** ↑: ROUGE-L F1" in table
    rows = _read_csv(tmp_path / "table" / "results.csv")
    assert [r["run"] for r in rows] == ["target", "retain", "npo", "t_npo"] and rows[3]["verbmem_f"] == "25.0"
    muse_report.write_muse_report([Entry("x", "X", json.loads((root / "npo" / "metrics.json").read_text()))],
                                  tmp_path / "one", "t")
    assert (tmp_path / "one" / "results.csv").read_text().splitlines()[1].startswith("x,X,50.0,")

    corpora = tmp_path / "corpora"
    corpora.mkdir()
    (corpora / "corpora.json").write_text(json.dumps({"requests": [
        {"name": r.name, **{f: list(getattr(r, f)) for f in ("authors", "texts", "questions", "verbmem_prompts")}}
        for r in (R1, R2)]}))
    spec = tmp_path / "sequential.yaml"
    spec.write_text(yaml.safe_dump({"sequential": {"requests": 2, "seed": 0, "runs": ["npo"], "sizes": [1, 2],
                                                   "chain": {"npo_r2": {"run": "npo", "request": 2,
                                                                        "after": "npo_n1"}}}}))
    shutil.copytree(root / "npo", root / "npo_r2")
    assert run(["muse-series", *args, "--spec", str(spec), "--corpora", str(corpora), "--eval-dir", str(root),
                "--target-eval", str(root / "target"), "--retain-eval", str(root / "retain"),
                "--out", str(tmp_path / "series")]) == 0
    assert {r["label"] for r in _read_csv(tmp_path / "series" / "sequential.csv")} == {"NPO"}
    spec.write_text("sequential: {runs: [npo]}\n")
    with pytest.raises(ParamError, match=r"sequential lacks \['requests', 'seed', 'sizes', 'chain'\]"):
        muse_report.read_series_spec(spec)


# ---- the pipelines, as DVC parses them ----------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # pygtrie's, inside DVC
def test_both_pipelines_parse_with_dvc_and_chain_their_stages(tmp_path, monkeypatch):
    """DVC's own parser on a copy (its Python API: one import, no subprocess): every stage expands (matrix and
    foreach), and request k's unlearning waits for request k-1's, its attribution, and the target's."""
    import networkx as nx
    from dvc.repo import Repo

    for name in ("configs", "experiments/dvc.yaml", "experiments/params.yaml", "experiments/muse",
                 "experiments/sequential"):
        src, dst = REPO / name, tmp_path / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if src.is_dir() else shutil.copy)(src, dst)
    monkeypatch.setenv("DVC_NO_ANALYTICS", "1")
    monkeypatch.chdir(tmp_path / "experiments")  # stages are named relative to the working directory
    Repo.init(str(tmp_path / "experiments"), no_scm=True).close()
    repo = Repo(str(tmp_path / "experiments"))  # the experiments' DVC project
    try:
        stages = {s.addressing: s for s in repo.index.stages}
        graph = repo.index.graph
        spec = muse_report.read_series_spec(REPO / "configs" / "sequential.yaml")
        muse = "muse/dvc.yaml:"
        assert {f"{muse}{s}" for s in ("world_muse", "corpora", "finetune@target", "finetune@retain", "attribute",
                                       "evaluate_retain", "evaluate_target", "report")} <= set(stages)
        assert {f"{muse}unlearn@{r}" for r in ("ga", "t_npo", "s_npo")} <= set(stages)
        seq = "sequential/dvc.yaml:"
        assert {f"{seq}unlearn_size@{r}-{n}" for r in spec["runs"] for n in spec["sizes"]} <= set(stages)
        assert {f"{seq}unlearn_chain@{key}" for key in spec["chain"]} <= set(stages)
        upstream = {s.addressing for s in nx.descendants(graph, stages[f"{seq}unlearn_chain@npo_r3"])}
        assert {f"{seq}unlearn_chain@npo_r2", f"{seq}attribute_chain@npo_r3", f"{seq}unlearn_size@npo-1",
                f"{muse}finetune@target", f"{muse}pretrain", "code"} <= upstream
        assert f"{seq}unlearn_chain@t_npo_r2" not in upstream and f"{seq}unlearn_chain@npo_r4" not in upstream
        report = {s.addressing for s in nx.descendants(graph, stages[f"{seq}report"])}
        assert {f"{seq}evaluate_chain@{key}" for key in spec["chain"]} <= report
        assert f"{muse}evaluate_target" in report
    finally:
        repo.close()
