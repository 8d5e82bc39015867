"""Stage two's speed, as ratios measured in one run, on the real DeepSpeed engine, loss functions and reader.

1. steps:  token-level weighting costs nothing: T-GA's and S-GA's step time against GA's (goal: at most 1.05x).
2. steps:  NPO with the shards' cached reference log-probabilities against NPO that runs a reference forward
           pass on the forget batch every step, as common implementations do (goal: at most 0.8x), with and
           without the KL retain term.
3. reader: the forget-shard reader delivers batches at least 20x faster than the trainer consumes them (the
           paper sweep's model of configs/paper.yaml, the fastest trainer there is).
4. memory: the reader's peak memory over one epoch of 8 shards against 64 shards (goal: independent).

Step times are interleaved (one step of each variant in turn, median over rounds), so machine noise hits every
variant alike.

    python benchmarks/bench_unlearn.py               # all, about four minutes on 2 cores
    python benchmarks/bench_unlearn.py --only reader
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from _models import random_llama_config  # noqa: E402  (beside this script)
from pipeline.common.distributed import init_distributed  # noqa: E402
from pipeline.data.batching import StepSchedule  # noqa: E402
from pipeline.training.engine import Engine, TrainConfig  # noqa: E402
from pipeline.training.forget_batches import forget_batch  # noqa: E402
from pipeline.training.forget_stream import ForgetStream  # noqa: E402
from pipeline.training.losses import token_logp  # noqa: E402
from pipeline.training.unlearn import UnlearnConfig, make_loss_fn  # noqa: E402
from tests.synthetic import write_synthetic_shards  # noqa: E402


def retain_batch(n: int, length: int, vocab: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (n, length), generator=g)
    labels = ids.clone()
    labels[:, : int(0.4 * length)] = -100
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def batches(shards: Path, cfg: UnlearnConfig, n: int, batch: int, length: int, vocab: int) -> list[dict]:
    stream = ForgetStream(shards, cfg.weighting_spec)
    return [{"forget": forget_batch(stream.get(range(b * batch, (b + 1) * batch)), 0),
             "retain": retain_batch(batch, length, vocab, seed=b)} for b in range(n)]


def interleaved_step_times(model_factory, variants: dict, steps: int, warmup: int = 2) -> dict[str, float]:
    """Median step time per variant {name: (loss_fn, batches)}, one step of each variant in turn."""
    engines = {name: Engine(model_factory(), TrainConfig(lr=1e-5, micro_batch_size=8), steps + warmup)
               for name in variants}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for step in range(steps + warmup):
        for name, (loss_fn, data) in variants.items():
            start = time.perf_counter()
            engines[name].train_step([data[step % len(data)]], loss_fn)
            if step >= warmup:
                times[name].append(time.perf_counter() - start)
    for engine in engines.values():
        engine.close()
    return {name: statistics.median(t) for name, t in times.items()}


def npo_with_reference_forward(cfg: UnlearnConfig, reference):
    """NPO as common implementations run it: log p_ref from a reference forward pass on the forget batch."""
    base = make_loss_fn(cfg, reference)

    def loss_fn(model, batch):
        f = batch["forget"]
        with torch.no_grad():
            ref_logits = reference(input_ids=f["input_ids"], attention_mask=f["attention_mask"]).logits
        labels = torch.where(f["scored"] > 0, f["input_ids"], torch.full_like(f["input_ids"], -100))
        ref_logp, _ = token_logp(ref_logits, labels)
        return base(model, {**batch, "forget": {**f, "ref_logp": ref_logp}})

    return loss_fn


def frozen_reference(model):
    """A run's frozen reference: no gradients, on the engine's device and in its precision
    (as pipeline.training.unlearn.prepare_reference)."""
    for q in model.parameters():
        q.requires_grad_(False)
    model = model.eval().to("cuda" if torch.cuda.is_available() else "cpu")
    return model.to(torch.bfloat16) if TrainConfig().use_bf16() else model


def bench_steps(args, work: Path) -> dict:
    from transformers import LlamaForCausalLM

    config = random_llama_config(args.hidden, args.layers, args.vocab, 512)

    def factory():
        torch.manual_seed(0)
        return LlamaForCausalLM(config)

    reference = frozen_reference(factory())
    shards = write_synthetic_shards(work / "steps", 4 * args.batch, 64, args.seq, args.vocab)
    base = UnlearnConfig(method="ga")
    weighted = {name: replace(base, weighting=w) for name, w in (("ga", "uniform"), ("t_ga", "hard"), ("s_ga", "soft"))
                if name in args.variants}
    t = interleaved_step_times(factory, {
        name: (make_loss_fn(cfg, reference), batches(shards, cfg, 4, args.batch, args.seq, args.vocab))
        for name, cfg in weighted.items()}, args.steps)
    result = {"model_parameters_M": round(sum(q.numel() for q in reference.parameters()) / 1e6, 1),
              "batch": f"{args.batch} forget + {args.batch} retain x {args.seq} tokens",
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              **{f"{v}_over_ga": round(t[v] / t["ga"], 3) for v in ("t_ga", "s_ga") if v in t}}
    result.update(model_flops_utilisation(reference, args, t["ga"]))
    if args.profile:
        print("\n".join(profile_steps(factory, make_loss_fn(weighted["ga"], reference),
                                     batches(shards, weighted["ga"], 4, args.batch, args.seq, args.vocab))), flush=True)
    if args.no_npo:
        return {**result, "median_step_s": {k: round(v, 4) for k, v in t.items()}}
    # With the KL retain term a step is about 7 forward-pass units (forget and retain forward and backward, the
    # reference on retain); the reference forward on the forget batch adds one, so 7/8 bounds the ratio. The
    # objective alone (no retain term) is 3 units against 4.
    npo = UnlearnConfig(method="npo", weighting="hard")
    npo_alone = replace(npo, retain_loss="none")
    npo_data = batches(shards, npo, 4, args.batch, args.seq, args.vocab)
    t.update(interleaved_step_times(factory, {
        "t_npo_cached_ref": (make_loss_fn(npo, reference), npo_data),
        "t_npo_ref_forward": (npo_with_reference_forward(npo, reference), npo_data),
        "t_npo_cached_ref_no_retain": (make_loss_fn(npo_alone, reference), npo_data),
        "t_npo_ref_forward_no_retain": (npo_with_reference_forward(npo_alone, reference), npo_data)}, args.steps))
    return {**result, "median_step_s": {k: round(v, 4) for k, v in t.items()},
            "npo_cached_over_ref_forward": round(t["t_npo_cached_ref"] / t["t_npo_ref_forward"], 3),
            "npo_cached_over_ref_forward_no_retain_term": round(
                t["t_npo_cached_ref_no_retain"] / t["t_npo_ref_forward_no_retain"], 3)}


# Dense bf16 peak of the GPUs we have numbers for (vendor datasheets, no sparsity), in TFLOP/s.
PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0}


def model_flops_utilisation(model, args, step_s: float) -> dict:
    """MFU of the GA step with the KL retain term: forward and backward on the forget and on the retain batch, and
    the reference's forward on the retain batch, 2 FLOPs per parameter and token forward, 4 backward (the input
    embedding is a lookup, not counted; attention's two products add 4·layers·seq·hidden per token forward)."""
    if not torch.cuda.is_available():
        return {}
    name = torch.cuda.get_device_name()
    peak = args.peak_tflops or next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
    cfg = model.config
    n = sum(q.numel() for q in model.parameters()) - model.get_input_embeddings().weight.numel() * (
        not cfg.tie_word_embeddings)
    tokens = args.batch * args.seq
    per_token = 2 * n + 2 * 2 * cfg.num_hidden_layers * args.seq * cfg.hidden_size  # forward, with attention
    flops = tokens * per_token * (3 + 3 + 1)  # forget fwd+bwd, retain fwd+bwd, reference fwd
    achieved = flops / step_s / 1e12
    return {"ga_step_tflops": round(achieved, 1), "peak_bf16_tflops": peak,
            "mfu": round(achieved / peak, 3) if peak else None}


