"""End to end on the micro world, in scratch DVC projects with the repository's pipelines: the demo (dvc.yaml on
params.yaml, as `make demo` runs it, then `dvc exp run -S` as the README shows, and a killed multi-seed stage
rerun), and the paper's sweep (experiments/paper/dvc.yaml on configs/paper.yaml, in the experiments' own DVC
project) with the experiments that build on it."""

import json
import shutil
import subprocess

import pyarrow.parquet as pq
import pytest
import yaml

from tests.conftest import MICRO_WORLD, REPO, TINY_MODEL, cli_env

pytestmark = pytest.mark.slow  # the demo's and the experiments' DVC pipelines end to end

ENV = {"DVC_NO_ANALYTICS": "1", "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
       "GIT_COMMITTER_EMAIL": "t@t"}


def _run(args, cwd, timeout=900):
    proc = subprocess.run(args, cwd=cwd, env={**cli_env(), **ENV}, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout + proc.stderr


def _dvc(args, cwd, timeout=900):
    return _run(["dvc", *args], cwd, timeout)


# Imported at every Python start (PYTHONPATH): with TEST_DIE_AT_SEED set, the engine's process ends at once, as a
# kill would end it, at the first training step of that seed.
DIE_AT_SEED = """
import importlib.abc, importlib.util, os, sys

class DieAtSeed(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "pipeline.training.engine":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            step = module.Engine.train_step

            def dying_step(engine, *args, **kwargs):
                if engine.cfg.seed == int(os.environ["TEST_DIE_AT_SEED"]):
                    os._exit(137)
                return step(engine, *args, **kwargs)
            module.Engine.train_step = dying_step
        spec.loader.exec_module = exec_module
        return spec

if os.environ.get("TEST_DIE_AT_SEED"):
    sys.meta_path.insert(0, DieAtSeed())
"""


def _ran(output: str) -> set[str]:
    return {line.split("'")[1] for line in output.splitlines() if line.startswith("Running stage '")}


def _micro(params: dict) -> dict:
    """A params file at the micro world's size: every stage in seconds."""
    params["world"].update(MICRO_WORLD)
    params["tokenizer"]["vocab_size"] = 400
    params["model"]["config"] = {**TINY_MODEL, "max_position_embeddings": 256}  # the corpus run's passages
    params["data"]["max_length"] = 256
    params["finetune"]["train"].update(epochs=2, micro_batch_size=8, checkpoint_every=0)
    params["finetune"]["models"]["base"]["train"] = {"epochs": 2}
    params["check"]["max_new_tokens"] = 16
    params["attribution"]["tagger"] = "spacy"
    params["unlearn"]["train"].update(epochs=1, micro_batch_size=2)
    params["unlearn"]["methods"]["rmu"]["rmu_layer"] = 2
    # membership inference, relearning and the monitor end to end; the quantization and paraphrase probes are
    # checked in tests/evaluation/test_robustness_eval.py (here they would double every evaluation's time)
    params["evaluate"].update(max_new_tokens=16, batch_size=16, quantize=None, paraphrase=False,
                              probe_sets=["forget", "world_forget"],
                              mia={"holdout_split": "holdout10", "k": 0.4, "attacks": ["min_k", "min_k_plus_plus"]})
    params["relearn"]["train"]["max_steps"] = 2
    params["unlearn"]["monitor"].update(every=2, max_new_tokens=8, n_items=4)
    params["tune"]["bisect"]["max_trials"] = 2
    return params


def _project(tmp_path, git: bool, experiments: tuple[str, ...] = ()):
    """A scratch copy of the repository with the `experiments` pipelines named, in the experiments' own DVC
    project (proj/experiments) as in the repository (every DVC command of that project parses each of its
    pipelines: the others only slow it down)."""
    proj = tmp_path / "proj"
    proj.mkdir()
    for name in ("dvc.yaml", "params.yaml", "data", "pipeline", "stages", "configs",
                 *(f"experiments/{e}" for e in (experiments and ("dvc.yaml", "params.yaml", *experiments)))):
        src, dst = REPO / name, proj / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if src.is_dir() else shutil.copy)(src, dst)
    if git:
        _run(["git", "init", "-q"], proj)
        _dvc(["init", "-q"], proj)
    else:
        _dvc(["init", "--no-scm", "-q"], proj)
    _dvc(["config", "core.site_cache_dir", str(tmp_path / "site_cache")], proj)
    if experiments:
        for script in (REPO / "experiments").glob("*/*.py"):  # the `code` stage's manifests name them
            (proj / "experiments" / script.parent.name).mkdir(exist_ok=True)
            shutil.copy(script, proj / "experiments" / script.parent.name / script.name)
        _dvc(["init", "--no-scm", "-q"] if not git else ["init", "--subdir", "-q"], proj / "experiments")
        _dvc(["config", "core.site_cache_dir", str(tmp_path / "site_cache")], proj / "experiments")
    return proj


