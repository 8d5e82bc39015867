"""The DeepSpeed engine: ZeRO 0 and 2 in one CPU process, resume, and a run with two processes."""

from pathlib import Path

import pytest
import torch
import yaml

from pipeline.common.errors import ParamError
from pipeline.data.batching import StepSchedule, pad_batch
from pipeline.data.templates import IGNORE_INDEX, TEMPLATES, encode_qa
from pipeline.training.engine import TrainConfig, deepspeed_config, lr_schedule
from pipeline.training.finetune import job_from_params, run_finetune

from tests.conftest import killed_at_step, load_weights, micro_params, read_curve, run_two_processes


def test_schedule_covers_every_sample_once_per_epoch_and_splits_ranks():
    sched = StepSchedule(n_samples=10, micro_batch_size=2, grad_accum=2, world_size=2, seed=3)
    assert sched.global_batch == 8 and sched.steps_per_epoch == 2
    epoch0 = [i for step in range(2) for r in range(2) for mb in sched.micro_batches(step, r) for i in mb]
    assert set(epoch0) == set(range(10)) and len(epoch0) == 16  # the last step wraps around
    step0 = [sched.micro_batches(0, r) for r in range(2)]
    assert not set(sum(step0[0], [])) & set(sum(step0[1], []))
    # One process with accum*world micro-batches sees the same samples at each step.
    single = StepSchedule(10, 2, 4, 1, 3)
    for step in range(4):
        both = sorted(sum(sched.micro_batches(step, 0) + sched.micro_batches(step, 1), []))
        assert both == sorted(sum(single.micro_batches(step, 0), []))
    assert sched.micro_batches(2, 0) != sched.micro_batches(0, 0)  # a new permutation each epoch


def test_pad_batch_right_and_left(micro_tokenizer):
    a = encode_qa(micro_tokenizer, TEMPLATES["plain"], "Who?", "Ana.")
    b = encode_qa(micro_tokenizer, TEMPLATES["plain"], "Where was Ana Bell born?", "In Varo, Eldmark.")
    pad = micro_tokenizer.pad_token_id
    right = pad_batch([a, b], pad)
    assert right["input_ids"][0, : len(a)].tolist() == a.input_ids
    assert (right["input_ids"][0, len(a):] == pad).all() and (right["labels"][0, len(a):] == IGNORE_INDEX).all()
    left = pad_batch([a, b], pad, left=True)
    assert left["input_ids"][0, -len(a):].tolist() == a.input_ids and left["attention_mask"][0].sum() == len(a)


def test_deepspeed_config_from_params():
    cfg = TrainConfig.from_params({"lr": 1e-4, "micro_batch_size": 2, "grad_accum": 4, "zero_stage": 3,
                                   "warmup_ratio": 0.1}, "t")
    ds = deepspeed_config(cfg, world_size=2, total_steps=50)
    assert ds["train_batch_size"] == 16
    assert ds["zero_optimization"]["stage"] == 3
    schedule = lr_schedule(cfg, 50)(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-4))
    lrs = []
    for _ in range(50):
        lrs.append(schedule.get_last_lr()[0])
        schedule.step()
    assert lrs[0] == 0 and lrs[5] == pytest.approx(1e-4) and lrs[49] == pytest.approx(1e-4 / 45)
    assert ds["bf16"]["enabled"] is torch.cuda.is_available()
    with pytest.raises(ParamError, match="t.zero_stage=4"):
        TrainConfig.from_params({"zero_stage": 4}, "t")
    with pytest.raises(ParamError, match="unknown parameter"):
        TrainConfig.from_params({"learning_rate": 1}, "t")


def _finetune(params, tmp_path, tag, resume=False):
    job = job_from_params(params, "m")
    run_finetune(job, tmp_path / tag / "model", tmp_path / tag / "ckpt", tmp_path / tag / "loss.csv", resume)
    return read_curve(tmp_path / tag / "loss.csv"), load_weights(tmp_path / tag / "model")


def test_zero0_and_zero2_train_the_same_in_one_process(micro_world_dir, micro_tokenizer_dir, tmp_path):
    curves = {}
    for stage in (0, 2):
        params = micro_params(micro_world_dir, micro_tokenizer_dir, zero_stage=stage, epochs=3)
        curves[stage], _ = _finetune(params, tmp_path, f"z{stage}")
    assert curves[0] == pytest.approx(curves[2], rel=1e-4)
    assert curves[0][-1] < 0.8 * curves[0][0]  # it learns
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "z2" / "model")
    assert model.config.hidden_size == 32