def profile_steps(model_factory, loss_fn, data: list[dict], steps: int = 3) -> list[str]:
    """The operators that take the most device (or CPU) time over a few GA steps, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    engine = Engine(model_factory(), TrainConfig(lr=1e-5, micro_batch_size=8), steps + 2)
    for step in range(2):
        engine.train_step([data[step % len(data)]], loss_fn)
    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for step in range(steps):
            engine.train_step([data[step % len(data)]], loss_fn)
        if cuda:
            torch.cuda.synchronize()
    engine.close()
    table = prof.key_averages().table(sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=15)
    return table.splitlines()


def read_epoch(shards: Path, micro_batch: int, window_shards: int) -> tuple[int, float]:
    """Batches of one epoch, as the trainer asks for them (one process): (count, seconds)."""
    stream = ForgetStream(shards, UnlearnConfig(weighting="soft").weighting_spec, window_shards=window_shards)
    schedule = StepSchedule(len(stream), micro_batch, 1, 1, 0, order=stream.epoch_order)
    start, n = time.perf_counter(), 0
    for step in range(schedule.steps_per_epoch):
        for idx in schedule.micro_batches(step, 0):
            forget_batch(stream.get(idx), 0)
            n += 1
    return n, time.perf_counter() - start


def bench_reader(args, work: Path) -> dict:
    """The paper sweep's model step (configs/paper.yaml: model.config, tokenizer vocabulary, unlearn batch size)
    on TOFU-length samples, against the reader's time per batch over a 16-shard epoch."""
    import yaml
    from transformers import LlamaConfig, LlamaForCausalLM

    params = yaml.safe_load((REPO / "configs" / "paper.yaml").read_text())  # the 4-layer model of the figures
    vocab, batch = params["tokenizer"]["vocab_size"], params["unlearn"]["train"]["micro_batch_size"]
    config = LlamaConfig(vocab_size=vocab, **params["model"]["config"])
    length, rows = 96, params["attribution"]["rows_per_shard"]
    shards = write_synthetic_shards(work / "reader", 16 * rows, rows, length, vocab)

    def factory():
        torch.manual_seed(0)
        return LlamaForCausalLM(config)

    cfg = UnlearnConfig(method="ga", weighting="hard")
    step_s = interleaved_step_times(factory, {"t_ga": (make_loss_fn(cfg, frozen_reference(factory())),
                                                       batches(shards, cfg, 4, batch, length, vocab))}, args.steps)
    n, seconds = read_epoch(shards, batch, window_shards=4)
    per_batch = seconds / n
    return {"trainer": f"embedded default model, {sum(q.numel() for q in factory().parameters()) / 1e6:.2f}M "
                       f"parameters, T-GA with the KL retain term, {batch} + {batch} x {length} tokens",
            "trainer_step_s": round(step_s["t_ga"], 4), "reader_batch_s": round(per_batch, 5),
            "reader_batches": n, "shards": 16, "reader_over_trainer_speed": round(step_s["t_ga"] / per_batch, 1)}


