"""Faults and wrong input that used to hang or give a silently wrong result: build locks of killed runs, params of
the wrong type, a file as a data source, samples past the model's positions, seeds written by several calls into one
output, the user's umask, leftovers of killed runs, and the last line of defence against a traceback."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import click
import pytest

from pipeline.common.atomic import atomic_dir, atomic_file, remove_leftovers
from pipeline.common.errors import DataError, ParamError, TokenUnlearnError

from tests.test_bad_input import one_error_line, run_cli

# ---- torch's JIT build lock -----------------------------------------------------------------------------------

HOLD_LOCK = """
import sys, time
from pipeline.common.distributed import _OwnedBaton
assert _OwnedBaton(sys.argv[1]).try_acquire()
print("held", flush=True)
time.sleep(60)
"""


def _holder(lock):
    proc = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(lock)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_build_lock_whose_owner_was_killed_is_broken_and_a_live_ones_is_kept(tmp_path, caplog):
    from pipeline.common.distributed import _OwnedBaton

    lock = tmp_path / "cpu_adam" / "lock"
    lock.parent.mkdir()
    proc = _holder(lock)
    try:
        assert not _OwnedBaton(str(lock)).try_acquire()  # its owner is alive: wait for it, as torch does
    finally:
        proc.send_signal(signal.SIGKILL)  # a real kill, in the middle of a "build"
        proc.wait()
    assert lock.read_text() == f"{socket.gethostname()} {proc.pid}"
    baton = _OwnedBaton(str(lock))
    assert baton.try_acquire()  # the dead owner's lock is broken: this process builds
    assert "removed the build lock" in caplog.text and f"pid {proc.pid}" in caplog.text
    baton.release()
    assert not lock.exists()


def test_a_waiter_whose_builder_dies_stops_with_one_line_instead_of_waiting_forever(tmp_path):
    from pipeline.common.distributed import _OwnedBaton

    lock = tmp_path / "lock"
    proc = _holder(lock)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    with pytest.raises(TokenUnlearnError, match="died before it finished; its lock is removed: run the command again"):
        _OwnedBaton(str(lock)).wait()


def test_an_empty_lock_is_broken_only_once_older_than_any_build(tmp_path):
    from pipeline.common.locks import stale_lock_owner

    lock = tmp_path / "lock"
    lock.touch()  # torch's own baton writes no owner
    assert stale_lock_owner(lock, 600) is None
    old = time.time() - 700
    os.utime(lock, (old, old))
    assert stale_lock_owner(lock, 600).startswith("an empty lock")
    lock.write_text("another-host 1")  # another machine's build: it cannot be told from here
    assert stale_lock_owner(lock, 600) is None


def test_every_jit_build_takes_the_owned_lock():
    import torch.utils.cpp_extension as cpp_extension

    from pipeline.common.distributed import _OwnedBaton, _prepare_environment

    _prepare_environment()
    assert cpp_extension.FileBaton is _OwnedBaton


# ---- params of the wrong type -----------------------------------------------------------------------------------

def test_a_list_or_union_param_of_the_wrong_type_names_its_key():
    from dataclasses import dataclass, field

    from pipeline.common.params import dataclass_from_params

    @dataclass
    class Config:
        splits: list[str] = field(default_factory=list)
        layers: list[int] = field(default_factory=lambda: [1])
        model: str | None = None

    assert dataclass_from_params(Config, {"splits": ["a"], "layers": [2], "model": None}, "x").layers == [2]
    with pytest.raises(ParamError, match=r"x.splits='forget10': expected list\[str\]"):
        dataclass_from_params(Config, {"splits": "forget10"}, "x")
    with pytest.raises(ParamError, match=r"x.layers=\[1.5\]: expected list\[int\]"):
        dataclass_from_params(Config, {"layers": [1.5]}, "x")
    with pytest.raises(ParamError, match=r"x.model=3: expected str \| null"):
        dataclass_from_params(Config, {"model": 3}, "x")


@pytest.mark.parametrize("seeds", [0, [], [0, 0], ["a"], [True], None])
def test_seeds_are_a_list_of_distinct_integers(seeds):
    from pipeline.training.unlearn import check_seeds

    with pytest.raises(ParamError, match=r"unlearn.seeds=.*: expected a non-empty list of distinct integers"):
        check_seeds(seeds)
    assert check_seeds([2, 0]) == [2, 0]


# ---- data -------------------------------------------------------------------------------------------------------

def test_a_file_as_data_source_is_refused_rather_than_read_for_every_split(micro_world_dir):
    from pipeline.data.tofu import load_split

    with pytest.raises(DataError, match=r"forget10.json'?: a file, not a directory; data.source is a directory"):
        load_split(micro_world_dir / "forget10.json", "retain90")


def test_max_length_past_the_models_positions_is_refused(micro_model_dir, micro_tokenizer):
    from pipeline.common.modeling import check_vocab, load_model

    model = load_model(micro_model_dir)
    limit = model.config.max_position_embeddings
    check_vocab(model, micro_tokenizer, "m", limit)
    with pytest.raises(ParamError, match=rf"data.max_length={limit + 1}: longer than m's position limit \({limit}"):
        check_vocab(model, micro_tokenizer, "m", limit + 1)


# ---- seeds written by several calls into one output ---------------------------------------------------------------

def test_seeds_of_separate_calls_are_all_recorded_and_other_params_seeds_left_out(
        attribution_dir, micro_model_dir, micro_world_dir, tmp_path, caplog):
    from dataclasses import replace

    from pipeline.common.runs import complete_seeds
    from pipeline.data.config import DataConfig
    from pipeline.training.engine import TrainConfig
    from pipeline.training.unlearn import UnlearnConfig, run_unlearn_seeds

    cfg = UnlearnConfig.from_params({"method": "ga", "weighting": "hard", "rmu_layer": 2}, "u")
    train = TrainConfig.from_params({"epochs": 1, "lr": 1e-3, "micro_batch_size": 4, "warmup_ratio": 0.0}, "t")

    def run(seeds, train=train):
        run_unlearn_seeds("ga", cfg, train, DataConfig(source=str(micro_world_dir)), str(micro_model_dir),
                          attribution_dir[0] / "shards", tmp_path / "ga", tmp_path / "ckpt", tmp_path / "plots",
                          seeds=seeds, resume=True)
        return sorted(complete_seeds(tmp_path / "ga"))

    assert run([0]) == [0]
    assert run([1]) == [0, 1]  # `--seed 1` after `--seed 0`: both are the run's
    assert run([2], replace(train, lr=2e-3)) == [2]  # other params: the earlier seeds are not this run's
    assert "seeds [0, 1] in" in caplog.text and "made with other params" in caplog.text


# ---- outputs: the umask, leftovers of killed runs ----------------------------------------------------------------

@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_outputs_follow_the_users_umask(tmp_path, monkeypatch, umask):
    import pipeline.common.atomic as atomic

    monkeypatch.setattr(atomic, "_UMASK", umask)
    with atomic_dir(tmp_path / "d") as d:
        (d / "x").write_text("1")
    with atomic_file(tmp_path / "f") as f:
        f.write("1")
    assert (tmp_path / "d").stat().st_mode & 0o777 == 0o777 & ~umask
    assert (tmp_path / "f").stat().st_mode & 0o777 == 0o666 & ~umask


def test_the_next_run_removes_what_killed_runs_left_and_keeps_a_live_runs(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    left = tmp_path / f".model.tmp-{host}-{dead.pid}-abc"
    (left / "sub").mkdir(parents=True)
    old = tmp_path / f".model.old-{dead.pid}"
    old.mkdir()
    live = tmp_path / f".model.tmp-{host}-{os.getpid()}-xyz"
    live.mkdir()
    other = tmp_path / f".model.tmp-elsewhere-{dead.pid}-abc"  # another machine's, on a shared disk
    other.mkdir()
    with atomic_dir(tmp_path / "model") as d:
        (d / "w").write_text("1")
    assert not left.exists() and not old.exists()
    assert live.exists() and other.exists() and (tmp_path / "model" / "w").is_file()
    assert remove_leftovers(tmp_path / "model") == []


# ---- the last line of defence ------------------------------------------------------------------------------------

@pytest.fixture
def failing_command():
    from stages.cli import cli

    box = {}

    @click.command("fail-for-test")
    def command():
        raise box["error"]

    cli.add_command(command)
    yield box
    cli.commands.pop("fail-for-test")


def test_an_unexpected_error_is_one_line_and_a_traceback_only_with_verbose(failing_command, capsys):
    failing_command["error"] = KeyError("column 'phi'")
    status, err = run_cli(["fail-for-test"], capsys)
    assert status == 1
    assert "unexpected KeyError: \"column 'phi'\" (a bug, or an input no check caught: run again with -v" in \
        one_error_line(err)
    with pytest.raises(KeyError):
        run_cli(["-v", "fail-for-test"], capsys)


def test_a_real_full_disk_in_a_library_that_raises_its_own_exception_is_one_line(failing_command, tmp_path,
                                                                                   capsys):
    import torch
    from safetensors.torch import save_file

    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)],
                      capture_output=True).returncode != 0:
        pytest.skip("no tmpfs can be mounted here (needs root)")
    try:
        with pytest.raises(Exception) as caught:
            with atomic_dir(disk / "model") as d:
                save_file({"w": torch.zeros(64, 1024)}, str(d / "model.safetensors"))
        assert not isinstance(caught.value, OSError)  # safetensors' own SafetensorError
        assert not any(disk.iterdir())  # nothing half-written
        failing_command["error"] = caught.value
        status, err = run_cli(["fail-for-test"], capsys)
    finally:
        subprocess.run(["umount", str(disk)], check=True)
    assert status == 2 and "no space left on device" in one_error_line(err)
    assert json.dumps(err)  # one plain line


def test_weights_given_another_tokenizer_of_the_same_size_are_refused(micro_model_dir, tmp_path):
    import shutil

    from pipeline.common.modeling import check_vocab, load_model, load_tokenizer

    model_dir = tmp_path / "model"
    shutil.copytree(micro_model_dir, model_dir)
    check_vocab(load_model(model_dir), load_tokenizer(model_dir), "m")
    spec = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = sorted(vocab)[-2:]  # two tokens trade ids: the same size, another tokenizer
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (model_dir / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(DataError, match=r"m: the tokenizer's vocabulary .* is not the one the model was written with"):
        check_vocab(load_model(model_dir), load_tokenizer(model_dir), "m")


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/null"])
def test_a_split_that_links_to_a_device_is_one_line_not_a_read_forever(micro_world_dir, tmp_path, device):
    import shutil

    from pipeline.data.tofu import load_split

    world = tmp_path / "world"
    shutil.copytree(micro_world_dir, world)
    (world / "forget10.json").unlink()
    (world / "forget10.json").symlink_to(device)
    with pytest.raises(DataError, match=r"forget10.json: not a regular file \(a device, a pipe or a directory\)"):
        load_split(world, "forget10")