def test_a_killed_run_resumed_ends_with_the_same_weights(micro_world_dir, micro_tokenizer_dir, tmp_path):
    params = micro_params(micro_world_dir, micro_tokenizer_dir, zero_stage=2, checkpoint_every=3, epochs=2)
    full_curve, full_weights = _finetune(params, tmp_path, "uninterrupted")

    with killed_at_step(5):  # after the checkpoint at step 3
        _finetune(params, tmp_path, "resumed")
    assert not (tmp_path / "resumed" / "model").exists()  # no half-written model
    curve, weights = _finetune(params, tmp_path, "resumed", resume=True)
    assert curve == full_curve
    assert weights.keys() == full_weights.keys()
    for name in weights:
        assert torch.equal(weights[name], full_weights[name]), name
    assert not (tmp_path / "resumed" / "ckpt").exists()  # checkpoints are dropped after success


def test_a_cut_checkpoint_falls_back_to_the_one_before_it_and_none_readable_says_how_to_start_over(
        micro_world_dir, micro_tokenizer_dir, tmp_path):
    from pipeline.training.checkpoints import CheckpointUnreadable

    params = micro_params(micro_world_dir, micro_tokenizer_dir, checkpoint_every=2, epochs=2)
    full_curve, full_weights = _finetune(params, tmp_path, "uninterrupted")
    with killed_at_step(6):  # checkpoints at steps 2 and 4
        _finetune(params, tmp_path, "resumed")
    ckpt = tmp_path / "resumed" / "ckpt"
    assert (ckpt / "latest").read_text().strip() == "step4"
    kept = {f: f.read_bytes() for f in (ckpt / "step2").rglob("*.pt")}
    for f in (ckpt / "step4").rglob("*model_states.pt"):  # a kill mid-save: the file cut short
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    curve, weights = _finetune(params, tmp_path, "resumed", resume=True)  # from step 2, to the same end
    assert curve == full_curve
    for name in weights:
        assert torch.equal(weights[name], full_weights[name]), name
    with killed_at_step(3):  # again, then every checkpoint cut: the error names the directory and the fix
        _finetune(params, tmp_path, "again")
    for f in (tmp_path / "again" / "ckpt").rglob("*model_states.pt"):
        f.write_bytes(b"")
    with pytest.raises(CheckpointUnreadable, match=r"again/ckpt: no checkpoint there can be read .*--no-resume"):
        _finetune(params, tmp_path, "again", resume=True)
    assert kept  # step 2 was there to fall back on


@pytest.mark.slow
def test_two_processes_zero3_match_one_process(micro_world_dir, micro_tokenizer_dir, tmp_path):
    # Two processes with one micro-batch each see, per step, the samples one process sees in two.
    single, _ = _finetune(micro_params(micro_world_dir, micro_tokenizer_dir, grad_accum=2), tmp_path, "one")
    params_file = tmp_path / "params.yaml"
    params_file.write_text(yaml.safe_dump(micro_params(micro_world_dir, micro_tokenizer_dir, zero_stage=3)))
    out = tmp_path / "two"
    proc = run_two_processes(["finetune", "m", "--params", str(params_file), "--out", str(out / "model"),
                              "--checkpoints", str(out / "ckpt"), "--plot", str(out / "loss.csv")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert read_curve(out / "loss.csv") == pytest.approx(single, rel=1e-4)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out / "model", use_safetensors=True)
    assert not (out / "ckpt").exists()


def test_a_non_finite_loss_stops_the_run_and_writes_no_model(micro_world_dir, micro_tokenizer_dir, tmp_path,
                                                              monkeypatch):
    import pipeline.training.finetune as finetune_mod
    from pipeline.training.engine import TrainingDiverged

    real_loss = finetune_mod.causal_lm_loss
    monkeypatch.setattr(finetune_mod, "causal_lm_loss",
                        lambda model, batch: (real_loss(model, batch)[0] * float("nan"), {}))
    with pytest.raises(TrainingDiverged, match="step 1: non-finite loss .* no checkpoint was written yet"):
        _finetune(micro_params(micro_world_dir, micro_tokenizer_dir), tmp_path, "nan")
    assert not (tmp_path / "nan" / "model").exists()


def test_training_length_and_warmup_in_steps():
    by_epochs = TrainConfig.from_params({"epochs": 2.5, "warmup_ratio": 0.2}, "t")
    assert by_epochs.total_steps(steps_per_epoch=4) == 10 and by_epochs.warmup(10) == 2
    by_steps = TrainConfig.from_params({"epochs": 2.5, "max_steps": 7, "warmup_ratio": 0.2, "warmup_steps": 3}, "t")
    assert by_steps.total_steps(steps_per_epoch=4) == 7 and by_steps.warmup(7) == 3  # steps win, as transformers
    schedule = lr_schedule(by_steps, 7)(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0))
    lrs = []
    for _ in range(7):
        lrs.append(schedule.get_last_lr()[0])
        schedule.step()
    assert lrs[:4] == pytest.approx([0, 1 / 3, 2 / 3, 1.0]) and lrs[6] == pytest.approx(1 / 4)
    with pytest.raises(ParamError, match=r"t.max_steps=-1: must be at least 0"):
        TrainConfig.from_params({"max_steps": -1}, "t")


