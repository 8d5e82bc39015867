"""A fused LM-head loss against the chunked head that every TokenUnlearn loss uses, with per-token weights.

The quantity is a token-weighted forget term, L = Σ_i ω_i log p(s_i | s_<i) / Σ_i ω_i (gradient ascent's, with
soft weights ω and some ω_i = 0 as hard weights have), over N positions, and its gradients with respect to the
hidden states and the head's weight (whole-model training trains the head). Three ways:

- full:    the head's logits for all N positions at once, upcast to fp32 (open-unlearning's way);
- chunked: `pipeline.training.losses.by_chunks` (1024 positions at a time, recomputed in the backward pass);
- liger:   Liger-Kernel's fused linear cross-entropy with `reduction="none"` (its per-token gradient is folded in
           before the head's weight gradient is summed, so per-token weights are exact).

Each way's loss and gradients are checked against an fp64 reference (relative error ‖x − ref‖ / ‖ref‖), on
fresh random inputs; peak allocated GPU memory over what the inputs hold, and the median of interleaved timed
forward + backward passes (CUDA events) follow. CUDA only: Liger's kernels are Triton.

    python benchmarks/bench_fused_head.py                           # Llama-3-8B's head, 8 x 512 positions
    python benchmarks/bench_fused_head.py --hidden 2048 --vocab 32000
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pipeline.training.losses import by_chunks, token_logp_from_logits  # noqa: E402


def weighted_logp_mean(logp: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (weights * logp).sum() / weights.sum()


def full_logits_loss(h, w, targets, weights):
    return weighted_logp_mean(token_logp_from_logits(F.linear(h, w).float(), targets), weights)


def chunked_loss(h, w, targets, weights, chunk: int = 1024):
    return weighted_logp_mean(by_chunks(token_logp_from_logits, lambda x: F.linear(x, w), h, targets, chunk=chunk),
                              weights)


def liger_loss(h, w, targets, weights):
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    ce = liger_fused_linear_cross_entropy(h, w, targets, reduction="none")  # fp32, −log p per position
    return weighted_logp_mean(-ce, weights)


WAYS = {"full": full_logits_loss, "chunked": chunked_loss, "liger": liger_loss}


def draw(n: int, hidden: int, vocab: int, dtype, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(n, hidden, device="cuda", generator=g).to(dtype).requires_grad_()
    w = (0.02 * torch.randn(vocab, hidden, device="cuda", generator=g)).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (n,), device="cuda", generator=g)
    weights = torch.rand(n, device="cuda", generator=g)
    weights[torch.rand(n, device="cuda", generator=g) < 0.5] = 0.0  # hard weighting's unselected tokens
    return h, w, targets, weights


def loss_and_grads(fn, h, w, targets, weights):
    h.grad = w.grad = None
    loss = fn(h, w, targets, weights)
    loss.backward()
    return loss.detach().double(), h.grad.double(), w.grad.double()


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x - ref).norm() / ref.norm())


def check(args) -> dict:
    """Each way against the fp64 reference on fresh inputs (seed 1): loss and both gradients."""
    h, w, targets, weights = draw(args.positions, args.hidden, args.vocab, torch.bfloat16, seed=1)
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = loss_and_grads(full_logits_loss, h64, w64, targets, weights.double())
    del h64, w64
    out = {}
    for name, fn in WAYS.items():
        got = loss_and_grads(fn, h, w, targets, weights)
        out[name] = {"loss_rel_err": rel(got[0], ref[0]), "grad_hidden_rel_err": rel(got[1], ref[1]),
                     "grad_head_rel_err": rel(got[2], ref[2])}
        del got
    return {k: {m: float(f"{v:.2e}") for m, v in d.items()} for k, d in out.items()}


def peak_memory(args) -> dict:
    """Peak allocated memory of one forward + backward over what the inputs (and the gradients' buffers) hold."""
    h, w, targets, weights = draw(args.positions, args.hidden, args.vocab, torch.bfloat16, seed=2)
    out = {}
    for name, fn in WAYS.items():
        loss_and_grads(fn, h, w, targets, weights)  # allocates h.grad, w.grad once
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn(h, w, targets, weights).backward()
        torch.cuda.synchronize()
        out[name] = round((torch.cuda.max_memory_allocated() - base) / 2**20)
    return out


def step_times(args) -> dict:
    """Median forward + backward time of each way, one of each in turn (rounds), CUDA events."""
    h, w, targets, weights = draw(args.positions, args.hidden, args.vocab, torch.bfloat16, seed=3)
    times = {name: [] for name in WAYS}
    for r in range(args.warmup + args.repeats):
        for name, fn in WAYS.items():
            h.grad = w.grad = None
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(h, w, targets, weights).backward()
            end.record()
            torch.cuda.synchronize()
            if r >= args.warmup:
                times[name].append(start.elapsed_time(end))
    return {name: round(statistics.median(t), 3) for name, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--positions", type=int, default=8 * 512, help="scored positions (batch x length)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_fused_head.py needs a CUDA GPU: Liger-Kernel's fused linear cross-entropy is Triton")
    errors, memory, ms = check(args), peak_memory(args), step_times(args)
    print(json.dumps({"device": torch.cuda.get_device_name(), "positions": args.positions, "hidden": args.hidden,
                      "vocab": args.vocab, "rel_err_vs_fp64": errors, "peak_over_inputs_mib": memory,
                      "median_fwd_bwd_ms": ms,
                      "liger_over_chunked": {"memory": round(memory["liger"] / memory["chunked"], 3),
                                             "time": round(ms["liger"] / ms["chunked"], 3)}}), flush=True)


if __name__ == "__main__":
    from pipeline.common.cli_errors import run_script  # as the CLI: one line per error, an exit status
    run_script(main)
