"""The reference-free trainer against the way open-unlearning runs the same step: peak memory and step time of
an NPO + KL unlearning step (8 forget + 8 retain samples x 512 tokens by default).

- reference-free (TokenUnlearn): no reference model in memory (NPO's log p_ref from the attribution shards, the KL
  term from the reference cache's top-32), log-probabilities from the hidden states a chunk of positions at a time
  (no [batch, length, vocab] logits).
- comparison (open-unlearning's NPO with a KL retain term, reproduced here): a frozen reference model resident in
  the same precision, its forward pass on the forget batch for log p_ref and on the retain batch for the KL, and the
  full logits of both models upcast to fp32.

Both variants train with activation checkpointing (the same for both; --no-checkpointing turns it off), AdamW in
fp32 through the same DeepSpeed engine, the whole model or (--lora) LoRA adapters. Memory: each variant runs in a fresh process (its own peak RSS on CPU; peak allocated on a GPU), for `--steps`
steps after building its engine; the ratio is reference-free / comparison. Time: the median step of each process
(after a warm-up step); with --interleave, both variants' engines in one process, one step of each in turn
(for a model small enough to hold both).

    python benchmarks/bench_reference_free.py                             # a 0.5B random Llama, CPU: ~25 min
    python benchmarks/bench_reference_free.py --hidden 512 --layers 8 --interleave --steps 6   # small, interleaved
    python benchmarks/bench_reference_free.py --llama3-8b --offload       # Llama-3-8B's shape, on a GPU (or --lora)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

VARIANTS = ("reference_free", "comparison")
# glibc keeps freed blocks below its mmap threshold (dynamic, up to 32 MB) in its heap, so a CPU process's peak RSS
# grows with fragmentation, not with the tensors alive. Blocks of 1 MB and more are mmapped and returned on free:
# the peak RSS then follows the live tensors (both variants alike).
MALLOC = {"MALLOC_MMAP_THRESHOLD_": "1048576"}
# --offload: ZeRO-3 with parameters and optimizer state in CPU memory (the engine's train-config keys).
OFFLOAD = {"zero_stage": 3, "offload_optimizer": True, "offload_params": True}


def peak_memory_mib() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def comparison_loss(cfg, reference):
    """open-unlearning's NPO + KL: reference forwards on both batches, full logits of both models upcast to fp32."""
    from pipeline.training.losses import forward_kl_loss, token_logp
    from pipeline.training.methods.npo import npo_sequence_loss

    def loss_fn(model, batch):
        f, r = batch["forget"], batch["retain"]
        labels = torch.where(f["scored"] > 0, f["input_ids"], torch.full_like(f["input_ids"], -100))
        kw = {"input_ids": f["input_ids"], "attention_mask": f["attention_mask"]}
        logp, mask = token_logp(model(**kw).logits.float(), labels)
        with torch.no_grad():
            ref_logp, _ = token_logp(reference(**kw).logits.float(), labels)
        forget = npo_sequence_loss(logp, ref_logp, mask.float(), cfg.method_params.beta)
        kw = {"input_ids": r["input_ids"], "attention_mask": r["attention_mask"]}
        logits = model(**kw).logits.float()
        with torch.no_grad():
            ref_logits = reference(**kw).logits.float()
        retain = forward_kl_loss(ref_logits[:, :-1], logits[:, :-1], (r["labels"] != -100).float()[:, 1:])
        return forget + cfg.retain_weight * retain, {"forget_loss": forget.item(), "retain_loss": retain.item()}

    return loss_fn