def test_each_steps_time_goes_beside_the_loss_curve_never_into_it(micro_world_dir, micro_tokenizer_dir, tmp_path):
    """The loss curve is a DVC output: with the step times in it, every rerun would change dvc.lock."""
    import csv

    params = micro_params(micro_world_dir, micro_tokenizer_dir, max_steps=3)
    _finetune(params, tmp_path, "timed")
    rows = list(csv.DictReader(open(tmp_path / "timed" / "loss.csv")))
    assert len(rows) == 3 and set(rows[0]) == {"step", "loss", "lr"}  # max_steps, not the 2 epochs
    timings = list(csv.DictReader(open(tmp_path / "timed" / "loss.timing.csv")))
    assert [r["step"] for r in timings] == ["1", "2", "3"]
    assert all(float(r["step_seconds"]) > 0 and float(r["tokens_per_second"]) > 0 for r in timings)


def test_timings_of_a_pipeline_output_go_to_the_untracked_log():
    from pipeline.common.timing import split_timings, timing_path

    assert timing_path("artifacts/plots/unlearn/npo/seed0.csv") == \
        Path("artifacts/logs/timing/plots/unlearn/npo/seed0.csv")
    assert timing_path("/tmp/run.plots/seed0.csv") == Path("/tmp/run.plots/seed0.timing.csv")
    assert timing_path("runs/eval/metrics.json") == Path("runs/eval/metrics.timing.json")
    kept, timed = split_timings([{"step": 1, "loss": 2.0, "step_seconds": 0.5}, {"step": 2, "loss": 1.0}])
    assert kept == [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.0}] and timed == [{"step": 1, "step_seconds": 0.5}]


def test_offload_keys_set_deepspeeds_offload_and_need_their_zero_stage():
    cfg = TrainConfig.from_params({"zero_stage": 3, "offload_optimizer": True, "offload_params": True}, "t")
    zero = deepspeed_config(cfg, world_size=1, total_steps=10)["zero_optimization"]
    assert zero["offload_optimizer"]["device"] == "cpu" and zero["offload_param"]["device"] == "cpu"
    optimizer = deepspeed_config(cfg, 1, 10)["optimizer"]
    assert optimizer["type"] == "AdamW" and "torch_adam" not in optimizer["params"]  # DeepSpeed's CPU Adam
    only_optimizer = TrainConfig.from_params({"zero_stage": 2, "offload_optimizer": True}, "t")
    zero = deepspeed_config(only_optimizer, 1, 10)["zero_optimization"]
    assert "offload_optimizer" in zero and "offload_param" not in zero
    plain = deepspeed_config(TrainConfig.from_params({"zero_stage": 3}, "t"), 1, 10)
    assert "offload_optimizer" not in plain["zero_optimization"] and plain["optimizer"]["params"]["torch_adam"]
    with pytest.raises(ParamError, match=r"^t.offload_params=True: needs zero_stage 3 \(zero_stage is 2\)$"):
        TrainConfig.from_params({"zero_stage": 2, "offload_params": True}, "t")
    with pytest.raises(ParamError, match=r"^t.offload_optimizer=True: needs zero_stage 1, 2 or 3"):
        TrainConfig.from_params({"offload_optimizer": True}, "t")
    with pytest.raises(ParamError, match=r"unlearn.train.offload_params='yes': expected bool"):
        TrainConfig.from_params({"offload_params": "yes"}, "t", {"offload_params": "unlearn.train.offload_params"})


@pytest.mark.parametrize("cuda", [True, False])
def test_fused_adamw_on_a_gpu_only(monkeypatch, cuda):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)  # set to cpu by an earlier engine in this CPU process
    params = deepspeed_config(TrainConfig.from_params({"zero_stage": 2, "precision": "fp32"}, "t"), 1, 10)
    params = params["optimizer"]["params"]
    assert params["torch_adam"] is True  # torch.optim.AdamW, which gets the remaining params
    assert params.get("fused", False) is cuda
    offloaded = TrainConfig.from_params({"zero_stage": 2, "offload_optimizer": True, "precision": "fp32"}, "t")
    assert "fused" not in deepspeed_config(offloaded, 1, 10)["optimizer"]["params"]  # the CPU Adam steps there
    if cuda:  # DeepSpeed forced onto another accelerator: no CUDA kernel
        monkeypatch.setenv("DS_ACCELERATOR", "cpu")
        assert "fused" not in deepspeed_config(TrainConfig(precision="fp32"), 1, 10)["optimizer"]["params"]


