"""End to end: `dvc repro` of the micro world, in a scratch DVC project with the repository's dvc.yaml."""

import json
import shutil
import subprocess

import pyarrow.parquet as pq
import pytest
import yaml

from .conftest import MICRO_WORLD, REPO, TINY_MODEL, cli_env


def _dvc(args, cwd, timeout=900):
    proc = subprocess.run(["dvc", *args], cwd=cwd, env={**cli_env(), "DVC_NO_ANALYTICS": "1"}, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"dvc {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.mark.slow
def test_dvc_repro_micro_world(tmp_path):
    proj = tmp_path / "proj"
    proj.mkdir()
    for name in ("dvc.yaml", "data", "pipeline", "experiments"):
        src = REPO / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, proj / name)
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["world"].update(MICRO_WORLD)
    params["tokenizer"]["vocab_size"] = 400
    params["model"]["config"] = {**TINY_MODEL, "max_position_embeddings": 256}  # the corpus run's passages
    params["data"]["max_length"] = 256
    params["finetune"]["train"].update(epochs=2, micro_batch_size=8, checkpoint_every=0)
    params["finetune"]["models"]["base"]["train"] = {"epochs": 2}
    params["check"]["max_new_tokens"] = 16
    params["attribution"]["tagger"] = "spacy"
    params["unlearn"]["train"].update(epochs=1, micro_batch_size=2)
    params["unlearn"]["defaults"]["rmu_layer"] = 2
    params["evaluate"].update(max_new_tokens=16, batch_size=16)
    # membership inference, relearning and the monitor end to end; the quantization and paraphrase probes are
    # checked in tests/test_robustness_eval.py (here they would double every evaluation's time)
    params["evaluate"].update(quantize={}, paraphrase=False, probe_sets=["forget", "world_forget"])
    params["relearn"]["train"]["max_steps"] = 2
    params["unlearn"]["monitor"].update(every=2, max_new_tokens=8, n_items=4)
    params["corpus"]["unlearn"]["monitor"] = {"every": 0}
    params["unlearn"]["seeds"] = [0, 1]
    params["unlearn"]["runs"] = {"npo": {"method": "npo", "weighting": "uniform"},
                                 "s_wga": {"method": "wga", "weighting": "soft"},
                                 "s_wga_a50": {"method": "wga", "weighting": "soft", "alpha": 0.5}}
    params["report"] = {"table": ["npo", "s_wga"], "ablations": {"alpha": ["s_wga", "s_wga_a50"]}}
    (proj / "params.yaml").write_text(yaml.safe_dump(params))
    _dvc(["init", "--no-scm", "-q"], proj)
    _dvc(["config", "core.site_cache_dir", str(tmp_path / "site_cache")], proj)

    _dvc(["repro"], proj)
    metrics = json.loads((proj / "artifacts/metrics/models.json").read_text())
    assert set(metrics) == {"target", "retain"}
    for rates in metrics.values():
        assert set(rates) == set(params["check"]["splits"]) and all(0 <= r <= 1 for r in rates.values())
    from transformers import AutoModelForCausalLM

    for name in ("base", "target", "retain"):
        AutoModelForCausalLM.from_pretrained(proj / "artifacts/models" / name, use_safetensors=True)
    assert "up to date" in _dvc(["status", "dvc.yaml"], proj)

    # A rerun of a stage gives the same model, byte for byte (dvc.lock records the same hash; its loss curve
    # differs in the step times alone).
    def model_hash():
        outs = yaml.safe_load((proj / "dvc.lock").read_text())["stages"]["finetune@target"]["outs"]
        return [o["md5"] for o in outs if o["path"] == "artifacts/models/target"]

    before = model_hash()
    _dvc(["repro", "--force", "--single-item", "finetune@target"], proj)
    assert model_hash() == before and len(before) == 1

    assert (proj / "artifacts/unlearn/s_wga/seed1/token_weights.parquet").is_file()
    assert json.loads((proj / "artifacts/unlearn/s_wga/complete.json").read_text())["seeds"] == [0, 1]
    for name in ("target", "retain", "npo", "s_wga"):
        summary = json.loads((proj / f"artifacts/metrics/eval/{name}.json").read_text())
        assert {"forget_es", "retain_es", "model_utility", "log10_forget_quality", "mc_world_forget"} <= set(summary)
    runs = json.loads((proj / "artifacts/metrics/eval/s_wga.json").read_text())
    assert runs["seeds"] == [0, 1] and set(runs["per_seed"]) == {"0", "1"} and "forget_es_std" in runs
    assert json.loads((proj / "artifacts/metrics/eval/retain.json").read_text())["forget_quality"] == 1.0
    table = (proj / "artifacts/report/results.md").read_text()
    assert "| before unlearning | target |" in table and "| S-WGA | s_wga |" in table
    assert "s_wga_a50" not in table.split("Ablation")[0] and "| S-WGA, 1 − α = 0.5 | s_wga_a50 |" in table
    for png in ("forget_quality_vs_utility.png", "ablation_alpha.png", "relearning.png"):
        assert (proj / "artifacts/report" / png).read_bytes()[:4] == b"\x89PNG"
    # is it forgotten or only hidden: privleak against the retain model, the attacks' columns, the monitor's plot
    assert json.loads((proj / "artifacts/metrics/eval/retain.json").read_text())["privleak"] == 0.0
    relearned = json.loads((proj / "artifacts/metrics/relearn/npo.json").read_text())
    assert relearned["seeds"] == [0, 1]
    assert {"before_forget_es", "forget_forget_es", "retain_forget_es"} <= set(relearned)
    assert "| privleak (→0) |" in table.split("Is it forgotten")[1].splitlines()[2]
    monitor = (proj / "artifacts/plots/monitor/npo/seed1.csv").read_text().splitlines()
    assert monitor[0].startswith("step,eval_forget_es") and monitor[1].startswith("0,")

    # A new τ reruns unlearning only, never attribution (r and τ are not params of `attribute`).
    params["unlearn"]["defaults"]["tau"] = 1.0
    (proj / "params.yaml").write_text(yaml.safe_dump(params))
    status = _dvc(["status", "dvc.yaml"], proj)
    assert "unlearn@s_wga" in status and "attribute" not in status and "finetune" not in status
    # ... here through the sweep (every stage of dvc.yaml, on a local Ray of 2 workers), which runs and records
    # what `dvc repro` would
    proc = subprocess.run(["tokenunlearn", "sweep", "dvc.yaml", "*", "--workers", "2"], cwd=proj,
                          env={**cli_env(), "DVC_NO_ANALYTICS": "1"}, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    swept = json.loads((proj / "artifacts/logs/sweep/sweep.json").read_text())["stages"]
    ran = {name for name, s in swept.items() if s["status"] == "done"}
    assert {"unlearn@s_wga", "evaluate@s_wga", "relearn@s_wga", "report"} <= ran, swept
    assert not ran & {"attribute", "evaluate@npo", "relearn@npo"}, swept  # npo's weights do not use τ
    assert "up to date" in _dvc(["status", "dvc.yaml"], proj)

    # The WMDP-style run and the tuning are pipelines of their own on the same params, through their overlays.
    params["corpus"]["unlearn"]["train"] = {"epochs": 1, "micro_batch_size": 1}
    params["corpus"]["report"]["table"] = ["npo", "s_wga"]
    params["tune"].update(lrs=[1e-4, 1e-3], groups={"npo": ["npo"]})
    params["corpus"]["tune"] = {"lrs": [1e-3], "groups": {"npo": ["npo"]}}
    (proj / "params.yaml").write_text(yaml.safe_dump(params))
    _dvc(["repro", "experiments/corpus/dvc.yaml"], proj)
    weights = pq.read_table(proj / "artifacts/corpus/unlearn/s_wga/seed0/token_weights.parquet")
    assert weights.num_rows == 1  # the micro world's one forget10 author's passage
    corpus = json.loads((proj / "artifacts/corpus/metrics/eval/npo.json").read_text())
    assert {"mc_world_forget", "mc_world_retain", "mc_world_world_facts"} <= set(corpus)
    assert "| S-WGA | s_wga |" in (proj / "artifacts/corpus/report/results.md").read_text()
    _dvc(["repro", "experiments/tuning/dvc.yaml"], proj)
    choice = json.loads((proj / "artifacts/tuning/npo/choice.json").read_text())
    assert [t["lr"] for t in choice["runs"]["npo"]["trials"]] == [1e-4, 1e-3]
    assert (proj / "artifacts/tuning/corpus/npo/choice.json").is_file()
    assert "Running stage" not in _dvc(["repro"], proj)  # the root pipeline did not change

    # Changing only a finetune param reruns that model and what follows, never the world or tokenizer.
    params["finetune"]["models"]["retain"]["train"] = {"epochs": 1}
    (proj / "params.yaml").write_text(yaml.safe_dump(params))
    status = _dvc(["status", "dvc.yaml"], proj)
    assert "finetune@retain" in status and "world:" not in status and "tokenizer:" not in status
