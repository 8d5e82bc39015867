"""Stage two: unlearning on the DeepSpeed engine, from the attribution shards and retain data.

The forget set streams from the shards (`ForgetStream`), with token weights ω computed from Δ and H, so r, τ, mix
and α are this stage's params and changing them never reruns attribution. This module is the loop that wires the
parts: the run's config (`pipeline.training.run_config`), the method (a module of `pipeline.training.methods`: its
token loss, the inputs it reads, its hyper-parameters and own retain term), the inputs computed for it
(`pipeline.training.method_inputs`), the retain term (`pipeline.training.retain_terms`: λ·KL(p_ref ‖ p_θ) on
retain answers by default, NLL, or RMU's activation matching), the monitor's hook
(`pipeline.training.monitor_hook`) and the seeds' records (`pipeline.training.seeds`). The loop combines the
method's token losses with ω (`reduction`: per sample, or over the batch's tokens) and adds the retain term.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch

from pipeline.attribution.reference import ReferenceCache
from pipeline.attribution.shards import read_manifest
from pipeline.common.atomic import atomic_dir, write_json
from pipeline.common.distributed import init_distributed, is_main_process
from pipeline.common.modeling import check_vocab, load_model, load_tokenizer, write_model
from pipeline.common.runs import COMPLETE_RECORD, SEED_RECORD, seed_dir
from pipeline.data.batching import StepSchedule, pad_batch
from pipeline.data.config import DataConfig, retain_samples
from pipeline.data.templates import EncodedSample
from pipeline.training.checkpoints import fingerprint
from pipeline.training.engine import Engine, TrainConfig, deepspeed_config, prepare_model, train_loop, zero3_loading
from pipeline.training.finetune import write_history
from pipeline.training.forget_batches import forget_batch, write_token_weights
from pipeline.training.forget_stream import ForgetStream
from pipeline.training.forward import inner_model
from pipeline.training.lora import is_peft, write_trained
from pipeline.training.losses import FORGET_REDUCTIONS, without_first_scored
from pipeline.training.method_inputs import method_inputs
from pipeline.training.methods import METHODS, ForwardOut, Prepared
from pipeline.training.monitor_hook import EVAL_PREFIX, MonitorFactory, Watch
from pipeline.training.retain_terms import ADAPTERS_OFF, RETAIN_LOSSES, retain_nll_at_start
from pipeline.training.run_config import UnlearnConfig, params_used, run_configs, run_spec
from pipeline.training.seeds import (check_seeds, earlier_seeds, recorded_fingerprint, remove_other_seeds,
                                     seed_fingerprint)

# The loop's entry points, and, re-exported, what other code and tests imported from here before the split
__all__ = ["METHODS", "RETAIN_LOSSES", "UnlearnConfig", "check_seeds", "load_retain", "make_loss_fn", "params_used",
           "run_configs", "run_spec", "run_unlearn", "run_unlearn_seeds", "tokens_read"]

log = logging.getLogger(__name__)


def tokens_read(cfg: UnlearnConfig) -> Callable[[dict], int]:
    """The tokens of a micro-batch {forget, retain} that the run's loss reads, for the loss curve's tokens/s: the
    forget answers (all but IdkNLL's), their alternative answers (IdkDPO, AltPO, IdkNLL) and the retain batch where
    there is a retain term (none for GA: its retain batch is built, never read)."""
    method = METHODS[cfg.method]

    def count(batch: dict) -> int:
        parts = [batch["forget"]] if method.reads_forget_answer else []
        parts += [batch["forget"]["alternative"]] if method.alternative else []
        parts += [batch["retain"]] if cfg.retain is not None else []
        return sum(int(part["attention_mask"].sum()) for part in parts)

    return count


def make_loss_fn(cfg: UnlearnConfig, reference, retain_weight: Callable[[], float] | None = None) -> Callable:
    """The step's loss: the method's forget loss plus λ times the retain term. `reference`: θ_o for a retain term
    computed from the model itself (`retain_reference: model`), else None (the cache rides in the retain batch).
    `retain_weight`: λ at this step, where it changes during training (PDU's dual variable); else the run's."""
    method, params, retain = METHODS[cfg.method], cfg.method_params, cfg.retain
    reduce = FORGET_REDUCTIONS[cfg.reduction]

    def forget_loss(out: ForwardOut, f: dict) -> torch.Tensor:
        if cfg.sequence_level:
            return method.sequence_loss(out, f, params)
        return reduce(method.token_loss(out, f, params), f["weights"])

    def loss_fn(model, batch: dict) -> tuple[torch.Tensor, dict[str, float]]:
        net, f = inner_model(model), batch["forget"]
        if method.skip_first:  # CE-U leaves each answer's first token out: no loss, no weight
            f = without_first_scored(f, method.skip_first)
        forget = forget_loss(method_inputs(method, params, net, f, cfg.chunk_size, cfg.hidden_layer), f)
        loss, metrics = forget, {"forget_loss": forget.item()}
        if retain is not None:
            retain_value = retain.loss(net, reference, batch["retain"], cfg)
            loss = loss + (retain_weight() if retain_weight else cfg.retain_weight) * retain_value
            metrics["retain_loss"] = retain_value.item()
        return loss, metrics

    return loss_fn


def prepare_reference(model_path: str, ds_config: dict, device, trust_remote_code: bool):
    """The frozen θ_o for the KL term, in the engine's precision (an fp32 reference beside a bf16 model would make
    its forward pass the slowest part of a GPU step). Under ZeRO-3 it is held once, partitioned, in an inference
    engine."""
    dtype = torch.bfloat16 if ds_config["bf16"]["enabled"] else None
    ref = load_model(model_path, dtype=dtype, trust_remote_code=trust_remote_code).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    if ds_config["zero_optimization"]["stage"] == 3:
        import deepspeed

        config = {k: v for k, v in ds_config.items() if k not in ("optimizer", "gradient_clipping")}
        engine = deepspeed.initialize(model=ref, config=config)[0]
        engine.eval()
        return engine
    return ref.to(device)


def load_retain(cfg: UnlearnConfig, data: DataConfig, tokenizer, forget_split: str) -> list[EncodedSample]:
    """The retain samples: question-answer rows of `retain_split`, or the passages of `retain_corpus` that are not
    the forget split's."""
    return retain_samples(data, tokenizer, cfg.retain_split, cfg.retain_corpus, forget_split)


def retain_reference(cfg: UnlearnConfig, retain: list, engine, forget: ForgetStream, model_path: str,
                     reference_dir: Path | None, used: list[int], pad_id: int):
    """θ_o for the retain term, as (reference model, cache), before the first step: nothing (no term, or one without
    θ_o), the cache of `reference_dir` (`tokenunlearn reference`), the run's own cache of the retain samples it
    will use (built from the model before it is trained, when no directory is given), or θ_o itself
    (`retain_reference: model`)."""
    if cfg.retain is None or not cfg.retain.needs_reference:
        return None, None
    layers = [cfg.hidden_layer] if cfg.retain.reads_hidden else []  # θ_o's hidden states there, for the cache
    if cfg.retain_reference == "model":
        if is_peft(engine.module):  # θ_o is the base under the adapters: nothing to load
            return ADAPTERS_OFF, None
        return prepare_reference(model_path, engine.ds_config, engine.device, cfg.trust_remote_code), None
    if reference_dir is None:
        return None, ReferenceCache.build(inner_model(engine.engine), retain, used, pad_id, cfg.reference_top_k, layers,
                                          cfg.retain_batch_size or engine.cfg.micro_batch_size, cfg.chunk_size)
    cache = ReferenceCache.load(reference_dir)
    cache.check(retain, cfg.retain_corpus or cfg.retain_split, forget.manifest["metadata"].get("model_hash"),
                layers[0] if layers else None, inner_model(engine.engine).get_input_embeddings().num_embeddings)
    return None, cache


def run_unlearn_seeds(name: str, cfg: UnlearnConfig, train: TrainConfig, data: DataConfig, model_path: str,
                      shard_dir: Path, out_dir: Path, ckpt_dir: Path, plots_dir: Path, seeds: list[int],
                      resume: bool, reference_dir: Path | None = None, monitor: "MonitorFactory | None" = None,
                      monitor_dir: Path | None = None, whole_set: bool = False) -> list[dict]:
    """Run NAME once per seed into `out_dir/seed{S}/`, then write `out_dir/complete.json` last: a killed run
    has no record, so evaluation refuses it. With `resume`, a seed already finished with the same params is
    skipped (and a seed killed midway continues from its checkpoint). `monitor`: makes each seed's evaluation
    during training (`Monitor`), whose rows go to `monitor_dir/seed{S}.csv`. `whole_set`: `seeds` are all the
    run's seeds (`unlearn.seeds`), so any other seed an earlier call left in the outputs is removed, and they hold
    what a fresh run writes (a DVC stage keeps its outputs between runs, `persist`, for the finished seeds);
    otherwise (`--seed 1` after `--seed 0`) the earlier seeds of the same params stay."""
    seeds = check_seeds(seeds)
    init_distributed()
    manifest = read_manifest(shard_dir)
    earlier = {} if whole_set else \
        earlier_seeds(name, cfg, train, model_path, manifest, reference_dir, monitor, out_dir, seeds)
    if is_main_process():
        (out_dir / COMPLETE_RECORD).unlink(missing_ok=True)  # incomplete until every seed is done
    summaries, fingerprints = [], {}
    selection = monitor.selection if monitor is not None else None
    for seed in seeds:
        seed_train = replace(train, seed=seed)
        fingerprints[str(seed)] = seed_fingerprint(name, cfg, seed_train, model_path, manifest, reference_dir,
                                                   selection)
        record = seed_dir(out_dir, seed) / SEED_RECORD
        curves = [plots_dir / f"seed{seed}.csv"] + ([monitor_dir / f"seed{seed}.csv"] if monitor_dir else [])
        if resume and recorded_fingerprint(record) == fingerprints[str(seed)] and all(c.is_file() for c in curves):
            log.info("unlearn %s seed %d: already finished with these params (%s), skipped", name, seed, record)
            summaries.append({"name": name, "seed": seed, "skipped": True})
            continue
        summaries.append(run_unlearn(name, cfg, seed_train, data, model_path, shard_dir, seed_dir(out_dir, seed),
                                     ckpt_dir / f"seed{seed}", plots_dir / f"seed{seed}.csv", resume, reference_dir,
                                     monitor, monitor_dir / f"seed{seed}.csv" if monitor_dir else None, selection))
    if is_main_process():
        fingerprints = {**earlier, **fingerprints}
        remove_other_seeds(fingerprints, [out_dir, plots_dir, *([monitor_dir] if monitor_dir else [])])
        write_json(out_dir / COMPLETE_RECORD, {"run": name, "seeds": sorted(int(s) for s in fingerprints),
                                               "fingerprints": fingerprints})
    return summaries


def run_unlearn(name: str, cfg: UnlearnConfig, train: TrainConfig, data: DataConfig, model_path: str,
                shard_dir: Path, out_dir: Path, ckpt_dir: Path, plot_file: Path, resume: bool,
                reference_dir: Path | None = None, monitor: "MonitorFactory | None" = None,
                monitor_file: Path | None = None, selection: dict | None = None) -> dict:
    """Unlearn and write `out_dir/model` (safetensors), `out_dir/token_weights.parquet` (the weights used) and
    the per-step total, forget and retain losses to `plot_file` (a DVC plot). `reference_dir`: the reference cache
    of the retain data (`tokenunlearn reference`), for a retain term that reads θ_o. `monitor`: an evaluation
    every few steps into `monitor_file`; with a selection rule, the weights written are those of the step it
    chooses."""
    rank, world_size = init_distributed()
    tokenizer = load_tokenizer(model_path, cfg.trust_remote_code)
    forget = ForgetStream(shard_dir, cfg.weighting_spec, seed=train.seed, alternative=METHODS[cfg.method].alternative,
                          method=cfg.method, teacher=METHODS[cfg.method].teacher)
    retain = load_retain(cfg, data, tokenizer, forget.manifest["metadata"].get("split", ""))
    schedule = StepSchedule(len(forget), train.micro_batch_size, train.grad_accum, world_size, train.seed,
                            order=forget.epoch_order)
    # Retain micro-batches follow their own schedule, paired with the forget micro-batches by position in
    # the global batch, so N processes see what one process with N-fold accumulation sees.
    retain_schedule = StepSchedule(len(retain), cfg.retain_batch_size or train.micro_batch_size, train.grad_accum,
                                   world_size, train.seed + 1)
    total_steps = train.total_steps(schedule.steps_per_epoch)
    ds_config = deepspeed_config(train, world_size, total_steps)
    keep_alive = zero3_loading(ds_config)  # noqa: F841
    model = load_model(model_path, trust_remote_code=cfg.trust_remote_code)
    check_vocab(model, tokenizer, model_path, data.max_length)
    forget.check_source(model, model_path, tokenizer)
    model = prepare_model(model, train, f"unlearn.runs.{name}.train")  # checkpointing, LoRA adapters (train.lora)
    method = METHODS[cfg.method]  # its set-up: RMU trains a few layers and steers towards its control vector
    prepared = method.prepare(model, cfg.method_params, cfg.hidden_layer, train.seed) if method.prepare else Prepared()
    engine = Engine(model, train, total_steps, parameters=prepared.parameters)
    used = sorted({i for step in range(total_steps) for mb in retain_schedule.micro_batches(step, rank) for i in mb})
    reference, cache = retain_reference(cfg, retain, engine, forget, model_path, reference_dir, used,
                                        tokenizer.pad_token_id)
    layer = cfg.hidden_layer if cache is not None and cfg.retain.reads_hidden else None  # the cache's hidden states
    log.info("unlearn %s: %s/%s, %d forget samples in %d shards, %d retain samples, %d steps", name, cfg.method,
             cfg.weighting, len(forget), len(forget.files), len(retain), total_steps)

    def batches_for_step(step: int) -> list[dict]:
        out = []
        for f_idx, r_idx in zip(schedule.micro_batches(step, rank), retain_schedule.micro_batches(step, rank)):
            batch = {"forget": {**forget_batch(forget.get(f_idx), tokenizer.pad_token_id), **prepared.forget_extras},
                     "retain": pad_batch([retain[i] for i in r_idx], tokenizer.pad_token_id)}
            if cache is not None:
                batch["retain"]["ref"] = cache.batch(r_idx, layer)
            out.append(batch)
        return out

    run_id = seed_fingerprint(name, cfg, train, model_path, forget.manifest, reference_dir, selection)
    watch = Watch(monitor(tokenizer), engine, total_steps, train) if monitor is not None else None
    dual = None
    if method.dual is not None:  # PDU: λ is a dual variable, θ_o's retain loss measured on every retain sample used
        every_rank = sorted({i for step in range(total_steps) for r in range(world_size)
                             for mb in retain_schedule.micro_batches(step, r) for i in mb})
        dual = method.dual(cfg.method_params, cfg.retain_weight, schedule.steps_per_epoch, functools.partial(
            retain_nll_at_start, engine, retain, every_rank, cfg.retain_batch_size or train.micro_batch_size,
            tokenizer.pad_token_id, cfg.chunk_size))
    hooks = [h for h in (dual and dual.after_step, watch and watch.on_step) if h]

    def on_step(done: int, row: dict) -> dict:
        return {k: v for hook in hooks for k, v in (hook(done, row) or {}).items()}

    # A checkpoint is partitioned by process: it is resumed only by the same number of processes.
    history = train_loop(engine, batches_for_step, make_loss_fn(cfg, reference, dual and (lambda: dual.value)),
                         ckpt_dir, fingerprint({"run": run_id, "world_size": world_size}), resume,
                         desc=f"unlearn {name}", on_step=on_step if hooks else None,
                         on_resume=dual.restore if dual is not None else None, tokens_of=tokens_read(cfg))

    def write(state_dict: dict | None) -> None:
        chosen = watch.selected if watch is not None else None
        with atomic_dir(out_dir) as tmp:
            write_trained(engine.module, tokenizer, tmp / "model", chosen[1] if chosen else state_dict,
                          train.lora_spec, base=model_path, write=write_model)
            write_token_weights(forget, tmp / "token_weights.parquet")
            write_json(tmp / SEED_RECORD, {"run": name, "seed": train.seed, "fingerprint": run_id,
                                           **({"selected_step": chosen[0]} if chosen else {})})
        write_history([{k: v for k, v in row.items() if not k.startswith(EVAL_PREFIX)} for row in history],
                      plot_file)
        if watch is not None and monitor_file is not None:
            write_history(watch.rows(history), monitor_file)

    engine.finish(write, ckpt_dir)
    return {"name": name, "method": cfg.method, "weighting": cfg.weighting, "steps": total_steps,
            "final": history[-1] if history else None}
