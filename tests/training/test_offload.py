"""ZeRO-3 with the parameters and the optimizer state offloaded to CPU memory (DeepSpeed's CPU Adam steps them):
two processes end where one does, and where plain ZeRO-0 with torch's AdamW does."""

import subprocess
import sys

import pytest
import torch
import yaml

from pipeline.training.finetune import job_from_params, run_finetune

from tests.conftest import cli_env, killed_at_step, load_weights, micro_params, read_curve, run_two_processes

pytestmark = pytest.mark.slow  # ZeRO-3 offload, on two processes (torchrun) too

OFFLOAD = {"zero_stage": 3, "offload_optimizer": True, "offload_params": True}
TRAIN = {"max_steps": 6, "micro_batch_size": 2}
# Tolerances: fp32 throughout, so two processes differ from one only in the order of sums (two micro-batches
# accumulated in one process, reduce-scattered between two: a two-term sum, exact either way; the clipping norm's
# squares summed per partition, then across them). Against one process launched as the two are (the CLI, which pins
# the CPU kernels before torch loads): bit-equal weights in every run measured; RTOL, ATOL leave room for an
# ulp-level change of the clipping coefficient (an ulp of the largest weight, 0.08, is 7.5e-9; 6 steps of a few).
# Not against a run inside pytest, whose torch was loaded unpinned: on an AVX-512 machine its kernels round
# differently from the CLI's AVX2 ones, and one weight in 33k, whose Adam ratio m/√v is ill-conditioned, moved by
# 2.3e-6 (every other one by less than 1e-7). The CPU Adam against torch's AdamW also rounds its update differently
# (measured 1.4e-6 at most, on such a weight). All are far below what a wrong partition, a lost gradient or a
# skipped step gives: each moves a weight by about lr = 3e-3.
RTOL, ATOL = 1e-5, 1e-6        # two processes against one, on the same CPU kernels
ATOL_ADAM = 1e-5               # DeepSpeed's CPU Adam against torch's AdamW


def _one_process(params: dict, tmp_path, tag: str):
    job = job_from_params(params, "m")
    out = tmp_path / tag
    run_finetune(job, out / "model", out / "ckpt", out / "loss.csv", False)
    return read_curve(out / "loss.csv"), out / "model"


def _cli_finetune(params_file, out, nproc: int) -> None:
    """`finetune m` through the CLI on `nproc` (1 or 2) processes."""
    args = ["finetune", "m", "--params", str(params_file), "--out", str(out / "model"), "--checkpoints",
            str(out / "ckpt"), "--plot", str(out / "loss.csv")]
    if nproc == 2:
        proc = run_two_processes(args)
    else:
        proc = subprocess.run([sys.executable, "-m", "stages", *args], env={**cli_env(), "OMP_NUM_THREADS": "1"},
                              capture_output=True, text=True, timeout=600, start_new_session=True)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_zero3_offload_on_two_processes_ends_where_one_process_does(micro_world_dir, micro_tokenizer_dir, tmp_path,
                                                                     monkeypatch):
    import pipeline.training.engine as engine_mod

    # One process: two micro-batches a step, as the two processes take one each.
    seen = {}
    real_step = engine_mod.Engine.train_step

    def step(self, *args, **kwargs):  # what DeepSpeed built: the CPU Adam, parameters offloaded
        seen["optimizer"] = type(self.engine.optimizer.optimizer).__name__
        seen["offload_param"] = bool(self.engine.zero_offload_param())
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(engine_mod.Engine, "train_step", step)
    one_curve, one = _one_process(micro_params(micro_world_dir, micro_tokenizer_dir, grad_accum=2, **OFFLOAD, **TRAIN),
                                  tmp_path, "one")
    one = load_weights(one)
    assert seen == {"optimizer": "DeepSpeedCPUAdam", "offload_param": True}
    monkeypatch.setattr(engine_mod.Engine, "train_step", real_step)
    plain_curve, plain = _one_process(micro_params(micro_world_dir, micro_tokenizer_dir, grad_accum=2, **TRAIN),
                                      tmp_path, "plain")
    plain = load_weights(plain)
    assert one_curve == pytest.approx(plain_curve, rel=RTOL)  # offloading changes where, not what
    assert plain_curve[-1] < plain_curve[0]

    assert one.keys() == plain.keys()
    for name in one:
        assert torch.allclose(one[name], plain[name], rtol=RTOL, atol=ATOL_ADAM), name

    # Two processes against one, both through the CLI (the same CPU kernels): only the process count differs.
    for nproc, grad_accum in ((1, 2), (2, 1)):
        params_file = tmp_path / f"params{nproc}.yaml"
        params_file.write_text(yaml.safe_dump(micro_params(micro_world_dir, micro_tokenizer_dir, grad_accum=grad_accum,
                                                           **OFFLOAD, **TRAIN)))
        _cli_finetune(params_file, tmp_path / f"cli{nproc}", nproc)
    cli_one, two = load_weights(tmp_path / "cli1" / "model"), load_weights(tmp_path / "cli2" / "model")
    assert read_curve(tmp_path / "cli2" / "loss.csv") == pytest.approx(read_curve(tmp_path / "cli1" / "loss.csv"),
                                                                      rel=RTOL)
    assert read_curve(tmp_path / "cli1" / "loss.csv") == pytest.approx(one_curve, rel=RTOL)
    assert two.keys() == cli_one.keys() == one.keys()
    for name in one:
        assert torch.allclose(two[name], cli_one[name], rtol=RTOL, atol=ATOL), name
        assert torch.allclose(cli_one[name], one[name], rtol=RTOL, atol=ATOL_ADAM), name  # the kernels' rounding


