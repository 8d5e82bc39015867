"""Stage two: unlearning on the DeepSpeed engine, from the attribution shards and retain data.

Token weights ω come from the shards' φ here (so r, τ and α are this stage's params, and changing them never
reruns attribution). Each method is a forget loss in `METHODS`; the retention term λ·KL(p_ref ‖ p_θ) (or NLL)
on retain answers is added to every method.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from .atomic import atomic_dir
from .attribution_run import model_hash, tokenizer_hash
from .batching import StepSchedule, pad_batch
from .engine import Engine, TrainConfig, deepspeed_config, fingerprint, init_distributed, train_loop, zero3_loading
from .errors import DataError, ParamError
from .finetune import DataConfig, write_history
from .modeling import check_vocab, load_model, load_tokenizer, write_model
from .objectives import (forward_kl_loss, ga_token_loss, nll_loss, npo_sequence_loss, npo_token_loss,
                         rmu_token_loss, token_logp, weighted_sample_mean, wga_token_loss)
from .params import dataclass_from_params
from .shards import read_manifest, read_table
from .templates import encode_rows, get_template
from .tofu import load_split
from .weights import WEIGHTING, attribution_score, token_weights

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class UnlearnConfig:
    method: str = "ga"                 # ga | wga | npo | rmu | graddiff
    weighting: str = "uniform"         # uniform (sequence level) | hard (T-) | soft (S-)
    r: float = 0.2                     # hard: the top-r fraction of φ
    tau: float = 0.5                   # soft: softmax(φ / τ)
    alpha: float = 0.7                 # φ = α·minmax(Δ) + (1−α)·minmax(H), recomputed from the shards' Δ and H
    retain_split: str = "retain90"
    retain_loss: str = "kl"            # kl: λ·KL(p_ref ‖ p_θ) on retain answers; nll; none
    retain_weight: float = 0.1         # λ
    gamma: float = 1.0                 # WGA
    beta: float = 0.1                  # NPO
    rmu_layer: int = 2                 # RMU: the layer whose output is steered (hidden_states index)
    rmu_steer: float = 6.5             # RMU: c
    rmu_update_layers: list = field(default_factory=list)  # RMU: layers updated; empty: layer-2 .. layer
    retain_batch_size: int = 0         # retain samples per micro-batch; 0: the forget micro-batch size
    trust_remote_code: bool = False

    @classmethod
    def from_params(cls, values: dict, where: str) -> "UnlearnConfig":
        cfg = dataclass_from_params(cls, values, where)
        checks = [("method", cfg.method in METHODS), ("weighting", cfg.weighting in WEIGHTING),
                  ("r", 0 < cfg.r <= 1), ("tau", cfg.tau > 0), ("alpha", 0 <= cfg.alpha <= 1),
                  ("retain_loss", cfg.retain_loss in ("kl", "nll", "none")), ("retain_weight", cfg.retain_weight >= 0),
                  ("gamma", cfg.gamma >= 0), ("beta", cfg.beta > 0), ("rmu_layer", cfg.rmu_layer >= 1),
                  ("retain_batch_size", cfg.retain_batch_size >= 0)]
        for name, ok in checks:
            if not ok:
                choices = f" (choose from {sorted(METHODS)})" if name == "method" else ""
                raise ParamError(f"{where}.{name}={getattr(cfg, name)!r}: out of range{choices}")
        return cfg


# ---- forget losses: one function per method, chosen from a registry -------------------------------------

@dataclass
class ForwardOut:
    logp: torch.Tensor            # [B, T] log p_θ(s_i | s_<i), 0 where not scored
    hidden: torch.Tensor | None   # [B, T, d] hidden states at the RMU layer


def _ga(out: ForwardOut, batch: dict, cfg: UnlearnConfig) -> torch.Tensor:
    return weighted_sample_mean(ga_token_loss(out.logp), batch["weights"])


def _wga(out: ForwardOut, batch: dict, cfg: UnlearnConfig) -> torch.Tensor:
    return weighted_sample_mean(wga_token_loss(out.logp, cfg.gamma), batch["weights"])


def _npo(out: ForwardOut, batch: dict, cfg: UnlearnConfig) -> torch.Tensor:
    if cfg.weighting == "uniform":  # the original, sequence-level NPO
        return npo_sequence_loss(out.logp, batch["ref_logp"], batch["scored"], cfg.beta)
    return weighted_sample_mean(npo_token_loss(out.logp, batch["ref_logp"], cfg.beta), batch["weights"])


def _rmu(out: ForwardOut, batch: dict, cfg: UnlearnConfig) -> torch.Tensor:
    # ℓ_i = ‖h_L(s_<i) − c·u‖²: the hidden state at position i−1 is the one that predicts token i.
    losses = torch.zeros_like(batch["weights"])
    losses[:, 1:] = rmu_token_loss(out.hidden[:, :-1].float(), batch["control"])
    return weighted_sample_mean(losses, batch["weights"])


@dataclass(frozen=True)
class Method:
    forget_loss: Callable[[ForwardOut, dict, UnlearnConfig], torch.Tensor]
    needs_hidden: bool = False
    default_retain: str | None = None  # a method's own retention term, if it has one


METHODS: dict[str, Method] = {
    "ga": Method(_ga),
    "wga": Method(_wga),
    "npo": Method(_npo),
    "rmu": Method(_rmu, needs_hidden=True),
    "graddiff": Method(_ga, default_retain="nll"),  # GA on forget plus NLL on retain
}


# ---- data -------------------------------------------------------------------------------------------------

@dataclass
class ForgetSample:
    sample_id: int
    input_ids: list[int]
    scored: np.ndarray
    weights: np.ndarray     # full length, 0 where not scored
    ref_logp: np.ndarray    # full length, 0 where not scored
    phi: np.ndarray


def check_shards(shard_dir: Path, model, model_path: str, tokenizer) -> dict:
    """Refuse shards made by another model or tokenizer, naming the field that differs."""
    meta = read_manifest(shard_dir)["metadata"]
    for name, ours in (("model_hash", model_hash(model, model_path)), ("tokenizer_hash", tokenizer_hash(tokenizer))):
        if meta.get(name) != ours:
            raise DataError(
                f"{shard_dir}: shards were made with {name}={meta.get(name)} (model {meta.get('model')!r}), but "
                f"{model_path!r} has {name}={ours}; rerun `attribute` with this model"
            )
    return meta


def forget_samples(shard_dir: Path, cfg: UnlearnConfig) -> list[ForgetSample]:
    table = read_table(shard_dir, columns=["sample_id", "input_ids", "scored", "delta", "entropy", "logp_orig"])
    out = []
    for row in table.to_pylist():
        scored = np.array(row["scored"], dtype=bool)
        if not scored.any():
            raise DataError(f"{shard_dir}: sample {row['sample_id']} has no scored token")
        delta, entropy = np.array(row["delta"], float)[scored], np.array(row["entropy"], float)[scored]
        phi = attribution_score(delta, entropy, cfg.alpha)
        weights = np.zeros(len(scored))
        weights[scored] = token_weights(cfg.weighting, phi, r=cfg.r, tau=cfg.tau)
        ref = np.nan_to_num(np.array(row["logp_orig"], dtype=float), nan=0.0)
        full_phi = np.full(len(scored), np.nan)
        full_phi[scored] = phi
        out.append(ForgetSample(row["sample_id"], row["input_ids"], scored, weights, ref, full_phi))
    return out


def forget_batch(samples: list[ForgetSample], pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(s.input_ids) for s in samples)
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(samples), width), dtype=torch.long)
    weights, ref, scored = (torch.zeros((len(samples), width)) for _ in range(3))
    for b, s in enumerate(samples):
        n = len(s.input_ids)
        ids[b, :n] = torch.tensor(s.input_ids)
        attention[b, :n] = 1
        weights[b, :n] = torch.from_numpy(s.weights).float()
        ref[b, :n] = torch.from_numpy(s.ref_logp).float()
        scored[b, :n] = torch.from_numpy(s.scored.astype(np.float32))
    return {"input_ids": ids, "attention_mask": attention, "weights": weights, "ref_logp": ref, "scored": scored}


def write_token_weights(samples: list[ForgetSample], cfg: UnlearnConfig, path: Path) -> None:
    """The weights this run used, per token, for inspection."""
    table = pa.table({
        "sample_id": [s.sample_id for s in samples],
        "input_ids": [s.input_ids for s in samples],
        "scored": [s.scored.tolist() for s in samples],
        "phi": pa.array([s.phi.astype(np.float32).tolist() for s in samples], type=pa.list_(pa.float32())),
        "weight": pa.array([s.weights.astype(np.float32).tolist() for s in samples], type=pa.list_(pa.float32())),
    }).replace_schema_metadata({b"tokenunlearn": json.dumps({"weighting": cfg.weighting, "r": cfg.r,
                                                              "tau": cfg.tau, "alpha": cfg.alpha}).encode()})
    pq.write_table(table, path, compression="zstd")


# ---- the run ------------------------------------------------------------------------------------------------

def control_vector(hidden_size: int, steer: float, seed: int) -> torch.Tensor:
    """c·u with u a fixed random unit vector drawn from the seed."""
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(hidden_size, generator=g)
    return steer * u / u.norm()


def freeze_for_rmu(model, cfg: UnlearnConfig) -> list[torch.nn.Parameter]:
    """Only the chosen decoder layers are trained; no gradient is computed for the rest."""
    layers = model.base_model.layers
    chosen = cfg.rmu_update_layers or list(range(max(0, cfg.rmu_layer - 3), cfg.rmu_layer))
    if any(not 0 <= i < len(layers) for i in chosen) or cfg.rmu_layer > len(layers):
        raise ParamError(f"unlearn rmu layers {chosen} / rmu_layer={cfg.rmu_layer}: the model has {len(layers)} layers")
    for p in model.parameters():
        p.requires_grad_(False)
    params = [p for i in chosen for p in layers[i].parameters()]
    for p in params:
        p.requires_grad_(True)
    return params


def make_loss_fn(cfg: UnlearnConfig, reference) -> Callable:
    method = METHODS[cfg.method]
    retain_loss = method.default_retain or cfg.retain_loss

    def loss_fn(model, batch: dict) -> tuple[torch.Tensor, dict[str, float]]:
        f = batch["forget"]
        out = model(input_ids=f["input_ids"], attention_mask=f["attention_mask"],
                    output_hidden_states=method.needs_hidden)
        labels = torch.where(f["scored"] > 0, f["input_ids"], torch.full_like(f["input_ids"], -100))
        logp, _ = token_logp(out.logits, labels)
        hidden = out.hidden_states[cfg.rmu_layer] if method.needs_hidden else None
        forget = method.forget_loss(ForwardOut(logp, hidden), {**f, "control": batch.get("control")}, cfg)
        loss, metrics = forget, {"forget_loss": forget.item()}
        if retain_loss != "none" and cfg.retain_weight > 0:
            r = batch["retain"]
            r_logits = model(input_ids=r["input_ids"], attention_mask=r["attention_mask"]).logits
            mask = (r["labels"] != -100).float()[:, 1:]
            if retain_loss == "kl":
                with torch.no_grad():
                    ref_logits = reference(input_ids=r["input_ids"], attention_mask=r["attention_mask"]).logits
                retain = forward_kl_loss(ref_logits[:, :-1], r_logits[:, :-1], mask)
            else:
                r_logp, r_mask = token_logp(r_logits, r["labels"])
                retain = nll_loss(r_logp, r_mask.float())
            loss = loss + cfg.retain_weight * retain
            metrics["retain_loss"] = retain.item()
        return loss, metrics

    return loss_fn


def prepare_reference(model_path: str, ds_config: dict, device, trust_remote_code: bool):
    """The frozen θ_o for the KL term. Under ZeRO-3 it is held once, partitioned, in an inference engine."""
    ref = load_model(model_path, trust_remote_code=trust_remote_code).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    if ds_config["zero_optimization"]["stage"] == 3:
        import deepspeed

        config = {k: v for k, v in ds_config.items() if k not in ("optimizer", "gradient_clipping")}
        engine = deepspeed.initialize(model=ref, config=config)[0]
        engine.eval()
        return engine
    return ref.to(device)


def run_unlearn(name: str, cfg: UnlearnConfig, train: TrainConfig, data: DataConfig, model_path: str,
                shard_dir: Path, out_dir: Path, ckpt_dir: Path, plot_file: Path, resume: bool) -> dict:
    """Unlearn and write `out_dir/model` (safetensors), `out_dir/token_weights.parquet` (the weights used) and
    the per-step total, forget and retain losses to `plot_file` (a DVC plot)."""
    rank, world_size = init_distributed()
    tokenizer = load_tokenizer(model_path, cfg.trust_remote_code)
    samples = forget_samples(shard_dir, cfg)
    retain_rows = load_split(data.source, cfg.retain_split)
    retain = encode_rows(tokenizer, get_template(data.template), retain_rows, data.max_length,
                         f"{data.source}/{cfg.retain_split}", data.skip_too_long)
    schedule = StepSchedule(len(samples), train.micro_batch_size, train.grad_accum, world_size, train.seed)
    retain_bs = cfg.retain_batch_size or train.micro_batch_size
    total_steps = max(1, math.ceil(train.epochs * schedule.steps_per_epoch))
    ds_config = deepspeed_config(train, world_size, total_steps)
    keep_alive = zero3_loading(ds_config)  # noqa: F841
    model = load_model(model_path, trust_remote_code=cfg.trust_remote_code)
    check_vocab(model, tokenizer, model_path)
    check_shards(shard_dir, model, model_path, tokenizer)
    params = freeze_for_rmu(model, cfg) if cfg.method == "rmu" else None
    control = control_vector(model.config.hidden_size, cfg.rmu_steer, train.seed) if cfg.method == "rmu" else None
    engine = Engine(model, train, total_steps, parameters=params)
    reference = prepare_reference(model_path, ds_config, engine.device, cfg.trust_remote_code) \
        if (METHODS[cfg.method].default_retain or cfg.retain_loss) == "kl" and cfg.retain_weight > 0 else None
    log.info("unlearn %s: %s/%s, %d forget samples, %d retain samples, %d steps", name, cfg.method, cfg.weighting,
             len(samples), len(retain), total_steps)

    def batches_for_step(step: int) -> list[dict]:
        g = torch.Generator().manual_seed(train.seed * 7919 + step * world_size + rank)
        out = []
        for idx in schedule.micro_batches(step, rank):
            r_idx = torch.randint(len(retain), (retain_bs,), generator=g).tolist()
            batch = {"forget": forget_batch([samples[i] for i in idx], tokenizer.pad_token_id),
                     "retain": pad_batch([retain[i] for i in r_idx], tokenizer.pad_token_id)}
            if control is not None:
                batch["control"] = control
            out.append(batch)
        return out

    run_id = fingerprint({"name": name, "cfg": asdict(cfg), "train": asdict(train), "model": model_path,
                          "world_size": world_size, "shards": read_manifest(shard_dir, verify=False)["shards"]})
    history = train_loop(engine, batches_for_step, make_loss_fn(cfg, reference), ckpt_dir, run_id, resume,
                         desc=f"unlearn {name}")

    def write(state_dict: dict | None) -> None:
        with atomic_dir(out_dir) as tmp:
            write_model(engine.module, tokenizer, tmp / "model", state_dict)
            write_token_weights(samples, cfg, tmp / "token_weights.parquet")
        write_history(history, plot_file)

    engine.finish(write, ckpt_dir)
    return {"name": name, "method": cfg.method, "weighting": cfg.weighting, "steps": total_steps,
            "final": history[-1] if history else None}
