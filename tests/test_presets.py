"""The real-model presets in configs/ are valid params files for the stages (checked without any download), and so
are configs/paper.yaml and the experiments' overlay files over it."""

import pytest

from pipeline.attribution.run import AttributionConfig
from pipeline.common.params import load_params, read_overlay, section
from pipeline.data.config import DataConfig

from tests.conftest import REPO

CONFIGS = REPO / "configs"


def _presets():
    """The overlays of configs/tofu.yaml, each on its own: none (Phi-1.5), each model family's
    (configs/models/NAME.yaml), and each memory overlay (configs/lora.yaml, configs/offload.yaml)."""
    yield []
    yield from ([path] for path in sorted((CONFIGS / "models").glob("*.yaml")))
    yield from ([CONFIGS / name] for name in ("lora.yaml", "offload.yaml"))


def _name(overlays) -> str:
    return "+".join(p.relative_to(CONFIGS).as_posix() for p in overlays) or "tofu.yaml"


@pytest.mark.parametrize("overlays", list(_presets()), ids=_name)
def test_preset_builds_every_stage_config(overlays):
    from pipeline.data.templates import template_from_params
    from pipeline.evaluation.config import eval_config
    from pipeline.training.unlearn import run_configs
    from stages.finetune import job_from_params

    params = load_params(CONFIGS / "tofu.yaml", overlays)
    data = DataConfig.from_params(section(params, "data"))
    template_from_params(data.template)
    AttributionConfig.from_params(section(params, "attribution"))
    for name in section(params, "finetune.models"):
        job = job_from_params(params, name)
        assert job.train.micro_batch_size * job.train.grad_accum == 32
    for name in section(params, "unlearn.runs"):
        _, train = run_configs(params, name)
        assert train.micro_batch_size * train.grad_accum == 32  # the paper's effective batch on one GPU
    eval_config(params)
    from pipeline.attribution.reference import ReferenceConfig
    from pipeline.evaluation.exact_match import CheckConfig
    from pipeline.studies.tuning import TuneConfig

    reference = ReferenceConfig.from_params(section(params, "reference"))
    assert reference.model == section(params, "attribution.model") == section(params, "unlearn.model")  # θ_o
    CheckConfig.from_params(section(params, "check"))
    tune = TuneConfig.from_params(section(params, "tune"))
    assert all(run in section(params, "unlearn.runs") for runs in tune.groups.values() for run in runs)
    from pipeline.evaluation.monitor import monitor_from_params
    from pipeline.training.relearn import relearn_config

    assert relearn_config(params).train.lora_spec is not None  # every family relearns with LoRA on one GPU
    monitor_from_params(params)


def test_every_family_of_the_paper_and_open_unlearning_has_a_preset():
    overlays = {path.stem for path in (CONFIGS / "models").glob("*.yaml")}
    assert {"llama2-7b-chat", "llama3.2-1b-instruct", "llama3.1-8b-instruct", "qwen2.5-7b-instruct", "qwen3-8b",
            "zephyr-7b-beta", "gemma-2-2b-it", "phi-3.5-mini-instruct"} <= overlays  # and Phi-1.5 without one


EXPERIMENTS = {  # the params file and overlays of the experiments' pipelines (experiments/*/dvc.yaml)
    "demo": ("params.yaml", []),
    "paper": ("configs/paper.yaml", []),
    "corpus": ("configs/paper.yaml", ["configs/corpus.yaml"]),
    "tofu": ("configs/paper.yaml", ["configs/tofu-small.yaml"]),
    "exact_kl": ("configs/paper.yaml", ["configs/exact-kl.yaml"]),
    "heldout": ("configs/paper.yaml", ["configs/heldout.yaml"]),
    "heldout_corpus": ("configs/paper.yaml", ["configs/heldout.yaml", "configs/heldout-corpus.yaml"]),
}


