"""Stage one's speed and memory, as ratios measured in one run.

1. Attribution time (both passes in one batch, log-probabilities and entropy only at scored positions, in
   chunks) against one plain forward pass (full logits) over the same batches, on a ~110M-parameter Llama.
   The floor is 2.0 (two passes); the goal is at most 2.2.
2. Peak memory of the lm-head step for a 151,936-token vocabulary (Qwen's): chunked against full logits.
3. spaCy tagging rate, batched (goal: at least 500 questions/s), on real TOFU questions when available.
4. Peak memory of `tokenunlearn attribute` on a world of N and of 4N samples (streamed writes: independent of N).

    python benchmarks/bench_attribution.py            # all of it, a few minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from _models import random_llama_config  # noqa: E402  (beside this script)
from pipeline.attribution.signals import AttributionInput, score_batch  # noqa: E402


def synthetic_inputs(n: int, length: int, vocab: int, seed: int = 0) -> list[AttributionInput]:
    g = torch.Generator().manual_seed(seed)
    prompt = int(0.4 * length)
    out = []
    for i in range(n):
        ids = torch.randint(5, vocab, (length,), generator=g).tolist()
        scored = [p >= prompt for p in range(length)]
        masked = [p in (3, 4, 9, 10, 11) for p in range(length)]
        out.append(AttributionInput(i, "", ids, [(p, p + 1) for p in range(length)], scored, masked, mask_id=4))
    return out


def time_it(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def bench_passes(args) -> dict:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(random_llama_config(args.hidden, args.layers, args.vocab, 1024)).eval()
    if torch.cuda.is_available():  # as stage one runs on a GPU: bf16 weights, fp32 log-probabilities
        model = model.to("cuda", torch.bfloat16)
    device = next(model.parameters()).device
    params = sum(p.numel() for p in model.parameters())
    batches = [synthetic_inputs(args.batch, args.seq, args.vocab, seed=b) for b in range(args.batches)]
    tensors = [(torch.tensor([x.input_ids for x in b], device=device),
                torch.ones(args.batch, args.seq, dtype=torch.long, device=device)) for b in batches]

    @torch.no_grad()
    def plain():
        for ids, mask in tensors:
            model(input_ids=ids, attention_mask=mask).logits.float().sum()  # the fp32 logits a plain scorer reads

    def attribution():
        for b in batches:
            score_batch(model, b, pad_id=0, chunk_size=args.chunk)

    plain(), attribution()  # warm up
    t_plain, t_attr = time_it(plain, args.repeats), time_it(attribution, args.repeats)
    return {"model_parameters_M": round(params / 1e6, 1), "device": str(device), "tokens_per_batch": args.batch * args.seq,
            "batches": args.batches, "plain_forward_s": round(t_plain, 3), "attribution_s": round(t_attr, 3),
            "attribution_over_plain": round(t_attr / t_plain, 3)}


def bench_lm_head_memory(args) -> dict:
    """Peak memory of the log-softmax step over N positions, in one block against in chunks (measured in a
    child process each, so the numbers do not mix)."""
    code = r"""
