"""Multiple-choice scoring's peak memory, as a ratio measured in one run: the old way (the model's full logits,
[batch, length, vocab], of which only the last position was read) against `continuation_logprobs` (the decoder's
hidden states, then the LM head at the positions read only), on a random Llama with a 32k vocabulary and long
prompts (WMDP-cyber's are often a thousand tokens and more). Both score the same items; their scores must agree.

Each way runs in a child process of its own, so the peaks do not mix: on CPU the growth of the process's peak
resident memory over its resident memory before scoring (the peak reset through /proc/self/clear_refs where the
kernel allows it), on CUDA torch's peak allocated memory over what was allocated before.

    python benchmarks/bench_mc_memory.py                         # about a minute on 2 cores
    python benchmarks/bench_mc_memory.py --items 32 --length 2048 --vocab 128256
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

# One way, in a child process: build the model and the items (seeded: the same in both children), warm up, then
# score and print the peak memory growth; the scores go to a file for the parent to compare.
CHILD = r"""
import json, sys
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/benchmarks"]
import torch
from _models import random_llama_config
from bench_mc_memory import full_logits_scores, inputs
from pipeline.evaluation.mc_scoring import continuation_logprobs
from transformers import LlamaForCausalLM

way, args = sys.argv[2], json.loads(sys.argv[3])
torch.manual_seed(0)
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
model = LlamaForCausalLM(random_llama_config(args["hidden"], args["layers"], args["vocab"], args["length"] + 8))
model = model.to(device).eval()
contexts, conts = inputs(args["items"], args["length"], args["vocab"])
score = {"full_logits": lambda c, k: full_logits_scores(model, c, k, args["batch"]),
         "positions_read": lambda c, k: continuation_logprobs(model, c, k, 0, args["batch"], max_length=None)}[way]
score(contexts[:2], conts[:2])  # warm-up: kernels, thread pools

def rss_mib(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) / 1024
    raise KeyError(field)

if device.type == "cuda":
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() / 2**20
else:
    try:
        open("/proc/self/clear_refs", "w").write("5")  # resets the peak (VmHWM) to the current RSS
    except OSError:
        pass
    before = rss_mib("VmRSS:")
scores = score(contexts, conts)
if device.type == "cuda":
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2**20
else:
    peak = rss_mib("VmHWM:")
open(sys.argv[4], "w").write(json.dumps(scores.cpu().tolist()))
print(json.dumps({"growth_mib": round(peak - before, 1), "device": device.type}))
"""


def inputs(n: int, length: int, vocab: int) -> tuple[list[list[int]], list[list[list[int]]]]:
    """`n` prompts of about `length` tokens (80-100%, as real sets vary) and four one-token letters each."""
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(int(0.8 * length), length + 1, (n,), generator=g).tolist()
    contexts = [torch.randint(5, vocab, (k,), generator=g).tolist() for k in lengths]
    letters = torch.randint(5, vocab, (4,), generator=g).tolist()
    return contexts, [[[t] for t in letters] for _ in contexts]


@torch.no_grad()
def full_logits_scores(model, contexts, conts, batch_size: int) -> torch.Tensor:
    """The former scorer: one forward pass over right-padded contexts, the model's full logits, the last real
    position's log-softmax."""
    device = next(model.parameters()).device
    out = torch.empty(len(contexts), len(conts[0]))
    for start in range(0, len(contexts), batch_size):
        seqs = contexts[start: start + batch_size]
        ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, s in enumerate(seqs):
            ids[row, :len(s)], mask[row, :len(s)] = torch.tensor(s), 1
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits  # [batch, length, vocab]
        last = torch.tensor([len(s) - 1 for s in seqs], device=device)
        logp = torch.log_softmax(logits[torch.arange(len(seqs), device=device), last].float(), -1)
        wanted = torch.tensor([[c[0] for c in per] for per in conts[start: start + batch_size]], device=device)
        out[start: start + len(seqs)] = logp.gather(-1, wanted).cpu()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--items", type=int, default=32)
    p.add_argument("--length", type=int, default=1024, help="prompt tokens (the longest)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    args = p.parse_args()
    out: dict = {"setup": {**vars(args), "model": "random Llama"}}
    with tempfile.TemporaryDirectory() as tmp:
        scores = {}
        for way in ("full_logits", "positions_read"):
            file = Path(tmp) / f"{way}.json"
            res = subprocess.run([sys.executable, "-c", CHILD, str(REPO), way, json.dumps(vars(args)), str(file)],
                                 capture_output=True, text=True, check=False)
            if res.returncode != 0:
                sys.exit(f"{way}: the child failed:\n{res.stderr[-3000:]}")
            out[way] = json.loads(res.stdout.strip().splitlines()[-1])
            scores[way] = torch.tensor(json.loads(file.read_text()))
    out["max_abs_score_diff"] = float((scores["full_logits"] - scores["positions_read"]).abs().max())
    out["full_over_positions_read"] = round(out["full_logits"]["growth_mib"]
                                            / max(out["positions_read"]["growth_mib"], 1e-9), 1)
    print(json.dumps(out))


if __name__ == "__main__":
    from pipeline.common.cli_errors import run_script  # as the CLI: one line per error, an exit status
    run_script(main)