@pytest.mark.parametrize("experiment", list(EXPERIMENTS))
def test_params_and_its_overlays_build_every_stage_config(experiment, monkeypatch):
    """params.yaml as `make demo` reads it, configs/paper.yaml as `make paper` does, and with each overlay of the
    experiments' pipelines."""
    from pipeline.evaluation.config import eval_config
    from pipeline.studies.tuning import TuneConfig
    from pipeline.training.unlearn import run_configs
    from stages.finetune import job_from_params

    params_file, overlays = EXPERIMENTS[experiment]
    params = load_params(REPO / params_file, [REPO / o for o in overlays])
    DataConfig.from_params(section(params, "data"))
    AttributionConfig.from_params(section(params, "attribution"))
    for name in section(params, "finetune.models"):
        job_from_params(params, name)
    for name in section(params, "unlearn.runs"):
        run_configs(params, name)
    eval_config(params)
    from pipeline.evaluation.inputs import load_inputs
    from pipeline.evaluation.monitor import monitor_from_params
    from pipeline.training.relearn import relearn_config

    relearn_config(params)
    assert monitor_from_params(params).cfg.every > 0
    if experiment == "tofu" and (REPO.parent / "shared" / "data" / "tofu").is_dir():
        monkeypatch.chdir(REPO / "experiments")  # where its stages run: data.source is relative to it
        load_inputs(eval_config(params), None)  # the probe sets, holdout and paraphrases of real TOFU are there
    TuneConfig.from_params(section(params, "tune"))
    table = section(params, "report.table")
    assert set(table) <= set(section(params, "unlearn.runs"))
    if experiment == "corpus":
        assert params["attribution"]["mode"] == "corpus" and params["unlearn"]["defaults"]["retain_corpus"]
        assert len(table) == 12 and params["unlearn"]["runs"]["ga"]["method"] == "ga"
    if experiment == "heldout_corpus":
        assert params["attribution"]["mode"] == "corpus" and params["data"]["source"] == "artifacts/heldout/world"
    if experiment == "exact_kl":
        assert all(run_configs(params, name)[0].retain_reference == "model" for name in table)
    if experiment == "tofu":
        assert job_from_params(params, "target").init == "artifacts/tofu/models/base"
        assert eval_config(params).multiple_choice == {}


