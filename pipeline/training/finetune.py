"""Supervised finetuning on question-answer splits: how the base, target and retain models are made.

As TOFU builds them: the target model is finetuned on `full`, the retain (gold-standard) model on `retain90`.
"""

from __future__ import annotations

import csv
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pipeline.common.atomic import atomic_dir, atomic_file, write_json
from pipeline.common.distributed import init_distributed
from pipeline.common.errors import DataError, ParamError
from pipeline.common.modeling import build_model, check_vocab, count_parameters, load_model, load_tokenizer
from pipeline.common.params import check_keys, origins_of, section
from pipeline.common.timing import split_timings, timing_path
from pipeline.data.batching import StepSchedule, pad_batch
from pipeline.data.config import DataConfig
from pipeline.data.templates import EncodedSample, encode_rows, encode_texts, get_template
from pipeline.data.tofu import load_passages, load_split
from pipeline.training.checkpoints import fingerprint
from pipeline.training.engine import Engine, TrainConfig, deepspeed_config, prepare_model, train_loop, zero3_loading
from pipeline.training.lora import write_trained
from pipeline.training.losses import causal_lm_loss

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FinetuneJob:
    name: str
    init: str                      # "scratch" (build from model_config) or a model directory / hub name
    splits: list[str]
    train: TrainConfig
    data: DataConfig
    tokenizer: str | None = None   # defaults to the init model's own tokenizer
    model_config: dict = field(default_factory=dict)
    trust_remote_code: bool = False
    # Memorise, then stop: at the end of each epoch, stop once that epoch's mean training loss is at most this;
    # `train.epochs` is the cap. None: train every epoch (a fixed recipe).
    stop_loss: float | None = None
    # Passage files (JSON Lines with `text`) trained on beside the splits, every token after the first: MUSE's
    # target and retain models learn the corpora (the biographies) as well as the question-answer pairs.
    corpora: list[str] = field(default_factory=list)


JOB_KEYS = {"init", "splits", "tokenizer", "train", "trust_remote_code", "stop_loss", "corpora"}
TRAINING_RECORD = "finetune.json"  # beside the weights: where training stopped, and why


def job_from_params(params: dict, name: str) -> FinetuneJob:
    """Model NAME of `finetune.models`: its init and splits, and `finetune.train` with its own `train:` overrides."""
    finetune = check_keys(section(params, "finetune"), ("train", "models", "stop_loss"), "finetune")
    model_section = check_keys(params.get("model") or {}, ("config",), "model")
    models = section(params, "finetune.models")
    if name not in models:
        raise ParamError(f"finetune.models: no model named '{name}' (have {sorted(models)})")
    spec = check_keys(models[name], JOB_KEYS, f"finetune.models.{name}")
    if not spec.get("splits") or not isinstance(spec["splits"], list):
        raise ParamError(f"finetune.models.{name}.splits: a list of at least one split is needed")
    base, overrides = section(params, "finetune.train"), spec.get("train", {})
    if not isinstance(overrides, dict):
        raise ParamError(f"finetune.models.{name}.train: expected a mapping such as {{epochs: 30}}")
    corpora = spec.get("corpora") or []
    if not isinstance(corpora, list) or not all(isinstance(c, str) and c for c in corpora):
        raise ParamError(f"finetune.models.{name}.corpora: a list of passage files (JSON Lines with `text`), got "
                         f"{corpora!r}")
    origins = origins_of(**{"finetune.train": base, f"finetune.models.{name}.train": overrides})
    train = TrainConfig.from_params({**base, **overrides}, f"finetune.models.{name}.train", origins)
    init = str(spec.get("init", "scratch"))
    if init == "scratch" and train.lora_spec is not None and train.lora_spec.save == "adapter":
        key = origins.get("lora", f"finetune.models.{name}.train.lora")
        raise ParamError(f"{key}.save='adapter': model {name} starts from scratch, so no base model on disk holds "
                         "what the adapter adapts; use save: merged")
    return FinetuneJob(
        name=name,
        init=init,
        splits=list(spec["splits"]),
        train=train,
        data=DataConfig.from_params(section(params, "data")),
        tokenizer=spec.get("tokenizer"),
        model_config=dict(model_section.get("config") or {}),
        trust_remote_code=bool(spec.get("trust_remote_code", False)),
        stop_loss=_stop_loss(spec.get("stop_loss", finetune.get("stop_loss")),
                             f"finetune.models.{name}.stop_loss" if "stop_loss" in spec else "finetune.stop_loss"),
        corpora=list(corpora),
    )


