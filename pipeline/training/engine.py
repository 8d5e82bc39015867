"""The DeepSpeed training engine, shared by finetuning and unlearning.

ZeRO stage 0 to 3 from params, bf16 on GPU and fp32 on CPU, AdamW with warmup, gradient accumulation and
clipping, periodic checkpoints with resume, and an explicit teardown (process group: `pipeline.common.distributed`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from pipeline.common.distributed import deepspeed_module, is_main_process
from pipeline.common.errors import ParamError, TokenUnlearnError
from pipeline.common.params import dataclass_from_params

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainConfig:
    epochs: float = 1.0
    lr: float = 1e-5
    micro_batch_size: int = 4
    grad_accum: int = 1
    warmup_ratio: float = 0.1
    schedule: str = "linear"        # linear: warmup then linear decay to 0; constant: warmup then constant
    weight_decay: float = 0.0
    clip: float = 1.0               # max gradient norm; 0 turns clipping off
    zero_stage: int = 0
    precision: str = "auto"         # auto: bf16 on a GPU that supports it, else fp32
    checkpoint_every: int = 0       # optimizer steps between checkpoints; 0: none
    keep_checkpoints: bool = False  # keep the checkpoint directory after a successful run
    seed: int = 0

    @classmethod
    def from_params(cls, params: dict, where: str) -> "TrainConfig":
        cfg = dataclass_from_params(cls, params, where)
        checks = [
            ("epochs", cfg.epochs > 0),
            ("lr", 0 < cfg.lr < 1),
            ("micro_batch_size", cfg.micro_batch_size >= 1),
            ("grad_accum", cfg.grad_accum >= 1),
            ("warmup_ratio", 0 <= cfg.warmup_ratio < 1),
            ("schedule", cfg.schedule in ("linear", "constant")),
            ("weight_decay", cfg.weight_decay >= 0),
            ("clip", cfg.clip >= 0),
            ("zero_stage", cfg.zero_stage in (0, 1, 2, 3)),
            ("precision", cfg.precision in ("auto", "fp32", "bf16")),
            ("checkpoint_every", cfg.checkpoint_every >= 0),
        ]
        for name, ok in checks:
            if not ok:
                raise ParamError(f"{where}.{name}={getattr(cfg, name)!r}: out of range")
        return cfg

    def use_bf16(self) -> bool:
        if self.precision == "bf16":
            return True
        return self.precision == "auto" and torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def deepspeed_config(cfg: TrainConfig, world_size: int, total_steps: int) -> dict:
    """The DeepSpeed config; the learning-rate schedule is the client's (`lr_schedule`)."""
    return {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": cfg.grad_accum,
        "train_batch_size": cfg.micro_batch_size * cfg.grad_accum * world_size,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": cfg.lr, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": cfg.weight_decay,
                       "torch_adam": True},
        },
        "gradient_clipping": cfg.clip,
        "zero_optimization": {"stage": cfg.zero_stage, "stage3_gather_16bit_weights_on_model_save": True},
        "bf16": {"enabled": cfg.use_bf16()},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def lr_schedule(cfg: TrainConfig, total_steps: int) -> Callable:
    """Linear warmup over `warmup_ratio` of the steps, then linear decay to 0 (or constant): as `transformers`."""
    from transformers import get_constant_schedule_with_warmup, get_linear_schedule_with_warmup

    warmup = int(cfg.warmup_ratio * total_steps)
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
        torch.manual_seed(cfg.seed)
        params = [p for p in (parameters if parameters is not None else model.parameters()) if p.requires_grad]
        self.engine, _, _, _ = deepspeed_module().initialize(
            model=model, model_parameters=params, config=self.ds_config, lr_scheduler=lr_schedule(cfg, total_steps)
        )
        self.device = self.engine.device

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    def train_step(self, micro_batches: list[dict], loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step over this rank's micro-batches; returns metrics averaged over micro-batches and ranks."""
        import torch.distributed as dist

        self.engine.train()
        totals: dict[str, float] = {}
        for batch in micro_batches:
            batch = to_device(batch, self.device)
            loss, metrics = loss_fn(self.engine, batch)
            self.engine.backward(loss)
            self.engine.step()
            for k, v in {"loss": loss.item(), **metrics}.items():
                totals[k] = totals.get(k, 0.0) + v / len(micro_batches)
        keys = sorted(totals)
        t = torch.tensor([totals[k] for k in keys], dtype=torch.float64, device=self.device)  # NCCL: GPU tensors only
        dist.all_reduce(t)
        out = {k: v / self.world_size for k, v in zip(keys, t.tolist())}
        out["lr"] = self.engine.get_lr()[0]
        return out

    def save_checkpoint(self, ckpt_dir: Path, step: int, client_state: dict) -> None:
        self.engine.save_checkpoint(str(ckpt_dir), tag=f"step{step}", client_state={**client_state, "step": step})

    def load_checkpoint(self, ckpt_dir: Path) -> dict | None:
        if not (ckpt_dir / "latest").is_file():
            return None
        path, client_state = self.engine.load_checkpoint(str(ckpt_dir))
        return client_state if path is not None else None

    def full_state_dict(self) -> dict | None:
        """The whole model's weights on the main process (gathered under ZeRO-3), None elsewhere."""
        if self.cfg.zero_stage == 3:
            return self.engine._zero3_consolidated_16bit_state_dict()
        return self.module.state_dict() if is_main_process() else None

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


def fingerprint(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _matching_checkpoint(ckpt_dir: Path, run_fingerprint: str) -> bool:
    if not (ckpt_dir / "latest").is_file():
        log.info("no checkpoint in %s: starting from step 0", ckpt_dir)
        return False
    meta = ckpt_dir / "run.json"
    if not meta.is_file() or json.loads(meta.read_text()).get("fingerprint") != run_fingerprint:
        log.warning("the checkpoint in %s belongs to another run (other params or data): starting from step 0",
                    ckpt_dir)
        return False
    return True


def train_loop(
    engine: Engine,
    batches_for_step: Callable[[int], list[dict]],
    loss_fn: LossFn,
    ckpt_dir: Path,
    run_fingerprint: str,
    resume: bool,
    desc: str,
) -> list[dict]:
    """Run `engine.total_steps` optimizer steps; return the per-step metric history.

    With `resume`, a checkpoint in `ckpt_dir` of the same run (same fingerprint of params and data) is loaded
    and the run continues from its step; any other checkpoint there is discarded.
    """
    import torch.distributed as dist
    from tqdm import tqdm

    cfg = engine.cfg
    start, history = 0, []
    if resume and _matching_checkpoint(ckpt_dir, run_fingerprint):
        state = engine.load_checkpoint(ckpt_dir)
        start, history = state["step"], list(state["history"])
        log.info("resumed from %s at step %d of %d", ckpt_dir, start, engine.total_steps)
    else:
        clear_checkpoints(ckpt_dir)
        dist.barrier()
    bar = tqdm(range(start, engine.total_steps), desc=desc, disable=not is_main_process(), dynamic_ncols=True,
               initial=start, total=engine.total_steps, mininterval=1.0)
    for step in bar:
        metrics = engine.train_step(batches_for_step(step), loss_fn)
        if not all(math.isfinite(v) for v in metrics.values()):
            last = (ckpt_dir / "latest").read_text().strip() if (ckpt_dir / "latest").is_file() else None
            raise TrainingDiverged(
                f"{desc}: step {step + 1}: non-finite loss ({metrics}); "
                + (f"the last good checkpoint is {ckpt_dir / last}" if last else "no checkpoint was written yet")
                + " (lower the learning rate, or check the data)"
            )
        history.append({"step": step + 1, **{k: round(v, 6) for k, v in metrics.items()}})
        bar.set_postfix(loss=f"{metrics['loss']:.4f}")
        done = step + 1
        if cfg.checkpoint_every and done % cfg.checkpoint_every == 0 and done < engine.total_steps:
            engine.save_checkpoint(ckpt_dir, done, {"history": history})
            if is_main_process():
                (ckpt_dir / "run.json").write_text(json.dumps({"fingerprint": run_fingerprint}))
    return history


def clear_checkpoints(ckpt_dir: Path) -> None:
    if is_main_process():
        shutil.rmtree(ckpt_dir, ignore_errors=True)