CHILD = """
import json, resource, sys
from pathlib import Path
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/benchmarks"]
from pipeline.data.batching import StepSchedule
from pipeline.training.forget_batches import forget_batch
from pipeline.training.forget_stream import ForgetStream, Weighting
def rss_mib():
    return int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize() / 2**20
stream = ForgetStream(Path(sys.argv[2]), Weighting("soft"), window_shards=4)
schedule = StepSchedule(len(stream), 16, 1, 1, 0, order=stream.epoch_order)
before = rss_mib()
for step in range(schedule.steps_per_epoch):
    forget_batch(stream.get(schedule.micro_batches(step, 0)[0]), 0)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"peak_rss_mib": round(peak), "growth_mib": round(peak - before, 1)}))
"""


def bench_memory(args, work: Path) -> dict:
    """Peak RSS of a fresh process (the reader's imports only) reading one epoch, 8 against 64 shards of 256
    rows, and its growth over the RSS it had before the first batch."""
    out = {}
    for n_shards in (8, 64):
        shards = write_synthetic_shards(work / f"mem{n_shards}", n_shards * 256, 256, 96, 2048)
        child = subprocess.run([sys.executable, "-c", CHILD, str(REPO), str(shards)], capture_output=True,
                               text=True, check=True)
        out[n_shards] = json.loads(child.stdout.strip().splitlines()[-1])
    return {"peak_rss_mib": {f"{k} shards ({k * 256} samples)": v["peak_rss_mib"] for k, v in out.items()},
            "growth_while_reading_mib": {f"{k} shards": v["growth_mib"] for k, v in out.items()},
            "peak_ratio_64_over_8": round(out[64]["peak_rss_mib"] / out[8]["peak_rss_mib"], 3)}


BENCHES = {"steps": bench_steps, "reader": bench_reader, "memory": bench_memory}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=sorted(BENCHES), action="append", help="run only these parts")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=96)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--no-npo", action="store_true", help="steps: only GA, T-GA and S-GA (a model too large for 7 "
                   "engines at once)")
    p.add_argument("--variants", type=lambda v: v.split(","), default=["ga", "t_ga", "s_ga"],
                   help="steps: the engines held at once, of ga,t_ga,s_ga (ga alone leaves the GPU to a larger batch)")
    p.add_argument("--profile", action="store_true", help="steps: also the top operators of a GA step")
    p.add_argument("--peak-tflops", type=float, help="the GPU's dense bf16 peak, for MFU [known GPUs: datasheet]")
    args = p.parse_args()
    init_distributed()
    with tempfile.TemporaryDirectory() as work:
        for name in args.only or BENCHES:
            print(json.dumps({name: BENCHES[name](args, Path(work))}), flush=True)


if __name__ == "__main__":
    from pipeline.common.cli_errors import run_script  # as the CLI: one line per error, an exit status
    run_script(main)