import resource, sys, torch
vocab, hidden, positions, chunk = map(int, sys.argv[1:5])
head = torch.nn.Linear(hidden, vocab, bias=False)
h = torch.randn(positions, hidden)
t = torch.randint(0, vocab, (positions,))
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
with torch.no_grad():
    for s in range(0, positions, chunk):
        lsm = torch.log_softmax(head(h[s:s + chunk]).float(), -1)
        lsm.gather(-1, t[s:s + chunk, None]); (-(lsm.exp() * lsm).sum(-1))
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base)
"""
    out = {}
    for label, chunk in (("full_logits", args.positions), ("chunked", args.chunk)):
        res = subprocess.run([sys.executable, "-c", code, str(151936), str(args.hidden), str(args.positions),
                              str(chunk)], capture_output=True, text=True, check=True)
        out[f"{label}_peak_MiB"] = round(int(res.stdout.strip()) / 1024, 1)
    out["positions"] = args.positions
    out["chunk_size"] = args.chunk
    out["full_over_chunked"] = round(out["full_logits_peak_MiB"] / max(out["chunked_peak_MiB"], 1e-9), 1)
    return out


def bench_spacy(tofu_dir: Path) -> dict:
    from pipeline.attribution.tagging import SpacyTagger
    from pipeline.data.tofu import load_split

    if (tofu_dir / "full.json").is_file():
        questions, source = [r["question"] for r in load_split(tofu_dir, "full")], "real TOFU full.json"
    else:
        from pipeline.data.world import WorldConfig, WorldSpec, generate_world

        world = generate_world(WorldSpec.load(REPO / "data/world"), WorldConfig(n_authors=200, questions_per_author=20))
        questions, source = [r["question"] for r in world.splits["full"]], "generated world, 200 x 20"
    tagger = SpacyTagger()
    tagger.noun_spans(questions[:64])  # warm up
    start = time.perf_counter()
    tagger.noun_spans(questions)
    elapsed = time.perf_counter() - start
    return {"questions": len(questions), "source": source, "seconds": round(elapsed, 2),
            "questions_per_s": round(len(questions) / elapsed)}


def bench_streaming_memory(n_authors: int) -> dict:
    """Peak RSS of `tokenunlearn attribute` (one child process each) on N and 4N forget samples."""
    import yaml

    from pipeline.common.modeling import build_model, load_tokenizer, save_model, train_tokenizer
    from pipeline.data.world import WorldConfig, WorldSpec, generate_world, world_texts, write_world

    peaks = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        spec = WorldSpec.load(REPO / "data/world")
        # A first, unmeasured run takes the one-off costs (caches filled on first use) out of the comparison.
        for label, n in (("warm-up", n_authors), ("N", n_authors), ("4N", 4 * n_authors)):
            world_dir = tmp / f"world{n}"
            if not world_dir.exists():
                write_world(generate_world(spec, WorldConfig(n_authors=n, questions_per_author=20)), world_dir)
            if not (tmp / "tok").exists():
                train_tokenizer(world_texts(world_dir), 2048, tmp / "tok")
                tok = load_tokenizer(tmp / "tok")
                cfg = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
                       "num_key_value_heads": 4, "max_position_embeddings": 256, "tie_word_embeddings": True}
                save_model(build_model(cfg, tok, 0), tok, tmp / "model")
            params = {"data": {"source": str(world_dir), "max_length": 256},
                      "attribution": {"model": str(tmp / "model"), "split": "full", "tagger": "spacy",
                                      "batch_size": 16, "rows_per_shard": 256}}
            (tmp / "params.yaml").write_text(yaml.safe_dump(params))
            wrapper = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); "
                       "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
            cmd = [sys.executable, "-c", wrapper, str(Path(sys.executable).parent / "tokenunlearn"), "attribute",
                   "--params", str(tmp / "params.yaml"), "--out", str(tmp / f"attr{n}"), "--metrics",
                   str(tmp / f"m{n}.json")]
            res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TQDM_DISABLE": "1"})
            if res.returncode:
                raise RuntimeError(res.stderr[-2000:])
            samples = json.loads((tmp / f"m{n}.json").read_text())["samples"]
            peaks[label] = {"samples": samples, "peak_rss_MiB": round(int(res.stdout.strip().splitlines()[-1]) / 1024)}
    peaks.pop("warm-up")
    peaks["4N_over_N"] = round(peaks["4N"]["peak_rss_MiB"] / peaks["N"]["peak_rss_MiB"], 3)
    return peaks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batches", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--positions", type=int, default=4096, help="positions for the lm-head memory comparison")
    p.add_argument("--stream-authors", type=int, default=50, help="N for the streaming-memory comparison")
    p.add_argument("--tofu", type=Path, default=REPO.parent / "shared/data/tofu")
    p.add_argument("--only", choices=["passes", "lm_head", "spacy", "memory"], default=None)
    args = p.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    benches = {"passes": lambda: bench_passes(args), "lm_head": lambda: bench_lm_head_memory(args),
               "spacy": lambda: bench_spacy(args.tofu), "memory": lambda: bench_streaming_memory(args.stream_authors)}
    for name, fn in benches.items():
        if args.only in (None, name):
            print(json.dumps({name: fn()}), flush=True)


if __name__ == "__main__":
    from pipeline.common.cli_errors import run_script  # as the CLI: one line per error, an exit status
    run_script(main)