def _tiny_llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.conftest import TINY_MODEL

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, **{**TINY_MODEL, "num_hidden_layers": 3}))


@pytest.mark.parametrize("lora", [{}, {"r": 4, "alpha": 8}])
def test_activation_checkpointing_gives_the_same_loss_and_gradients(lora):
    from pipeline.training.engine import prepare_model
    from pipeline.training.losses import causal_lm_loss

    ids = torch.randint(0, 64, (3, 17), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    results = {}
    for checkpointing in (False, True):
        cfg = TrainConfig.from_params({"gradient_checkpointing": checkpointing, "lora": lora}, "t")
        model = prepare_model(_tiny_llama(), cfg).train()
        for name, p in model.named_parameters():  # adapters that already adapt: A's gradient is 0 while B = 0
            if "lora_B" in name:
                p.data = torch.randn(p.shape, generator=torch.Generator().manual_seed(2)) * 0.1
        calls, mlp = [], model.get_decoder().layers[1].mlp
        forward = mlp.forward
        mlp.forward = lambda *a, **k: calls.append(1) or forward(*a, **k)  # (hooks do not run in the recompute)
        loss, _ = causal_lm_loss(model, batch)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        assert grads and all(g.abs().sum() > 0 for g in grads.values())
        assert not lora or all("lora_" in n for n in grads)
        results[checkpointing] = (loss.item(), grads, len(calls))
    assert results[True][2] == 2 and results[False][2] == 1  # the layer ran again in the backward pass
    assert results[True][0] == pytest.approx(results[False][0], rel=1e-6)
    assert results[True][1].keys() == results[False][1].keys()
    for name, grad in results[False][1].items():
        assert torch.allclose(results[True][1][name], grad, rtol=1e-5, atol=1e-7), name


def test_a_finetune_with_activation_checkpointing_follows_the_same_curve(micro_world_dir, micro_tokenizer_dir,
                                                                         tmp_path):
    plain, weights = _finetune(micro_params(micro_world_dir, micro_tokenizer_dir, max_steps=3), tmp_path, "plain")
    params = micro_params(micro_world_dir, micro_tokenizer_dir, max_steps=3, gradient_checkpointing=True)
    checkpointed, weights_ckpt = _finetune(params, tmp_path, "checkpointed")
    assert checkpointed == pytest.approx(plain, rel=1e-5)
    for name in weights:
        assert torch.allclose(weights_ckpt[name], weights[name], rtol=1e-4, atol=1e-6), name


def test_finetuning_stops_once_an_epochs_mean_loss_meets_stop_loss_and_records_where(micro_world_dir,
                                                                                     micro_tokenizer_dir, tmp_path):
    import json

    from pipeline.training.finetune import TRAINING_RECORD, stop_rule

    params = micro_params(micro_world_dir, micro_tokenizer_dir, epochs=4)
    capped, _ = _finetune(params, tmp_path, "cap")
    per_epoch = len(capped) // 4
    epoch_means = [sum(capped[i:i + per_epoch]) / per_epoch for i in range(0, len(capped), per_epoch)]
    threshold = (epoch_means[1] + epoch_means[2]) / 2  # met at the end of the third epoch, not before
    params["finetune"]["models"]["m"]["stop_loss"] = threshold
    stopped, _ = _finetune(params, tmp_path, "stop")
    assert stopped == capped[: 3 * per_epoch]  # the same steps, ending at the third epoch's end
    record = json.loads((tmp_path / "stop" / "model" / TRAINING_RECORD).read_text())
    assert record["stopped_by"] == "stop_loss" and record["epochs"] == 3 and record["cap_steps"] == len(capped)
    assert record["last_epoch_loss"] == pytest.approx(epoch_means[2], rel=1e-4)
    assert json.loads((tmp_path / "cap" / "model" / TRAINING_RECORD).read_text())["stopped_by"] == "cap"
    # the rule looks at whole epochs only: one easy step mid-epoch does not stop training
    rule = stop_rule(0.5, steps_per_epoch=2)
    assert not rule([{"loss": 0.1}]) and not rule([{"loss": 0.1}, {"loss": 1.0}]) and rule([{"loss": 0.4}] * 2)
    params["finetune"]["models"]["m"]["stop_loss"] = -1
    with pytest.raises(ParamError, match=r"finetune.models.m.stop_loss=-1: a positive number"):
        job_from_params(params, "m")
