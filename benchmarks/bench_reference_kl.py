"""The cached KL retain term against the exact one: KL(p_θo ‖ p_θ) on the retain answers, with θ_o's full
next-token distribution (a reference model held beside θ) and with its top-k plus one tail bucket (the reference
cache, `tokenunlearn reference`), for k in {8, 32, 128}.

θ is θ_o after a few steps of gradient ascent on the forget answers (an unlearning run's first steps: the regime
the retain term works in). Two models: the paper sweep's target (2k vocabulary,
experiments/artifacts/paper/models/target) and a random Llama with a 32k vocabulary (its near-uniform next-token
distributions are the hard case for a top-k cache).

    python benchmarks/bench_reference_kl.py                      # both, about 2 minutes on 2 cores
    python benchmarks/bench_reference_kl.py --only embedded

Prints, per model and k: the mean per-sample KL (summed over answer positions, as the trainer's term) exact and
cached, the relative error, and the mean θ_o mass the top-k holds.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from _models import random_llama_config  # noqa: E402  (beside this script)
from pipeline.attribution.reference import topk_reference  # noqa: E402
from pipeline.data.batching import pad_batch  # noqa: E402
from pipeline.training.losses import forward_kl_from_logits, topk_kl_from_logits  # noqa: E402

KS = (8, 32, 128)


def ascend(model, forget: list, steps: int, lr: float) -> None:
    """`steps` of gradient ascent on the forget answers (GA's objective), in place."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for step in range(steps):
        batch = pad_batch(forget[(step * 8) % len(forget):][:8], 0)
        loss = -model(**batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


@torch.no_grad()
def compare(reference, model, retain: list, batch_size: int = 16) -> dict:
    """Per-sample KL summed over answer positions, exact and cached for each k, averaged over the retain samples."""
    sums = {"exact": 0.0, **{k: 0.0 for k in KS}}
    mass = {k: 0.0 for k in KS}
    positions = 0
    for s in range(0, len(retain), batch_size):
        batch = pad_batch(retain[s: s + batch_size], 0)
        kw = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        rows, cols = (batch["labels"][:, 1:] != -100).nonzero(as_tuple=True)
        ref_logits, logits = reference(**kw).logits[rows, cols], model(**kw).logits[rows, cols]
        sums["exact"] += forward_kl_from_logits(ref_logits, logits).sum().item()
        for k in KS:
            ids, logp, tail = topk_reference(ref_logits, k)
            sums[k] += topk_kl_from_logits(logits, ids, logp, tail).sum().item()
            mass[k] += logp.exp().sum(-1).sum().item()
        positions += len(rows)
    exact = sums["exact"] / len(retain)
    out = {"retain_samples": len(retain), "positions": positions, "kl_exact": round(exact, 6)}
    for k in KS:
        cached = sums[k] / len(retain)
        out[f"k{k}"] = {"kl_cached": round(cached, 6), "relative_error": round((cached - exact) / exact, 4),
                        "top_k_mass": round(mass[k] / positions, 4)}
    return out


def embedded(args) -> dict:
    from pipeline.common.modeling import load_model, load_tokenizer
    from pipeline.data.config import DataConfig, retain_samples

    model_dir = REPO / "experiments" / "artifacts" / "paper" / "models" / "target"
    if not model_dir.is_dir():
        raise SystemExit(f"{model_dir}: build it first (cd experiments && dvc repro paper/dvc.yaml:finetune@target)")
    tok = load_tokenizer(model_dir)
    data = DataConfig(source=str(REPO / "experiments" / "artifacts" / "paper" / "world"))
    retain = retain_samples(data, tok, "retain90")[: args.samples]
    forget = retain_samples(data, tok, "forget10")
    reference, model = load_model(model_dir).eval(), load_model(model_dir)
    torch.manual_seed(0)
    ascend(model, forget, args.steps, args.lr)
    return {"model": "embedded target (3.2M parameters, vocabulary 2048)", **compare(reference, model, retain)}


def random_32k(args) -> dict:
    from transformers import LlamaForCausalLM

    from pipeline.data.templates import IGNORE_INDEX, EncodedSample

    torch.manual_seed(0)
    config = random_llama_config(256, 4, 32000, 256)
    reference = LlamaForCausalLM(config).eval()
    model = LlamaForCausalLM(config)
    model.load_state_dict(reference.state_dict())
    g = torch.Generator().manual_seed(1)

    def sample(n: int) -> EncodedSample:
        ids = torch.randint(5, 32000, (n,), generator=g).tolist()
        labels = [IGNORE_INDEX] * (n // 2) + ids[n // 2:]
        return EncodedSample("", ids, labels, [], (0, 0), (0, 0), n // 2)

    retain = [sample(64) for _ in range(args.samples)]
    forget = [sample(64) for _ in range(32)]
    ascend(model, forget, args.steps, args.lr)
    return {"model": f"random Llama ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, "
                     "vocabulary 32000)", **compare(reference, model, retain)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=["embedded", "random"])
    parser.add_argument("--samples", type=int, default=128, help="retain samples scored")
    parser.add_argument("--steps", type=int, default=10, help="gradient-ascent steps from θ_o to θ")
    parser.add_argument("--lr", type=float, default=2e-4)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    for name, fn in (("embedded", embedded), ("random", random_32k)):
        if args.only in (None, name):
            print(json.dumps(fn(args), indent=1), flush=True)


if __name__ == "__main__":
    from pipeline.common.cli_errors import run_script  # as the CLI: one line per error, an exit status
    run_script(main)