def test_the_demo_pipeline_and_a_new_tau_with_dvc_exp_run(tmp_path):
    proj = _project(tmp_path, git=True)
    params = _micro(yaml.safe_load((proj / "params.yaml").read_text()))
    params["unlearn"]["seeds"] = [0, 1]
    runs = ("npo", "t_npo", "s_npo_ens")  # NPO and one run of each weighting (of the demo's four: time)
    params["unlearn"]["runs"] = {name: params["unlearn"]["runs"][name] for name in runs}
    params["report"]["table"], params["tune"]["groups"] = list(runs), {"npo": list(runs)}
    (proj / "params.yaml").write_text(yaml.safe_dump(params))
    (proj / ".gitignore").write_text("/artifacts/\n")
    _run(["git", "add", "-A"], proj)
    _run(["git", "commit", "-qm", "micro"], proj)

    assert _ran(_dvc(["repro"], proj)) == {
        "code", "world", "tokenizer", "pretrain", "finetune@target", "finetune@retain", "attribute", "reference",
        "evaluate_retain", "evaluate_target", *(f"{stage}@{run}" for stage in ("tune", "unlearn", "evaluate")
                                                for run in runs), "report"}
    from transformers import AutoModelForCausalLM

    for name in ("base", "target", "retain"):
        AutoModelForCausalLM.from_pretrained(proj / "artifacts/models" / name, use_safetensors=True)
    assert "up to date" in _dvc(["status", "dvc.yaml"], proj)

    # A rerun of a stage gives the same model, byte for byte (dvc.lock records the same hash).
    def model_hash():
        outs = yaml.safe_load((proj / "dvc.lock").read_text())["stages"]["finetune@target"]["outs"]
        return [o["md5"] for o in outs if o["path"] == "artifacts/models/target"]

    before = model_hash()
    _dvc(["repro", "--force", "--single-item", "finetune@target"], proj)
    assert model_hash() == before and len(before) == 1
    # Reruns leave the repository clean: no timing reaches a file dvc.lock hashes (the loss curves, the evaluation).
    _run(["git", "add", "-A"], proj)
    _run(["git", "commit", "-qm", "demo"], proj)
    for stage in ("pretrain", "evaluate@npo", "report"):
        _dvc(["repro", "--force", "--single-item", stage], proj)
    assert _run(["git", "status", "--porcelain"], proj) == ""
    timing = (proj / "artifacts/logs/timing/plots/finetune/base.csv").read_text().splitlines()
    assert timing[0] == "step,step_seconds,tokens_per_second" and len(timing) > 1

    assert (proj / "artifacts/unlearn/s_npo_ens/seed1/token_weights.parquet").is_file()
    assert json.loads((proj / "artifacts/unlearn/s_npo_ens/complete.json").read_text())["seeds"] == [0, 1]
    evaluated = json.loads((proj / "artifacts/metrics/eval/s_npo_ens.json").read_text())
    assert evaluated["seeds"] == [0, 1] and set(evaluated["per_seed"]) == {"0", "1"} and "forget_es_std" in evaluated
    assert json.loads((proj / "artifacts/metrics/eval/retain.json").read_text())["forget_quality"] == 1.0
    assert json.loads((proj / "artifacts/metrics/eval/retain.json").read_text())["privleak"] == 0.0
    headline = json.loads((proj / "artifacts/metrics/headline/t_npo.json").read_text())
    assert {"forget_es", "retain_es", "model_utility", "log10_forget_quality", "mc_world_forget"} <= set(headline)
    assert len(headline) <= 10
    # `dvc metrics show` is a table a terminal can show: the headline numbers, one row per model
    assert max(map(len, _dvc(["metrics", "show"], proj).splitlines())) < 300
    table = (proj / "artifacts/report/results.md").read_text()
    assert "| before unlearning | target |" in table and "| T-NPO | t_npo |" in table
    equal = table.split("## At equal utility")[1]  # (the micro model's utility is 0: no curve falls to the floor)
    assert all(f"| {label} | " in equal for label in ("NPO", "T-NPO", "S-NPO [entropy+nocopy+span]"))
    for png in ("forget_quality_vs_utility.png", "extraction_strength.png", "tradeoff_npo.png"):
        assert (proj / "artifacts/report" / png).read_bytes()[:4] == b"\x89PNG"
    monitor = (proj / "artifacts/plots/monitor/npo/seed1.csv").read_text().splitlines()
    assert monitor[0].startswith("step,eval_forget_es") and monitor[1].startswith("0,")

    # The README's flow: a new τ reruns the soft runs' tuning, unlearning and evaluation, and the report; never
    # attribution, nor the runs that do not read τ.
    ran = _ran(_dvc(["exp", "run", "-S", "unlearn.weightings.soft.tau=1.0"], proj))
    assert ran == {"tune@s_npo_ens", "unlearn@s_npo_ens", "evaluate@s_npo_ens", "report"}
    assert "tau: 1.0" in (proj / "params.yaml").read_text()
    assert "s_npo_ens" in _dvc(["exp", "show", "--only-changed", "--md"], proj)

    # A killed multi-seed unlearn stage keeps the seeds it finished: its outputs persist, and the rerun trains only
    # the missing one. New seeds [2, 3]; the stage's process dies (as by SIGKILL) at seed 3's first step.
    params = yaml.safe_load((proj / "params.yaml").read_text())
    params["unlearn"]["seeds"] = [2, 3]
    (proj / "params.yaml").write_text(yaml.safe_dump(params))
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(DIE_AT_SEED)
    killed = subprocess.run(["dvc", "repro", "unlearn@npo"], cwd=proj, capture_output=True, text=True, timeout=900,
                            env={**cli_env(), **ENV, "PYTHONPATH": str(hook), "TEST_DIE_AT_SEED": "3"})
    assert killed.returncode != 0 and "unlearn@npo" in killed.stdout + killed.stderr
    out = proj / "artifacts/unlearn/npo"
    assert (out / "seed2" / "model").is_dir() and not (out / "seed3").exists() and not (out / "complete.json").exists()
    seed2 = (out / "seed2" / "model" / "model.safetensors").stat().st_mtime_ns
    rerun = _dvc(["repro", "unlearn@npo"], proj)
    assert "unlearn npo seed 2: already finished with these params" in rerun
    assert (out / "seed2" / "model" / "model.safetensors").stat().st_mtime_ns == seed2  # kept, not trained again
    assert json.loads((out / "complete.json").read_text())["seeds"] == [2, 3]
    assert sorted(p.name for p in out.glob("seed*")) == ["seed2", "seed3"]  # seeds 0 and 1 are not unlearn.seeds'


