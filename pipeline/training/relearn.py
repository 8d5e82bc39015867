"""The relearning attack: finetune an unlearned model for a few steps and probe it again.

Knowledge that unlearning only hid comes back after a little finetuning, on part of the forget set (Lynch et al.,
2024; Hu et al., 2024: "benign relearning") or even on unrelated data (WMDP's RMU regains cyber accuracy from
about 25% to about 38% after finetuning on other text). Each attack of `relearn.data` finetunes the model with
the engine (`relearn.train` over `unlearn.train`: LoRA, ZeRO, bf16 as any run) on its rows, then the stage's
probe scores it. Probes score forget rows no attack trained on, so what they measure came back unasked. The
probe is the caller's (stage three's metrics; training does not import evaluation).
"""

from __future__ import annotations

import logging
import random
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from pipeline.common.distributed import init_distributed
from pipeline.common.errors import DataError, ParamError
from pipeline.common.modeling import check_vocab, load_model, load_tokenizer
from pipeline.common.params import between, check_keys, check_rules, dataclass_from_params, origins_of, section
from pipeline.data.batching import StepSchedule, pad_batch
from pipeline.data.config import DataConfig
from pipeline.data.templates import encode_rows, get_template
from pipeline.data.tofu import load_split
from pipeline.training.engine import Engine, TrainConfig, prepare_model, train_loop
from pipeline.training.losses import causal_lm_loss

log = logging.getLogger(__name__)

Probe = Callable[[torch.nn.Module, list[int]], dict]  # (model, forget rows to score) -> metrics


@dataclass(frozen=True)
class RelearnData:
    """The rows one attack finetunes on: a seeded `fraction` of `split`'s rows."""

    split: str
    fraction: float = 0.2


@dataclass(frozen=True)
class RelearnConfig:
    data: dict                          # attack name -> RelearnData
    train: TrainConfig
    seed: int = 0                       # the slices and the data order
    forget_split: str = "forget10"      # the probes' forget set: its rows in a forget attack's slice are not scored
    trust_remote_code: bool = False


RELEARN_KEYS = ("data", "train", "seed")


def relearn_config(params: dict) -> RelearnConfig:
    """`relearn` over `unlearn.train`: each attack's data, and the finetuning (`relearn.train`, e.g. max_steps, lr)."""
    values = check_keys(section(params, "relearn") or {}, RELEARN_KEYS, "relearn")
    data = values.get("data") or {}
    if not isinstance(data, dict) or not data:
        raise ParamError("relearn.data: a mapping of attack name -> {split, fraction}, e.g. "
                         "{forget: {split: forget10, fraction: 0.2}, retain: {split: retain90, fraction: 0.1}}")
    attacks = {}
    for name, spec in data.items():
        attacks[name] = dataclass_from_params(RelearnData, spec, f"relearn.data.{name}")
        check_rules(attacks[name], {"fraction": between(0, 1, lo_open=True)}, f"relearn.data.{name}")
    base, overrides = (params.get("unlearn") or {}).get("train") or {}, values.get("train") or {}
    origins = origins_of(**{"unlearn.train": base, "relearn.train": overrides})
    train = TrainConfig.from_params({**base, **overrides}, "relearn.train", origins)
    if train.zero_stage == 3:
        raise ParamError("relearn.train.zero_stage=3: the relearned model is probed in memory, which ZeRO-3's "
                         "partitioned weights do not allow; use zero_stage 2, or LoRA (relearn.train.lora)")
    seed = values.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ParamError(f"relearn.seed={seed!r}: expected an integer")
    forget = (params.get("evaluate") or {}).get("forget_split", "forget10")
    return RelearnConfig(attacks, train, seed, forget)


def slice_rows(n: int, fraction: float, seed: int) -> list[int]:
    """A seeded sample of round(fraction · n) row indices (at least one), sorted."""
    k = max(1, round(fraction * n))
    return sorted(random.Random(seed).sample(range(n), k))


def finetune_in_memory(model_path: str, rows: list[dict], data: DataConfig, train: TrainConfig, name: str,
                       trust_remote_code: bool = False) -> tuple[torch.nn.Module, list[dict]]:
    """The model finetuned on `rows` (question-answer) by the engine, returned in memory with its loss history."""
    _, world_size = init_distributed()
    if world_size > 1:  # the probes read the model where it was trained: one process, one device
        raise ParamError(f"relearn: runs in one process ({world_size} were started); a model that does not fit "
                         "one device relearns with LoRA (relearn.train.lora)")
    tokenizer = load_tokenizer(model_path, trust_remote_code)
    samples = encode_rows(tokenizer, get_template(data.template), rows, data.max_length, name, data.skip_too_long)
    if not samples:
        raise DataError(f"{name}: no rows left to finetune on (all longer than data.max_length)")
    schedule = StepSchedule(len(samples), train.micro_batch_size, train.grad_accum, world_size, train.seed)
    model = load_model(model_path, trust_remote_code=trust_remote_code)
    check_vocab(model, tokenizer, model_path, data.max_length)
    engine = Engine(prepare_model(model, train, "relearn.train"), train,
                    train.total_steps(schedule.steps_per_epoch))

    def batches_for_step(step: int) -> list[dict]:
        return [pad_batch([samples[i] for i in idx], tokenizer.pad_token_id)
                for idx in schedule.micro_batches(step, 0)]

    with tempfile.TemporaryDirectory(prefix="relearn-", ignore_cleanup_errors=True) as ckpt:  # a few steps
        history = train_loop(engine, batches_for_step, causal_lm_loss, Path(ckpt), "relearn", resume=False,
                             desc=f"relearn {name}")
    model = engine.module
    engine.close()
    return model.eval(), history


def relearning_attack(model_path: str, probe: Probe, n_forget: int, cfg: RelearnConfig, data: DataConfig) -> dict:
    """Probe the model, then each attack's finetuned copy, on the forget rows that no attack trains on:
    {"before": probe, "unseen_forget_rows": [...], ATTACK: {"rows": slice, "probe": ..., "final_loss": ...}}."""
    slices = {name: slice_rows(len(load_split(data.source, spec.split)), spec.fraction, cfg.seed + i)
              for i, (name, spec) in enumerate(cfg.data.items())}
    taught = {i for name, spec in cfg.data.items() if spec.split == cfg.forget_split for i in slices[name]}
    unseen = [i for i in range(n_forget) if i not in taught]
    if not unseen:
        raise ParamError(f"relearn.data: the attacks train on every row of {cfg.forget_split}, so no forget row is "
                         "left to probe; lower the forget attack's fraction")
    model = load_model(model_path, trust_remote_code=cfg.trust_remote_code).eval()
    results: dict = {"before": probe(model, unseen), "unseen_forget_rows": unseen}
    del model
    for name, spec in cfg.data.items():
        rows = load_split(data.source, spec.split)
        chosen = [rows[i] for i in slices[name]]
        model, history = finetune_in_memory(model_path, chosen, data, replace(cfg.train, seed=cfg.seed),
                                            f"{data.source}/{spec.split}", cfg.trust_remote_code)
        results[name] = {"split": spec.split, "rows": slices[name], "probe": probe(model, unseen),
                         "steps": len(history), "final_loss": history[-1]["loss"] if history else None}
        probed = results[name]["probe"]
        log.info("relearn on %s (%d rows of %s, %d steps): forget ES on unseen rows %s", name, len(chosen),
                 spec.split, len(history), _number(probed.get("forget_es")))
        log.debug("relearn on %s: %s", name, probed)
        del model
    return results


def _number(value) -> str:
    return f"{value:.3f}" if isinstance(value, (int, float)) else "–"
