"""The DeepSpeed training engine, shared by finetuning and unlearning.

ZeRO stage 0 to 3 from params, with CPU offload of the optimizer state and (ZeRO-3) of the parameters, bf16 on GPU
and fp32 on CPU, AdamW with warmup (torch's fused AdamW on a GPU; DeepSpeed's CPU Adam where the optimizer state is
offloaded), gradient accumulation and clipping, activation checkpointing, LoRA adapters (`pipeline.training.lora`),
periodic checkpoints with resume, and an explicit teardown (process group: `pipeline.common.distributed`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

from pipeline.common.distributed import deepspeed_module, is_main_process
from pipeline.common.errors import TokenUnlearnError
from pipeline.common.errors import ParamError
from pipeline.common.params import (LEARNING_RATE, at_least, between, check_rules, dataclass_from_params, one_of,
                                    positive)
from pipeline.common.progress import progress
from pipeline.training.checkpoints import (CheckpointRefused, CheckpointUnreadable, WeightsOnlyLoading, checkpoint_tags,
                                          clear_checkpoints, matching_checkpoint)
from pipeline.training.lora import LoraSpec, apply_lora, is_adapter_param, is_peft

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainConfig:
    epochs: float = 1.0
    max_steps: int = 0              # optimizer steps; 0: `epochs` decide (as transformers' max_steps)
    lr: float = 1e-5
    micro_batch_size: int = 4
    grad_accum: int = 1
    warmup_ratio: float = 0.1
    warmup_steps: int = 0           # > 0: warmup in steps, in place of warmup_ratio (as transformers)
    schedule: str = "linear"        # linear: warmup then linear decay to 0; constant: warmup then constant
    weight_decay: float = 0.0
    clip: float = 1.0               # max gradient norm; 0 turns clipping off
    zero_stage: int = 0
    precision: str = "auto"         # auto: bf16 on a GPU that supports it, else fp32
    checkpoint_every: int = 0       # optimizer steps between checkpoints; 0: none
    keep_checkpoints: bool = False  # keep the checkpoint directory after a successful run
    seed: int = 0
    offload_optimizer: bool = False       # ZeRO 1-3: optimizer state in CPU memory, stepped by DeepSpeed's CPU Adam
    offload_params: bool = False          # ZeRO-3: parameters in CPU memory, brought to the GPU layer by layer
    gradient_checkpointing: bool = False  # recompute each layer's activations in the backward pass
    lora: dict = field(default_factory=dict, metadata={"types": (dict,)})  # LoRA adapters (lora.LoraSpec); null: off

    RULES = {
        "epochs": positive(), "max_steps": at_least(0), "lr": LEARNING_RATE,
        "micro_batch_size": at_least(1), "grad_accum": at_least(1), "warmup_ratio": between(0, 1, hi_open=True),
        "warmup_steps": at_least(0), "schedule": one_of(["linear", "constant"]), "weight_decay": at_least(0),
        "clip": at_least(0), "zero_stage": one_of([0, 1, 2, 3]), "precision": one_of(["auto", "fp32", "bf16"]),
        "checkpoint_every": at_least(0),
    }

    @classmethod
    def from_params(cls, params: dict, where: str, origins: dict[str, str] | None = None) -> "TrainConfig":
        cfg = dataclass_from_params(cls, params, where, origins)
        check_rules(cfg, cls.RULES, where, origins)
        def key_of(name: str) -> str:
            return (origins or {}).get(name, f"{where}.{name}")

        if cfg.offload_optimizer and cfg.zero_stage == 0:
            raise ParamError(f"{key_of('offload_optimizer')}=True: needs zero_stage 1, 2 or 3 (zero_stage is 0)")
        if cfg.offload_params and cfg.zero_stage != 3:
            raise ParamError(f"{key_of('offload_params')}=True: needs zero_stage 3 (zero_stage is {cfg.zero_stage})")
        spec = LoraSpec.from_params(cfg.lora, key_of("lora"))
        return replace(cfg, lora=asdict(spec) if spec is not None else {})  # every LoRA key explicit in fingerprints

    @property
    def lora_spec(self) -> LoraSpec | None:
        """The LoRA adapters to train, or None (full training)."""
        return LoraSpec(**self.lora) if self.lora else None

    def total_steps(self, steps_per_epoch: int) -> int:
        """Optimizer steps of the run: `max_steps`, or `epochs` of `steps_per_epoch` (at least one)."""
        return self.max_steps or max(1, math.ceil(self.epochs * steps_per_epoch))

    def warmup(self, total_steps: int) -> int:
        """Warmup steps: `warmup_steps`, or `warmup_ratio` of the run."""
        return self.warmup_steps or int(self.warmup_ratio * total_steps)

    def use_bf16(self) -> bool:
        if self.precision == "bf16":
            return True
        return self.precision == "auto" and torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def on_cuda() -> bool:
    """Will DeepSpeed run on CUDA? A GPU, and no other accelerator forced (`DS_ACCELERATOR`)."""
    return torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "cuda") == "cuda"


def deepspeed_config(cfg: TrainConfig, world_size: int, total_steps: int) -> dict:
    """The DeepSpeed config; the learning-rate schedule is the client's (`lr_schedule`).

    The optimizer is AdamW: torch's (fused into one kernel on a GPU), or, where the optimizer state is offloaded to
    the CPU, DeepSpeed's CPU Adam (a vectorised C++ step over the CPU copy; torch's AdamW there would be several
    times slower on a large model, and DeepSpeed refuses it unless told otherwise)."""
    adam = {"lr": cfg.lr, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": cfg.weight_decay}
    if not cfg.offload_optimizer:
        adam["torch_adam"] = True
        if on_cuda():
            adam["fused"] = True  # torch.optim.AdamW(fused=True): DeepSpeed passes the remaining params to it
    zero = {"stage": cfg.zero_stage, "stage3_gather_16bit_weights_on_model_save": True}
    if cfg.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": on_cuda()}
    if cfg.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": on_cuda()}
    return {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": cfg.grad_accum,
        "train_batch_size": cfg.micro_batch_size * cfg.grad_accum * world_size,
        "optimizer": {"type": "AdamW", "params": adam},
        "gradient_clipping": cfg.clip,
        "zero_optimization": zero,
        "bf16": {"enabled": cfg.use_bf16()},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def prepare_model(model: torch.nn.Module, cfg: TrainConfig, where: str = "train") -> torch.nn.Module:
    """The model as the engine trains it: activation checkpointing (`gradient_checkpointing`) and LoRA adapters
    (`lora`; the base frozen, the adapters drawn from the run's seed). Call before `Engine`, and after anything
    that reads the loaded model's own weights (hashes, checks)."""
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    spec = cfg.lora_spec
    if spec is not None:
        torch.manual_seed(cfg.seed)  # every process draws the same adapters
        model = apply_lora(model, spec, f"{where}.lora")
        if cfg.gradient_checkpointing:
            model.enable_input_require_grads()  # as PEFT needs with a frozen embedding (reentrant checkpoints)
    return model


def cpu_adam_ready() -> None:
    """Build (once, into TORCH_EXTENSIONS_DIR, about a minute) or load DeepSpeed's CPU Adam op, or stop with one
    line: offloading the optimizer state needs it."""
    from deepspeed.accelerator import get_accelerator

    try:
        get_accelerator().create_op_builder("CPUAdamBuilder").load(verbose=False)
    except Exception as e:  # a compiler error, a missing toolchain or header
        reason = (str(e).strip().splitlines() or [type(e).__name__])[-1][:200]
        raise TokenUnlearnError(
            f"offload_optimizer: DeepSpeed's CPU Adam (op cpu_adam) cannot be built here ({reason}); it needs a C++ "
            "compiler (and, on a GPU machine, the CUDA toolkit's headers); set offload_optimizer: false") from None


def lr_schedule(cfg: TrainConfig, total_steps: int) -> Callable:
    """Linear warmup (`warmup_steps`, or `warmup_ratio` of the steps), then linear decay to 0 (or constant), as
    `transformers` does."""
    from transformers import get_constant_schedule_with_warmup, get_linear_schedule_with_warmup

    warmup = cfg.warmup(total_steps)
    if cfg.schedule == "linear":
        return lambda opt: get_linear_schedule_with_warmup(opt, warmup, total_steps)
    return lambda opt: get_constant_schedule_with_warmup(opt, warmup)


def zero3_loading(ds_config: dict):
    """Keep the returned object alive while loading models: under ZeRO-3, `from_pretrained` then partitions the
    weights as it loads them, so no process holds a whole large model."""
    if ds_config["zero_optimization"]["stage"] != 3:
        return None
    from transformers.integrations import HfDeepSpeedConfig

    return HfDeepSpeedConfig(ds_config)


def count_tokens(batch) -> int:
    """The real (attention-mask) tokens of a possibly nested batch: forget and retain parts together."""
    if isinstance(batch, dict):
        mask = batch.get("attention_mask")
        own = int(mask.sum()) if torch.is_tensor(mask) else 0
        return own + sum(count_tokens(v) for k, v in batch.items() if k != "attention_mask")
    return 0


def to_device(batch, device):
    """Move the tensors of a (possibly nested) batch dict to `device`."""
    if torch.is_tensor(batch):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


class TrainingDiverged(TokenUnlearnError):
    """The loss became NaN or infinite."""


LossFn = Callable[[torch.nn.Module, dict], tuple[torch.Tensor, dict[str, float]]]


class Engine:
    """A DeepSpeed engine with a step function over micro-batches, checkpoints and model export."""

    def __init__(self, model: torch.nn.Module, cfg: TrainConfig, total_steps: int, parameters=None):
        import torch.distributed as dist

        self.cfg, self.total_steps = cfg, total_steps
        self.world_size = dist.get_world_size()
        self.ds_config = deepspeed_config(cfg, self.world_size, total_steps)
        deepspeed_module()  # the environment (extensions directory, accelerator) before any op is built
        if cfg.offload_optimizer:
            cpu_adam_ready()
        torch.manual_seed(cfg.seed)
        params = [p for p in (parameters if parameters is not None else model.parameters()) if p.requires_grad]
        self.engine, _, _, _ = deepspeed_module().initialize(
            model=model, model_parameters=params, config=self.ds_config, lr_scheduler=lr_schedule(cfg, total_steps)
        )
        self.engine.checkpoint_engine = WeightsOnlyLoading(self.engine.checkpoint_engine)
        if self.world_size == 1 and cfg.zero_stage == 0:
            # nothing to all-reduce: DeepSpeed would still flatten every gradient into one buffer each step (the
            # size of all the gradients again, 2 GB for a 0.5B model in fp32)
            self.engine.enable_backward_allreduce = False
        self.device = self.engine.device

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    def train_step(self, micro_batches: list[dict], loss_fn: LossFn,
                   tokens_of: Callable[[dict], int] = count_tokens) -> dict[str, float]:
        """One optimizer step over this rank's micro-batches; returns metrics averaged over micro-batches and ranks,
        and `tokens`, the tokens of the step summed over ranks: `tokens_of` each micro-batch (default: all its
        attention-mask tokens; a loss that reads only part of the batch counts that part)."""
        import torch.distributed as dist

        self.engine.train()
        totals: dict[str, float] = {}
        tokens = sum(tokens_of(batch) for batch in micro_batches)
        for batch in micro_batches:
            batch = to_device(batch, self.device)
            loss, metrics = loss_fn(self.engine, batch)
            self.engine.backward(loss)
            self.engine.step()
            for k, v in {"loss": loss.item(), **metrics}.items():
                totals[k] = totals.get(k, 0.0) + v / len(micro_batches)
        keys = sorted(totals)
        t = torch.tensor([totals[k] for k in keys] + [tokens], dtype=torch.float64, device=self.device)  # NCCL: GPU
        dist.all_reduce(t)
        *means, tokens = t.tolist()
        out = {k: v / self.world_size for k, v in zip(keys, means)}
        out["lr"] = self.engine.get_lr()[0]
        out["tokens"] = tokens
        return out

    def save_checkpoint(self, ckpt_dir: Path, step: int, client_state: dict) -> None:
        # The random state too (DeepSpeed keeps none): a resumed run draws the dropout masks (LoRA's) it would have.
        rng = {"cpu": torch.get_rng_state(), **({"cuda": torch.cuda.get_rng_state()} if on_cuda() else {})}
        self.engine.save_checkpoint(str(ckpt_dir), tag=f"step{step}",
                                    client_state={**client_state, "step": step, "rng": rng})

    def load_checkpoint(self, ckpt_dir: Path) -> dict | None:
        """The latest checkpoint's client state, its weights and optimizer loaded; where its files are damaged (a
        kill or a full disk mid-save), the one before it, with a warning; an error with the fix when none loads."""
        if not (ckpt_dir / "latest").is_file():
            return None
        failures = []
        for tag in checkpoint_tags(ckpt_dir):
            try:
                path, client_state = self.engine.load_checkpoint(str(ckpt_dir), tag=tag)
            except CheckpointRefused:
                raise
            except (RuntimeError, EOFError, OSError, ValueError, KeyError) as e:  # torch's reader on a cut file
                failures.append(f"{tag}: {(str(e).strip().splitlines() or [type(e).__name__])[0][:160]}")
                log.warning("checkpoint %s cannot be read (%s): trying the one before it", ckpt_dir / tag,
                            failures[-1])
                continue
            if path is not None:
                break
        else:
            raise CheckpointUnreadable(f"{ckpt_dir}: no checkpoint there can be read ({'; '.join(failures)}); "
                                       "delete the directory, or run with --no-resume, to start from step 0")
        rng = client_state.get("rng") or {}
        if "cpu" in rng:
            torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and on_cuda():
            torch.cuda.set_rng_state(rng["cuda"])
        return client_state

    def full_state_dict(self) -> dict | None:
        """The whole model's weights on the main process (gathered under ZeRO-3), None elsewhere; only the adapters'
        where a LoRA run writes its adapter (`save: adapter`): a partitioned base is never gathered for them."""
        spec = self.cfg.lora_spec
        if spec is not None and spec.save == "adapter" and is_peft(self.module):
            return self.adapter_state_dict()
        if self.cfg.zero_stage == 3:
            return self.engine._zero3_consolidated_16bit_state_dict()
        return self.module.state_dict() if is_main_process() else None

    def adapter_state_dict(self) -> dict | None:
        named = [(n, p) for n, p in self.module.named_parameters() if is_adapter_param(n)]
        if self.cfg.zero_stage != 3:
            return {n: p.detach().cpu().clone() for n, p in named} if is_main_process() else None
        with deepspeed_module().zero.GatheredParameters([p for _, p in named]):  # every process takes part
            return {n: p.detach().cpu().clone() for n, p in named} if is_main_process() else None

    def finish(self, write: Callable[[dict | None], None], ckpt_dir: Path) -> None:
        """End a successful run: gather the weights, let the main process `write(state_dict)` the outputs,
        tear the engine down, and drop the checkpoints unless asked to keep them."""
        state_dict = self.full_state_dict()
        if is_main_process():
            write(state_dict)
        self.close()
        if not self.cfg.keep_checkpoints:
            clear_checkpoints(ckpt_dir)

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()
        self.engine.destroy()


def train_loop(
    engine: Engine,
    batches_for_step: Callable[[int], list[dict]],
    loss_fn: LossFn,
    ckpt_dir: Path,
    run_fingerprint: str,
    resume: bool,
    desc: str,
    on_step: Callable[[int, dict], dict | None] | None = None,
    stop: Callable[[list[dict]], bool] | None = None,
    on_resume: Callable[[list[dict]], None] | None = None,
    tokens_of: Callable[[dict], int] = count_tokens,
) -> list[dict]:
    """Run `engine.total_steps` optimizer steps; return the per-step metric history.

    With `resume`, a checkpoint in `ckpt_dir` of the same run (same fingerprint of params and data) is loaded
    and the run continues from its step; any other checkpoint there is discarded. `on_step(steps_done, row)`,
    after each step, with that step's history row (an evaluation during training, say, or a dual update): what it
    returns joins the row, so a checkpoint keeps it, and `on_resume(history)` is handed the restored history
    before the first step of a resumed run. `stop(history)`, after each step: True ends training there (a
    criterion met before the cap); it reads only the history, which a checkpoint keeps, so a resumed run stops
    where an unbroken one does. `tokens_of(micro-batch)`: the tokens the loss reads, for the logged tokens/s.
    """
    import torch.distributed as dist

    cfg = engine.cfg
    start, history = 0, []
    if resume and matching_checkpoint(ckpt_dir, run_fingerprint):
        state = engine.load_checkpoint(ckpt_dir)
        start, history = state["step"], list(state["history"])
        log.info("resumed from %s at step %d of %d", ckpt_dir, start, engine.total_steps)
        if on_resume is not None:
            on_resume(history)
    else:
        clear_checkpoints(ckpt_dir)
        dist.barrier()
    bar = progress(range(start, engine.total_steps), total=engine.total_steps, desc=desc, unit="step", initial=start,
                   leave=True)
    for step in bar:
        started = time.perf_counter()
        metrics = engine.train_step(batches_for_step(step), loss_fn, tokens_of)
        seconds = time.perf_counter() - started
        tokens = metrics.pop("tokens")
        if not all(math.isfinite(v) for v in metrics.values()):
            last = (ckpt_dir / "latest").read_text().strip() if (ckpt_dir / "latest").is_file() else None
            raise TrainingDiverged(
                f"{desc}: step {step + 1}: non-finite loss ({metrics}); "
                + (f"the last good checkpoint is {ckpt_dir / last}" if last else "no checkpoint was written yet")
                + " (lower the learning rate, or check the data)"
            )
        # Time and throughput of the step (batch building included), beside the losses in the loss-curve file.
        history.append({"step": step + 1, **{k: round(v, 6) for k, v in metrics.items()},
                        "step_seconds": round(seconds, 4), "tokens_per_second": round(tokens / max(seconds, 1e-9), 1)})
        bar.set_postfix(loss=f"{metrics['loss']:.4f}")
        done = step + 1
        if on_step is not None:
            history[-1].update(on_step(done, history[-1]) or {})
        if cfg.checkpoint_every and done % cfg.checkpoint_every == 0 and done < engine.total_steps:
            engine.save_checkpoint(ckpt_dir, done, {"history": history})
            if is_main_process():
                (ckpt_dir / "run.json").write_text(json.dumps({"fingerprint": run_fingerprint}))
        if stop is not None and stop(history):
            log.info("%s: stopped at step %d of %d (its criterion is met)", desc, done, engine.total_steps)
            break
    bar.close()
    return history