def test_everything_that_saves_memory_at_once(micro_world_dir, micro_tokenizer_dir, micro_model_dir, tmp_path):
    """The 8B recipe on one GPU, small: ZeRO-3, both offloads, activation checkpointing and LoRA adapters written as
    an adapter; it loads as the model that plain LoRA training (ZeRO-0, torch's AdamW) gives."""
    from pipeline.common.modeling import load_model

    lora = {"r": 4, "alpha": 8}
    runs = {}
    for tag, extra in {"plain": {"lora": lora},
                       "all": {**OFFLOAD, "gradient_checkpointing": True, "lora": {**lora, "save": "adapter"}}}.items():
        params = micro_params(micro_world_dir, micro_tokenizer_dir, **TRAIN, lr=1e-2, **extra)
        params["finetune"]["models"]["m"]["init"] = str(micro_model_dir)
        runs[tag] = _one_process(params, tmp_path, tag)[0]
    assert runs["all"] == pytest.approx(runs["plain"], rel=RTOL)
    assert (tmp_path / "all" / "model" / "adapter_model.safetensors").is_file()
    merged, plain = load_model(tmp_path / "all" / "model").state_dict(), load_weights(tmp_path / "plain" / "model")
    for name in plain:
        assert torch.allclose(merged[name], plain[name], rtol=RTOL, atol=ATOL_ADAM), name


def test_the_offload_overlay_adds_offload_to_a_familys():
    from pipeline.common.params import load_params
    from pipeline.training.unlearn import run_configs

    from tests.conftest import REPO

    params = load_params(REPO / "configs" / "tofu.yaml",
                         [REPO / "configs" / "models" / "llama3.1-8b-instruct.yaml", REPO / "configs" / "offload.yaml"])
    _, train = run_configs(params, "npo")
    assert (train.zero_stage, train.offload_params, train.offload_optimizer) == (3, True, True)
    assert job_from_params(params, "target").train.offload_params


@pytest.mark.parametrize("stage", [1, 2])
def test_optimizer_offload_at_zero_1_and_2_trains_as_torchs_adamw(micro_world_dir, micro_tokenizer_dir, tmp_path,
                                                                  stage):
    offloaded, model = _one_process(micro_params(micro_world_dir, micro_tokenizer_dir, zero_stage=stage,
                                                 offload_optimizer=True, **TRAIN), tmp_path, "offloaded")
    plain, plain_model = _one_process(micro_params(micro_world_dir, micro_tokenizer_dir, **TRAIN), tmp_path, "plain")
    assert offloaded == pytest.approx(plain, rel=RTOL)
    weights, expected = load_weights(model), load_weights(plain_model)
    for name in expected:
        assert torch.allclose(weights[name], expected[name], rtol=RTOL, atol=ATOL_ADAM), name


def test_a_killed_offloaded_run_resumes_to_the_same_weights(micro_world_dir, micro_tokenizer_dir, tmp_path):
    """The CPU Adam's state and the offloaded partitions go into the checkpoint and come back (read with the
    weights-only loader's allow-list). Equal to the last bits only: the CPU Adam keeps β^t as a running float
    product, and after a resume computes it once with pow (measured: 1.2e-7 at most on the weights)."""
    params = micro_params(micro_world_dir, micro_tokenizer_dir, **OFFLOAD, **TRAIN, checkpoint_every=2)
    full_curve, full = _one_process(params, tmp_path, "full")
    with killed_at_step(4):  # after the checkpoint at step 2, and one more step
        _one_process(params, tmp_path, "resumed")
    job = job_from_params(params, "m")
    out = tmp_path / "resumed"
    run_finetune(job, out / "model", out / "ckpt", out / "loss.csv", resume=True)
    assert read_curve(out / "loss.csv") == pytest.approx(full_curve, rel=RTOL)
    full, resumed = load_weights(full), load_weights(out / "model")
    for name in full:
        assert torch.allclose(full[name], resumed[name], rtol=RTOL, atol=ATOL), name