def test_the_paper_sweep_and_the_experiments_on_its_models(tmp_path):
    proj = _project(tmp_path, git=False, experiments=("paper", "corpus", "tuning"))
    configs = proj / "configs"
    paper = _micro(yaml.safe_load((configs / "paper.yaml").read_text()))
    paper["attribution"]["signals"] = ["copy", "span"]
    paper["unlearn"]["seeds"] = [0]
    paper["unlearn"]["runs"] = {"npo": {"method": "npo", "weighting": "uniform"},
                                "s_wga": {"method": "wga", "weighting": "soft"},
                                "t_wga": {"method": "wga", "weighting": "hard"},
                                "t_wga_a50": {"method": "wga", "weighting": "hard", "alpha": 0.5}}
    paper["report"] = {"table": ["npo", "s_wga"], "ablations": {"alpha": ["t_wga", "t_wga_a50"]}}
    paper["tune"].update(lrs=[1e-4, 1e-3], groups={"npo": ["npo"]})
    (configs / "paper.yaml").write_text(yaml.safe_dump(paper))
    corpus = yaml.safe_load((configs / "corpus.yaml").read_text())
    corpus["unlearn"].update(train={"epochs": 1, "micro_batch_size": 1}, monitor={"every": 0},
                             runs={"npo": {"train": {"lr": 1e-3}}, "s_wga": {"train": {"lr": 1e-3}}})
    corpus["report"]["table"] = ["npo", "s_wga"]
    (configs / "corpus.yaml").write_text(yaml.safe_dump(corpus))

    # two stages at a time on a local Ray, recorded in experiments/paper/dvc.lock as `dvc repro` would, from the
    # experiments' own DVC project (where the pipeline's paths hold); the demo's project refuses it
    exp = proj / "experiments"
    sweep = ["tokenunlearn", "sweep", "paper/dvc.yaml", "*", "--workers", "2"]
    refused = subprocess.run(["tokenunlearn", "sweep", "experiments/paper/dvc.yaml", "*"], cwd=proj, text=True,
                             capture_output=True, env={**cli_env(), **ENV})
    assert refused.returncode == 2 and "belongs to the DVC project experiments/: sweep it from" in refused.stderr
    _run(sweep, exp)
    assert "up to date" in _dvc(["status", "paper/dvc.yaml"], exp)
    proj = exp  # the experiments' outputs: experiments/artifacts/
    checked = json.loads((proj / "artifacts/paper/metrics/models.json").read_text())
    assert set(checked) == {"target", "retain"} and set(checked["target"]) == set(paper["check"]["splits"])
    table = (proj / "artifacts/paper/report/results.md").read_text()
    assert "| S-WGA | s_wga |" in table and "| T-WGA, 1 − α = 0.5 | t_wga_a50 |" in table
    assert "| privleak (→0) |" in table.split("Is it forgotten")[1].splitlines()[2]
    for png in ("forget_quality_vs_utility.png", "ablation_alpha.png", "relearning.png"):
        assert (proj / "artifacts/paper/report" / png).read_bytes()[:4] == b"\x89PNG"
    relearned = json.loads((proj / "artifacts/paper/metrics/relearn/npo.json").read_text())
    assert {"before_forget_es", "forget_forget_es", "retain_forget_es"} <= set(relearned)

    # A new τ in the paper's params reruns the soft runs and what reads them, never attribution.
    paper["unlearn"]["weightings"]["soft"]["tau"] = 1.0
    (configs / "paper.yaml").write_text(yaml.safe_dump(paper))
    status = _dvc(["status", "paper/dvc.yaml"], proj)
    assert "unlearn@s_wga:" in status and "unlearn@npo:" not in status and "attribute:" not in status
    _run(sweep, proj)
    swept = json.loads((proj / "artifacts/logs/sweep/sweep.json").read_text())["stages"]
    ran = {name for name, s in swept.items() if s["status"] == "done"}
    assert {"unlearn@s_wga", "evaluate@s_wga", "relearn@s_wga", "report"} <= ran, swept
    assert not ran & {"attribute", "evaluate@npo", "relearn@npo", "unlearn@t_wga_a50"}, swept

    # The WMDP-style run and the tuning read the paper's models through their overlay files.
    _dvc(["repro", "corpus/dvc.yaml"], proj)
    weights = pq.read_table(proj / "artifacts/corpus/unlearn/s_wga/seed0/token_weights.parquet")
    assert weights.num_rows == 1  # the micro world's one forget10 author's passage
    assert {"mc_world_forget", "mc_world_retain", "mc_world_world_facts"} <= \
        set(json.loads((proj / "artifacts/corpus/metrics/eval/npo.json").read_text()))
    assert "| S-WGA | s_wga |" in (proj / "artifacts/corpus/report/results.md").read_text()
    _dvc(["repro", "tuning/dvc.yaml:tune@npo"], proj)
    choice = json.loads((proj / "artifacts/tuning/npo/choice.json").read_text())
    assert [t["lr"] for t in choice["runs"]["npo"]["trials"]] == [1e-4, 1e-3]
    assert not _ran(_dvc(["repro", "paper/dvc.yaml"], proj))  # the paper's sweep did not change

    # Changing only a finetune param reruns that model and what follows, never the world or tokenizer.
    paper["finetune"]["models"]["retain"]["train"] = {"epochs": 1}
    (configs / "paper.yaml").write_text(yaml.safe_dump(paper))
    status = _dvc(["status", "paper/dvc.yaml"], proj)
    assert "finetune@retain" in status and "world:" not in status and "tokenizer:" not in status