def random_model(config, train):
    """The random Llama, seeded alike for both variants. On a GPU it is drawn there, in the engine's precision: an
    8B model drawn in fp32 on the host takes minutes and 32 GB, and neither belongs to what is measured."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    if not torch.cuda.is_available():
        return LlamaForCausalLM(config)
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16 if train.use_bf16() else torch.float32)
    try:
        with torch.device("cuda"):
            return LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(dtype)


def build(variant: str, args, work: Path):
    """(engine, loss_fn, batches) of one variant; the model is random, seeded alike for both."""
    from _models import random_llama_config
    from pipeline.attribution.reference import ReferenceCache
    from pipeline.data.templates import IGNORE_INDEX, EncodedSample
    from pipeline.training.engine import Engine, TrainConfig, prepare_model
    from pipeline.training.forget_batches import forget_batch
    from pipeline.training.forget_stream import ForgetStream
    from pipeline.training.unlearn import UnlearnConfig, make_loss_fn
    from tests.synthetic import write_synthetic_shards

    config = random_llama_config(args.hidden, args.layers, args.vocab, args.seq)
    if args.llama3_8b:  # Llama-3-8B's own MLP width and grouped-query attention
        config.intermediate_size, config.num_key_value_heads, config.rope_theta = 14336, 8, 500000.0
    train = TrainConfig.from_params({"lr": 1e-5, "micro_batch_size": args.batch,
                                     "gradient_checkpointing": args.checkpointing,
                                     "lora": {"r": 16, "alpha": 32} if args.lora else {},
                                     **(OFFLOAD if args.offload else {})}, "bench")
    model = random_model(config, train)
    cfg = UnlearnConfig(method="npo", weighting="uniform", retain_loss="kl", retain_weight=0.1)
    shards = work / f"shards-{variant}"
    if not shards.exists():
        write_synthetic_shards(shards, args.batch * 2, args.batch, args.seq, args.vocab)
    stream = ForgetStream(shards, cfg.weighting_spec)
    g = torch.Generator().manual_seed(1)
    retain = []
    for _ in range(args.batch * 2):
        ids = torch.randint(5, args.vocab, (args.seq,), generator=g).tolist()
        labels = [IGNORE_INDEX] * (args.seq // 2) + ids[args.seq // 2:]
        retain.append(EncodedSample("", ids, labels, [], (0, 0), (0, 0), args.seq // 2))
    from pipeline.data.batching import pad_batch

    if variant == "reference_free":
        cache = ReferenceCache.build(model, retain, list(range(len(retain))), 0, 32, [], args.batch)
        loss_fn = make_loss_fn(cfg, None)
    else:
        reference = copy.deepcopy(model).eval().requires_grad_(False)  # same weights, device and precision
        cache, loss_fn = None, comparison_loss(cfg, reference)
    data = []
    for b in range(2):
        ids = list(range(b * args.batch, (b + 1) * args.batch))
        rb = pad_batch([retain[i] for i in ids], 0)
        if cache is not None:
            rb["ref"] = cache.batch(ids)
        data.append({"forget": forget_batch(stream.get(ids), 0), "retain": rb})
    engine = Engine(prepare_model(model, train), train, args.steps + 1)
    return engine, loss_fn, data


def run_variant(variant: str, args) -> dict:
    """One variant in this process: its peak memory over building and `steps` steps, and its median step time."""
    from pipeline.common.distributed import init_distributed

    init_distributed()
    with tempfile.TemporaryDirectory() as work:
        engine, loss_fn, data = build(variant, args, Path(work))
        params_m = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters()) / 1e6  # ZeRO-3: partitioned
        times = []
        for step in range(args.steps + 1):
            start = time.perf_counter()
            engine.train_step([data[step % len(data)]], loss_fn)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            if step:  # the first step warms up
                times.append(time.perf_counter() - start)
        engine.close()
    return {"variant": variant, "parameters_M": round(params_m), "peak_mib": round(peak_memory_mib()),
            "median_step_s": round(statistics.median(times), 3)}


def interleaved(args) -> dict:
    """Both variants' engines in one process, one step of each in turn: the median step of each."""
    from pipeline.common.distributed import init_distributed

    init_distributed()
    with tempfile.TemporaryDirectory() as work:
        built = {v: build(v, args, Path(work)) for v in VARIANTS}
        times = {v: [] for v in VARIANTS}
        for step in range(args.steps + 1):
            for v, (engine, loss_fn, data) in built.items():
                start = time.perf_counter()
                engine.train_step([data[step % len(data)]], loss_fn)
                if step:
                    times[v].append(time.perf_counter() - start)
        for engine, _, _ in built.values():
            engine.close()
    med = {v: statistics.median(t) for v, t in times.items()}
    return {"median_step_s": {v: round(t, 4) for v, t in med.items()},
            "step_time_ratio": round(med["reference_free"] / med["comparison"], 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1536)
    p.add_argument("--layers", type=int, default=14)       # with hidden 1536 and a 32k vocabulary: 0.49B parameters
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=2, help="measured steps (after one warm-up step)")
    p.add_argument("--interleave", action="store_true", help="time both in one process, one step of each in turn")
    p.add_argument("--no-checkpointing", dest="checkpointing", action="store_false",
                   help="keep every layer's activations (both variants)")
    p.add_argument("--lora", action="store_true", help="both variants train LoRA adapters (r 16, every linear layer)")
    p.add_argument("--offload", action="store_true",
                   help="both variants under ZeRO-3 with parameters and optimizer state offloaded to CPU memory")
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # a child process's one variant
    p.add_argument("--llama3-8b", action="store_true", help="Llama-3-8B's shape (hidden 4096, 32 layers, 128k vocab)")
    args = p.parse_args()
    if args.llama3_8b:
        args.hidden, args.layers, args.vocab = 4096, 32, 128256
    if args.variant:
        print(json.dumps(run_variant(args.variant, args)), flush=True)
        return
    if args.interleave:
        print(json.dumps({"interleaved": interleaved(args)}), flush=True)
        return
    argv = [a for a in sys.argv[1:]]
    results = {}
    for v in VARIANTS:
        child = subprocess.run([sys.executable, __file__, *argv, "--variant", v], capture_output=True, text=True,
                               env={**os.environ, **MALLOC})
        if child.returncode:
            raise SystemExit(f"{v} failed:\n{child.stderr[-3000:]}")
        results[v] = json.loads(child.stdout.strip().splitlines()[-1])
        print(json.dumps(results[v]), flush=True)
    ours, theirs = results["reference_free"], results["comparison"]
    print(json.dumps({"peak_memory_ratio": round(ours["peak_mib"] / theirs["peak_mib"], 3),
                      "step_time_ratio": round(ours["median_step_s"] / theirs["median_step_s"], 3),
                      "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                      "batch": f"{args.batch} forget + {args.batch} retain x {args.seq} tokens"}), flush=True)


if __name__ == "__main__":
    from pipeline.common.cli_errors import run_script  # as the CLI: one line per error, an exit status
    run_script(main)