def _stop_loss(value, key: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value:
        raise ParamError(f"{key}={value!r}: a positive number (the epoch's mean training loss to stop at), or null")
    return float(value)


def stop_rule(stop_loss: float | None, steps_per_epoch: int):
    """The criterion `train_loop` checks after each step: at an epoch's end, that epoch's mean loss at most
    `stop_loss`. The mean over the epoch, not one step's loss, so one easy batch does not stop training."""
    if stop_loss is None:
        return None

    def met(history: list[dict]) -> bool:
        steps = len(history)
        if steps % steps_per_epoch:
            return False
        epoch = [row["loss"] for row in history[-steps_per_epoch:]]
        return sum(epoch) / len(epoch) <= stop_loss

    return met


def load_samples(job: FinetuneJob, tokenizer) -> list[EncodedSample]:
    template = get_template(job.data.template)
    samples: list[EncodedSample] = []
    skipped: list[str] = []
    for split in job.splits:
        rows = load_split(job.data.source, split)
        where = f"{job.data.source}/{split}.json"
        encoded = encode_rows(tokenizer, template, rows, job.data.max_length, where, job.data.skip_too_long,
                              on_skip=lambda i, w=where: skipped.append(f"{w}:{i}"))
        if not encoded:  # a split must never drop out of training without a word
            raise DataError(f"{where}: every one of its {len(rows)} rows is longer than data.max_length="
                            f"{job.data.max_length} (skip_too_long skipped them all); raise max_length")
        samples += encoded
    for corpus in job.corpora:  # every passage of the file (no forget split filters them)
        texts = [p["text"] for p in load_passages(corpus)]
        encoded = encode_texts(tokenizer, texts, job.data.max_length, corpus, "passage", job.data.skip_too_long)
        if not encoded:
            raise DataError(f"{corpus}: every one of its {len(texts)} passages is longer than data.max_length="
                            f"{job.data.max_length} (skip_too_long skipped them all); raise max_length")
        skipped += [f"{corpus} (a passage)"] * (len(texts) - len(encoded))
        samples += encoded
    if skipped:
        log.warning("skipped %d rows longer than max_length=%d (first: %s)", len(skipped), job.data.max_length,
                    skipped[0])
    return samples


def run_finetune(job: FinetuneJob, out_dir: Path, ckpt_dir: Path, plot_file: Path, resume: bool) -> dict:
    """Train and write the model (safetensors, with its tokenizer) and the loss curve; return a summary."""
    rank, world_size = init_distributed()
    tokenizer = load_tokenizer(job.tokenizer or job.init, job.trust_remote_code)
    samples = load_samples(job, tokenizer)
    t = job.train
    schedule = StepSchedule(len(samples), t.micro_batch_size, t.grad_accum, world_size, t.seed)
    total_steps = t.total_steps(schedule.steps_per_epoch)
    keep_alive = zero3_loading(deepspeed_config(t, world_size, total_steps))  # noqa: F841
    if job.init == "scratch":
        if not job.model_config:
            raise ParamError(f"finetune.models.{job.name}: init 'scratch' needs model.config")
        model = build_model(job.model_config, tokenizer, t.seed)
    else:
        model = load_model(job.init, trust_remote_code=job.trust_remote_code)
    check_vocab(model, tokenizer, job.init, job.data.max_length)
    log.info("%s: %d samples, %d steps of %d samples, %.2fM parameters, %d process(es)", job.name,
             len(samples), total_steps, schedule.global_batch, count_parameters(model) / 1e6, world_size)
    model = prepare_model(model, t, f"finetune.models.{job.name}.train")
    engine = Engine(model, t, total_steps)

    def batches_for_step(step: int) -> list[dict]:
        return [pad_batch([samples[i] for i in idx], tokenizer.pad_token_id)
                for idx in schedule.micro_batches(step, rank)]

    run_id = fingerprint({"job": job_record(job), "world_size": world_size,
                          "data": [s.input_ids for s in samples]})
    history = train_loop(engine, batches_for_step, causal_lm_loss, ckpt_dir, run_id, resume,
                         desc=f"finetune {job.name}", stop=stop_rule(job.stop_loss, schedule.steps_per_epoch))
    record = training_record(job, history, schedule.steps_per_epoch, total_steps)

    def write(state_dict: dict | None) -> None:
        with atomic_dir(out_dir) as tmp:  # the model, or with LoRA the merged model or the adapter (train.lora.save)
            write_trained(engine.module, tokenizer, tmp, state_dict, t.lora_spec, base=job.init)
            write_json(tmp / TRAINING_RECORD, record)
        write_history(history, plot_file)

    engine.finish(write, ckpt_dir)
    return {"name": job.name, "steps": len(history), "samples": len(samples),
            "final_loss": history[-1]["loss"] if history else None, **record}


def job_record(job: FinetuneJob) -> dict:
    """The job as its checkpoints' fingerprint reads it: `corpora` only where set, so that a model without them keeps
    the fingerprint (and its checkpoints) it had before the option existed."""
    record = asdict(job)
    if not job.corpora:
        del record["corpora"]
    return record


def training_record(job: FinetuneJob, history: list[dict], steps_per_epoch: int, cap_steps: int) -> dict:
    """Where training stopped and why: the criterion met (`stop_loss`), or the cap (`train.epochs`) reached."""
    steps = len(history)
    last = [row["loss"] for row in history[-steps_per_epoch:]]
    return {"steps": steps, "epochs": round(steps / steps_per_epoch, 3), "cap_steps": cap_steps,
            "stop_loss": job.stop_loss,
            "stopped_by": "stop_loss" if job.stop_loss is not None and steps < cap_steps else "cap",
            "last_epoch_loss": round(sum(last) / len(last), 6) if last else None}


def write_history(history: list[dict], path: Path) -> None:
    """The per-step metrics as CSV: a DVC plot. Each step's time and throughput go to the untracked
    `timing_path(path)` instead, so the plot is the same file on every rerun."""
    rows, timings = split_timings(history)
    _write_csv(rows, path, ["step", "loss", "lr"])
    if timings:
        _write_csv(timings, timing_path(path), ["step"])


def _write_csv(rows: list[dict], path: Path, empty_fields: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = list(dict.fromkeys(k for row in rows for k in row)) or empty_fields
    with atomic_file(path) as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
