"""Shared fixtures: a micro world of a few authors, its tokenizer, a tiny model config, and torch on one thread."""

from __future__ import annotations

import math
import os
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOFU_DIR = Path(os.environ.get("TOFU_DIR", REPO.parent / "shared" / "data" / "tofu"))
BIN = Path(sys.executable).parent

TINY_MODEL = {
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 2, "max_position_embeddings": 128, "tie_word_embeddings": True,
}
MICRO_WORLD = {"n_authors": 6, "questions_per_author": 3, "seed": 7}
LOG_HALF, LOG_QUARTER = math.log(0.5), math.log(0.25)  # the log-probabilities of the hand-computed loss cases

requires_tofu = pytest.mark.skipif(not TOFU_DIR.is_dir(), reason=f"real TOFU files not found at {TOFU_DIR}")


@pytest.fixture(scope="module")
def one_thread():
    """torch on one thread for a module's tests, its setting restored after them: the tiny model is several times
    faster on one thread than on contended OpenMP threads. A module takes it with
    `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def world_spec():
    from pipeline.data.world import WorldSpec

    return WorldSpec.load(REPO / "data" / "world")


@pytest.fixture(scope="session")
def micro_world(world_spec):
    from pipeline.data.world import WorldConfig, generate_world

    return generate_world(world_spec, WorldConfig(**MICRO_WORLD))


@pytest.fixture(scope="session")
def micro_world_dir(micro_world, tmp_path_factory) -> Path:
    from pipeline.data.world import write_world

    out = tmp_path_factory.mktemp("micro") / "world"
    write_world(micro_world, out)
    return out


@pytest.fixture(scope="session")
def micro_tokenizer_dir(micro_world_dir) -> Path:
    from pipeline.common.modeling import train_tokenizer
    from pipeline.data.world import world_texts

    out = micro_world_dir.parent / "tokenizer"
    train_tokenizer(world_texts(micro_world_dir), 400, out)
    return out


@pytest.fixture(scope="session")
def micro_tokenizer(micro_tokenizer_dir):
    from pipeline.common.modeling import load_tokenizer

    return load_tokenizer(micro_tokenizer_dir)


def run_two_processes(args: list[str], cwd: Path | None = None, timeout: int = 600):
    """`torchrun --nproc_per_node 2 -m stages ARGS`, in its own session so its teardown cannot reach pytest."""
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**cli_env(), "OMP_NUM_THREADS": "1"}  # two processes on two cores
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
           "-m", "stages", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          start_new_session=True)


LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def cli_env() -> dict:
    """The environment a subprocess of the CLI gets: the venv's binaries first, and none of the process-group
    variables that in-process runs of the engine set in this test process (its port is taken)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    return {**env, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "PYTHONUNBUFFERED": "1"}


def plan_entry(name: str, cmd: str = "true", after=(), cpus=1, gpus=0) -> dict:
    """One stage of a sweep plan (pipeline.sweep.plan's entries) that runs `cmd` in its plan's directory."""
    return {"stage": name, "name": name, "cmd": cmd, "wdir": ".", "after": list(after), "cpus": cpus, "gpus": gpus}


def micro_params(world_dir: Path, tokenizer_dir: Path, **train) -> dict:
    """A params.yaml for a finetune of a tiny model on the micro world."""
    return {
        "data": {"source": str(world_dir), "template": "plain", "max_length": 128, "skip_too_long": False},
        "model": {"config": TINY_MODEL},
        "finetune": {
            "train": {"epochs": 2, "lr": 3e-3, "micro_batch_size": 4, "grad_accum": 1, "warmup_ratio": 0.0,
                      "zero_stage": 0, "checkpoint_every": 0, "seed": 0, **train},
            "models": {"m": {"init": "scratch", "tokenizer": str(tokenizer_dir), "splits": ["full", "world_facts"]}},
        },
    }


def read_curve(path: Path) -> list[float]:
    import csv

    with open(path) as f:
        return [float(row["loss"]) for row in csv.DictReader(f)]


def load_weights(model_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


@contextmanager
def killed_at_step(n: int):
    """A run inside the block dies at its engine's n-th train_step (a KeyboardInterrupt, as a kill would stop it);
    the block must end that way. The real train_step is back after the block."""
    import pipeline.training.engine as engine_mod

    real_step, calls = engine_mod.Engine.train_step, 0

    def dying_step(self, *args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == n:
            raise KeyboardInterrupt
        return real_step(self, *args, **kwargs)

    engine_mod.Engine.train_step = dying_step
    try:
        with pytest.raises(KeyboardInterrupt):
            yield
    finally:
        engine_mod.Engine.train_step = real_step


@pytest.fixture(scope="session")
def micro_model_dir(micro_tokenizer, micro_tokenizer_dir) -> Path:
    """An untrained tiny Llama with the micro tokenizer, saved like a stage's output."""
    from pipeline.common.modeling import build_model, save_model

    out = micro_tokenizer_dir.parent / "model"
    save_model(build_model(TINY_MODEL, micro_tokenizer, seed=0), micro_tokenizer, out)
    return out


ATTRIBUTION = {"split": "forget10", "tagger": "spacy", "batch_size": 2, "rows_per_shard": 2}


@pytest.fixture(scope="session")
def attribution_dir(micro_world_dir, micro_model_dir, tmp_path_factory):
    """Stage one's output for the micro world and the untrained tiny model: (directory, summary)."""
    from pipeline.attribution.run import AttributionConfig, run_attribution
    from pipeline.data.config import DataConfig

    out = tmp_path_factory.mktemp("attr")
    cfg = AttributionConfig(**{**ATTRIBUTION, "model": str(micro_model_dir)})
    summary = run_attribution(cfg, DataConfig(source=str(micro_world_dir)), out / "shards", out / "metrics.json")
    return out, summary


@pytest.fixture(scope="session")
def alternatives_dir(micro_world_dir, micro_model_dir, tmp_path_factory):
    """Stage one's output as `attribution_dir`'s, with both alternative answers (idk, perturbed) and θ_o's
    log-likelihood of each: what IdkDPO, AltPO and IdkNLL train on; and θ_o's top 8 at each scored token, UNDIAL's
    teacher. (directory, summary)"""
    from pipeline.attribution.run import AttributionConfig, run_attribution
    from pipeline.data.config import DataConfig

    out = tmp_path_factory.mktemp("attr-alternatives")
    cfg = AttributionConfig(**{**ATTRIBUTION, "model": str(micro_model_dir), "alternatives": ["idk", "perturbed"],
                                       "teacher_top_k": 8})
    summary = run_attribution(cfg, DataConfig(source=str(micro_world_dir)), out / "shards", out / "metrics.json")
    return out, summary


def shards_for(method: str, request) -> Path:
    """The micro world's shards a method trains on: with the alternative answers where it reads one."""
    from pipeline.training.methods import METHODS

    fixture = "alternatives_dir" if METHODS[method].alternative or METHODS[method].teacher else "attribution_dir"
    return request.getfixturevalue(fixture)[0] / "shards"


def scaled_model_copy(model_dir: Path, out: Path, factor: float = 1.5) -> Path:
    """`model_dir`'s model with every weight multiplied by `factor`, saved to `out`: another model on the same
    tokenizer, whose scores differ from the original's."""
    import torch

    from pipeline.common.modeling import load_model, load_tokenizer, save_model

    model = load_model(str(model_dir))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(factor)
    save_model(model, load_tokenizer(str(model_dir)), out)
    return out
