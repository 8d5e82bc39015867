"""Stage two's step time, as ratios measured in one run, on the real DeepSpeed engine and loss functions.

1. Token-level weighting costs nothing: T-GA's and S-GA's step time against GA's (goal: at most 1.05x).
2. NPO with the shards' cached reference log-probabilities against NPO that runs a reference forward pass on
   the forget batch every step, as common implementations do (goal: at most 0.8x).

    python benchmarks/bench_unlearn.py        # about two minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from _models import random_llama_config  # noqa: E402  (beside this script)
from pipeline.engine import Engine, TrainConfig, init_distributed  # noqa: E402
from pipeline.objectives import token_logp  # noqa: E402
from pipeline.unlearn import ForgetSample, UnlearnConfig, forget_batch, make_loss_fn  # noqa: E402
from pipeline.weights import token_weights  # noqa: E402


def synthetic(n: int, length: int, vocab: int, cfg: UnlearnConfig, seed: int) -> list[ForgetSample]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        scored = np.arange(length) >= int(0.4 * length)
        phi = np.full(length, np.nan)
        phi[scored] = rng.random(scored.sum())
        weights = np.zeros(length)
        weights[scored] = token_weights(cfg.weighting, phi[scored], r=cfg.r, tau=cfg.tau)
        ref = np.where(scored, -rng.random(length) * 3, 0.0)
        out.append(ForgetSample(i, rng.integers(5, vocab, length).tolist(), scored, weights, ref, phi))
    return out


def retain_batch(n: int, length: int, vocab: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (n, length), generator=g)
    labels = ids.clone()
    labels[:, : int(0.4 * length)] = -100
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def step_times(model_factory, cfg: UnlearnConfig, reference, batches, steps: int, loss_fn=None) -> float:
    model = model_factory()
    engine = Engine(model, TrainConfig(lr=1e-5, micro_batch_size=len(batches[0]["forget"]["input_ids"])), steps + 2)
    fn = loss_fn or make_loss_fn(cfg, reference)
    times = []
    for step in range(steps + 2):
        start = time.perf_counter()
        engine.train_step([batches[step % len(batches)]], fn)
        times.append(time.perf_counter() - start)
    engine.close()
    return statistics.median(times[2:])  # the first steps warm up


def npo_with_reference_forward(cfg: UnlearnConfig, reference):
    """NPO as common implementations run it: log p_ref from a reference forward pass on the forget batch."""
    base = make_loss_fn(cfg, reference)

    def loss_fn(model, batch):
        f = batch["forget"]
        with torch.no_grad():
            ref_logits = reference(input_ids=f["input_ids"], attention_mask=f["attention_mask"]).logits
        labels = torch.where(f["scored"] > 0, f["input_ids"], torch.full_like(f["input_ids"], -100))
        ref_logp, _ = token_logp(ref_logits, labels)
        batch = {**batch, "forget": {**f, "ref_logp": ref_logp}}
        return base(model, batch)

    return loss_fn


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=96)
    p.add_argument("--steps", type=int, default=8)
    args = p.parse_args()
    from transformers import LlamaForCausalLM

    init_distributed()
    config = random_llama_config(args.hidden, args.layers, args.vocab, 512)

    def factory():
        torch.manual_seed(0)
        return LlamaForCausalLM(config)

    reference = factory().eval()
    for q in reference.parameters():
        q.requires_grad_(False)
    params_m = sum(q.numel() for q in reference.parameters()) / 1e6

    def batches(cfg):
        return [{"forget": forget_batch(synthetic(args.batch, args.seq, args.vocab, cfg, seed=b), 0),
                 "retain": retain_batch(args.batch, args.seq, args.vocab, seed=b)} for b in range(4)]

    results = {"model_parameters_M": round(params_m, 1), "batch": f"{args.batch} forget + {args.batch} retain x "
               f"{args.seq} tokens", "median_step_s": {}}
    base = UnlearnConfig(method="ga")
    for name, cfg in (("ga", base), ("t_ga", replace(base, weighting="hard")),
                      ("s_ga", replace(base, weighting="soft"))):
        results["median_step_s"][name] = round(step_times(factory, cfg, reference, batches(cfg), args.steps), 4)
    npo = UnlearnConfig(method="npo", weighting="hard")
    results["median_step_s"]["t_npo_cached_ref"] = round(step_times(factory, npo, reference, batches(npo),
                                                                    args.steps), 4)
    results["median_step_s"]["t_npo_ref_forward"] = round(step_times(
        factory, npo, reference, batches(npo), args.steps, loss_fn=npo_with_reference_forward(npo, reference)), 4)
    t = results["median_step_s"]
    results["t_ga_over_ga"] = round(t["t_ga"] / t["ga"], 3)
    results["s_ga_over_ga"] = round(t["s_ga"] / t["ga"], 3)
    results["npo_cached_over_ref_forward"] = round(t["t_npo_cached_ref"] / t["t_npo_ref_forward"], 3)
    print(json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
