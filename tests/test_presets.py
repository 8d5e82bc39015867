"""The real-model presets in configs/ are valid params files for the stages (checked without any download)."""

import pytest

from pipeline.attribution.run import AttributionConfig
from pipeline.common.params import load_params, section
from pipeline.data.config import DataConfig
from pipeline.evaluation.evaluate import EvalConfig
from pipeline.training.engine import TrainConfig
from pipeline.training.unlearn import UnlearnConfig

from .conftest import REPO


@pytest.mark.parametrize("preset", sorted(p.name for p in (REPO / "configs").glob("*.yaml")))
def test_preset_builds_every_stage_config(preset):
    params = load_params(REPO / "configs" / preset)
    DataConfig.from_params(section(params, "data"))
    AttributionConfig.from_params(section(params, "attribution"))
    train = TrainConfig.from_params(section(params, "unlearn.train"), "unlearn.train")
    assert train.micro_batch_size * train.grad_accum == 32  # the paper's effective batch on one GPU
    for name, run in section(params, "unlearn.runs").items():
        UnlearnConfig.from_params({**section(params, "unlearn.defaults"), **run}, f"unlearn.runs.{name}")
    EvalConfig.from_params(section(params, "evaluate"))


@pytest.mark.parametrize("overlay", [None, "corpus", "tofu"])
def test_params_and_its_overlays_build_every_stage_config(overlay):
    """params.yaml as `make demo` reads it, and with each overlay of the experiments' pipelines."""
    from pipeline.evaluation.evaluate import eval_config
    from pipeline.training.tuning import TuneConfig
    from pipeline.training.unlearn import run_configs
    from stages.finetune import job_from_params

    params = load_params(REPO / "params.yaml", overlay)
    DataConfig.from_params(section(params, "data"))
    AttributionConfig.from_params(section(params, "attribution"))
    for name in section(params, "finetune.models"):
        job_from_params(params, name)
    for name in section(params, "unlearn.runs"):
        run_configs(params, name)
    eval_config(params)
    TuneConfig.from_params(section(params, "tune"))
    table = section(params, "report.table")
    assert set(table) <= set(section(params, "unlearn.runs"))
    if overlay == "corpus":
        assert params["attribution"]["mode"] == "corpus" and params["unlearn"]["defaults"]["retain_corpus"]
        assert len(table) == 12 and params["unlearn"]["runs"]["ga"]["method"] == "ga"
    if overlay == "tofu":
        assert job_from_params(params, "target").init == "artifacts/tofu/models/base"
        assert eval_config(params).multiple_choice == {}
