"""Every file and directory the stages write is readable by the other users of a shared artifacts directory under
umask 022, those written by libraries too (safetensors writes through a temporary file of mode 0600)."""

import os
import stat
from pathlib import Path

import pytest

from tests.conftest import ATTRIBUTION, MICRO_WORLD, TINY_MODEL

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

UMASK = 0o022


@pytest.fixture
def umask_022(monkeypatch):
    """The process under umask 022, as a user's shell would start it (the pipeline reads the umask at import);
    the test process's own umask is restored after."""
    import pipeline.common.atomic as atomic
    import pipeline.common.locks as locks

    before = os.umask(UMASK)
    monkeypatch.setattr(atomic, "_UMASK", UMASK)
    monkeypatch.setattr(locks, "_UMASK", UMASK)
    yield
    os.umask(before)


def _run_the_stages(root: Path, world_spec) -> None:
    """World, tokenizer, model, attribution shards, unlearning, two evaluations and the report's tables and plots,
    each written by the stage's own library call."""
    from pipeline.attribution.run import AttributionConfig, run_attribution
    from pipeline.common.atomic import write_json
    from pipeline.common.modeling import build_model, load_tokenizer, save_model, train_tokenizer
    from pipeline.data.config import DataConfig
    from pipeline.data.world import WorldConfig, generate_world, world_texts, write_world
    from pipeline.evaluation.config import EvalConfig
    from pipeline.evaluation.evaluate import evaluate_path
    from pipeline.studies.report import load_rows, write_report
    from pipeline.training.engine import TrainConfig
    from pipeline.training.run_config import UnlearnConfig
    from pipeline.training.unlearn import run_unlearn

    world = root / "world"
    write_world(generate_world(world_spec, WorldConfig(**MICRO_WORLD)), world)
    train_tokenizer(world_texts(world), 400, root / "tokenizer")
    tokenizer = load_tokenizer(root / "tokenizer")
    save_model(build_model(TINY_MODEL, tokenizer, seed=0), tokenizer, root / "model")
    data = DataConfig(source=str(world))
    run_attribution(AttributionConfig(**{**ATTRIBUTION, "model": str(root / "model")}), data, root / "attr" / "shards",
                    root / "attr" / "metrics.json")
    train = TrainConfig.from_params({"epochs": 1, "lr": 1e-3, "micro_batch_size": 2, "warmup_ratio": 0.0, "seed": 0},
                                    "t")
    run_unlearn("u", UnlearnConfig(method="ga", weighting="hard"), train, data, str(root / "model"),
                root / "attr" / "shards", root / "unlearn" / "u", root / "ckpt" / "u", root / "plots" / "u.csv", False)
    cfg = EvalConfig.from_params({"source": str(world), "max_new_tokens": 4, "batch_size": 8,
                                  "multiple_choice": {"world": {"format": "world", "source": str(world)}}}, "evaluate")
    metrics = root / "metrics"
    retain = evaluate_path(str(root / "model"), cfg, root / "eval" / "retain", root / "eval" / "retain",
                           metrics / "retain.json")
    write_json(metrics / "target.json", retain)
    evaluate_path(str(root / "unlearn" / "u" / "model"), cfg, root / "eval" / "u", root / "eval" / "retain",
                  metrics / "u.json")
    write_report(load_rows(metrics, {"u": {"method": "ga", "weighting": "hard"}}), root / "report",
                 root / "plots" / "report")


def test_every_output_is_readable_by_group_and_others_under_umask_022(tmp_path, world_spec, umask_022):
    root = tmp_path / "artifacts"
    _run_the_stages(root, world_spec)
    paths = [root, *sorted(root.rglob("*"))]
    kinds = {p.suffix for p in paths if p.is_file()}
    assert {".safetensors", ".parquet", ".json", ".csv", ".png", ".md"} <= kinds, kinds  # the run wrote them all
    unreadable = []
    for path in paths:
        mode = stat.S_IMODE(path.lstat().st_mode)
        need = 0o055 if path.is_dir() else 0o044  # a directory: listed and entered; a file: read
        if mode & need != need:
            unreadable.append(f"{oct(mode)} {path.relative_to(tmp_path)}")
    assert not unreadable, f"not readable by group and others under umask 022: {unreadable}"