@pytest.mark.parametrize("rung,millions", [("3m", 3.67), ("30m", 29.4), ("150m", 158.4)])
def test_the_seeds_and_ladder_overlays_build_their_stage_configs(rung, millions):
    """experiments/seeds (configs/paper.yaml, overlay configs/seeds.yaml) and experiments/ladder (overlays
    tofu-small, the rung's, seeds; and configs/ladder.yaml for its report): every run configured, the tuning a
    bisection, no paraphrase probe, no membership inference and no quantization probes (null switches them off), and
    each rung the size docs/reproducibility.md gives."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline.evaluation.config import eval_config
    from pipeline.studies.tuning import TuneConfig
    from pipeline.training.unlearn import run_configs

    seeds = ["configs/seeds.yaml"]
    ladder = ["configs/tofu-small.yaml", f"configs/ladder-{rung}.yaml", "configs/seeds.yaml", "configs/ladder.yaml"]
    for overlays in (seeds, ladder):
        params = load_params(CONFIGS / "paper.yaml", [REPO / o for o in overlays])
        tune = TuneConfig.from_params(section(params, "tune"))
        assert tune.search == "bisect" and tune.bisect_config.max_trials >= 2
        cfg = eval_config(params)
        assert not cfg.paraphrase and not cfg.mia and not cfg.quantize
        experiment = section(params, "seeds" if overlays is seeds else "ladder")
        for name in experiment["runs"]:
            run_configs(params, name)
    assert rung in section(params, "ladder.rungs")
    assert "learned" not in section(params, "attribution.signals")  # real TOFU has no fact annotations to learn from
    config = LlamaConfig(**section(params, "model.config"), vocab_size=4096)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    assert sum(p.numel() for p in model.parameters()) / 1e6 == pytest.approx(millions, rel=0.01)
    assert section(params, "unlearn.methods.rmu.rmu_layer") < config.num_hidden_layers


def test_the_diagnosis_overlay_builds_its_runs_and_the_seeds_recipe_memorises_by_loss():
    """experiments/diagnosis (configs/paper.yaml, overlays seeds and diagnosis): its own runs weight by the fact
    annotations, the runs it compares are make seeds' runs, and the seeds' target and retain stop on their loss."""
    from pipeline.training.finetune import job_from_params
    from pipeline.training.unlearn import run_configs

    params = load_params(CONFIGS / "paper.yaml", [CONFIGS / "seeds.yaml", CONFIGS / "diagnosis.yaml"])
    diagnosis = section(params, "diagnosis")
    for name in diagnosis["runs"]:
        assert run_configs(params, name)[0].score == "oracle"
    assert set(diagnosis["compare"]) <= set(section(params, "seeds.runs"))
    for model in ("target", "retain"):
        job = job_from_params(params, model)
        assert job.stop_loss == 0.02 and job.train.epochs == 60
    assert job_from_params(params, "base").stop_loss is None


def test_the_methods_overlay_runs_every_method_three_ways_at_equal_utility():
    """experiments/methods (configs/paper.yaml, overlays seeds and methods): every registered method sequence level
    (M), hard (t_M) and soft (s_M) by the chosen training-free score, IdkNLL uniform only; every run configured, its
    lr bisected; stage one keeps what the new methods read, UNDIAL's teacher over the whole vocabulary."""
    from pipeline.evaluation.config import eval_config
    from pipeline.training.methods import METHODS
    from pipeline.studies.tuning import TuneConfig
    from pipeline.training.unlearn import run_configs

    params = load_params(CONFIGS / "paper.yaml", [CONFIGS / "seeds.yaml", CONFIGS / "methods.yaml"])
    seeds = section(params, "seeds")
    assert seeds["models"] == [0] and section(params, "unlearn.seeds") == [0, 1, 2]
    expected = {m: ["uniform"] if not spec.token_weights else ["uniform", "hard", "soft"]
                for m, spec in METHODS.items()}
    found: dict[str, list[str]] = {}
    for name in seeds["runs"]:
        cfg, train = run_configs(params, name)
        prefix = {"uniform": "", "hard": "t_", "soft": "s_"}[cfg.weighting]
        assert name == prefix + cfg.method, f"configs/methods.yaml: run {name} is {cfg.method}, {cfg.weighting}"
        assert cfg.weighting == "uniform" or cfg.score == "entropy+nocopy+span"
        own = METHODS[cfg.method].own_retain  # GradDiff's NLL with λ = 1, PDU's NLL under its dual from 100
        assert (cfg.retain_loss, cfg.retain_weight) == (own if own else ("kl", 0.1))
        assert train.lr > 0
        found.setdefault(cfg.method, []).append(cfg.weighting)
    assert found == expected, "configs/methods.yaml: seeds.runs must run every registered method three ways"
    attribution = AttributionConfig.from_params(section(params, "attribution"))
    assert set(attribution.alternatives) == {"idk", "perturbed"} and {"copy", "span"} <= set(attribution.signals)
    assert attribution.teacher_top_k >= section(params, "tokenizer.vocab_size")  # UNDIAL's loss exact
    assert TuneConfig.from_params(section(params, "tune")).search == "bisect"
    cfg = eval_config(params)
    assert not cfg.paraphrase and not cfg.mia and not cfg.quantize
    # experiments/methods/dvc.yaml tracks configs/seeds.yaml's unlearn.monitor alone: none of its runs is one of these
    assert not set(read_overlay(CONFIGS / "seeds.yaml")["unlearn"]["runs"]) & set(seeds["runs"])
