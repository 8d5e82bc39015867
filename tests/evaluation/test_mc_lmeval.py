"""Letter scoring equals lm-evaluation-harness's, item by item: the same log-likelihood of every " A" … " D"
(max abs diff ≤ 1e-4 in float32) and the same letter, with BOS from the tokenizer, forced on or off, and with
items longer than the model's max length (left-truncated by both) and multi-token letters.

lm-eval 0.4.13 comes from `tests/lm_eval_site.py` (installed once into `.cache/`, never into the venv; skipped
where it cannot be installed); the harness runs in a subprocess, with that folder on its PYTHONPATH.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.common.modeling import build_model, load_model, load_tokenizer, save_model
from pipeline.data.mc_items import LETTERS
from pipeline.data.wmdp import load_wmdp
from pipeline.evaluation.mc_scoring import encode_continuations, format_prompt, letter_logprobs, resolve_max_length

from tests.conftest import cli_env
from tests.lm_eval_site import OFFLINE, lm_eval_site

pytestmark = pytest.mark.slow  # lm-evaluation-harness itself, in a subprocess

MAX_POSITIONS = 160  # the model's max_position_embeddings: half the items below are longer


@pytest.fixture(scope="session", name="lm_eval_site")
def lm_eval_site_fixture() -> Path:
    return lm_eval_site()


# The harness's side: HFLM.loglikelihood on exactly the requests its wmdp_* / mmlu_* tasks send.
HARNESS = r"""
import json, logging, sys
logging.disable(logging.WARNING)
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM

job = json.load(sys.stdin)
out = {}
for name, model_args in job["runs"].items():
    lm = HFLM(pretrained=job["model"], device="cpu", batch_size=4, dtype="float32", **model_args)
    requests = [Instance("loglikelihood", doc={}, arguments=(prompt, cont), idx=j, metadata=("t", i, 1))
                for i, prompt in enumerate(job["prompts"]) for j, cont in enumerate(job["continuations"])]
    out[name] = {"max_length": lm.max_length,
                 "lls": [ll for ll, _greedy in lm.loglikelihood(requests, disable_tqdm=True)]}
print(json.dumps(out))
"""


def harness_loglikelihoods(site: Path, model_dir: Path, prompts: list[str], runs: dict) -> dict:
    job = {"model": str(model_dir), "prompts": prompts, "continuations": [f" {x}" for x in LETTERS], "runs": runs}
    # cli_env: none of the process-group variables that in-process engine runs set in this test process
    env = {**cli_env(), **OFFLINE, "PYTHONPATH": str(site), "TOKENIZERS_PARALLELISM": "false"}
    res = subprocess.run([sys.executable, "-c", HARNESS], input=json.dumps(job), capture_output=True, text=True,
                         env=env, cwd=model_dir.parent, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    return {name: (r["max_length"], torch.tensor(r["lls"], dtype=torch.float64).view(len(prompts), len(LETTERS)))
            for name, r in out.items()}


WORDS = "cell virus gene port key acid salt heat code host file node wall base DNA RNA gas ion".split()


def wmdp_records() -> list[dict]:
    import random

    rng = random.Random(0)
    records = [
        {"question": "Which organelle makes ATP?", "choices": ["Nucleus", "Mitochondrion", "Ribosome", "Golgi"],
         "answer": 1},
        {"question": "  What does DNA polymerase do?  ", "choices": ["Copies DNA", "Cuts RNA", "Folds", "None"],
         "answer": 0},
        {"question": "Port 22 is used by?", "choices": ["HTTP", "FTP", "SSH", "DNS"], "answer": 2},
    ]
    for k in range(9):  # longer than the model's 160 positions: left-truncated by the harness
        detail = " ".join(f"Detail {d} about the {rng.choice(WORDS)} of the {rng.choice(WORDS)}." for d in range(k + 4))
        records.append({"question": f"A long question. {detail} Which one?",
                        "choices": [" ".join(rng.sample(WORDS, 2)) for _ in range(4)], "answer": k % 4})
    records += [{"question": f"Which {rng.choice(WORDS)} binds the {rng.choice(WORDS)}?",
                 "choices": [rng.choice(WORDS) for _ in range(4)], "answer": k % 4} for k in range(6)]
    return records


@pytest.fixture(scope="module")
def scored_model(micro_tokenizer, tmp_path_factory):
    """A tiny random Llama (160 positions; large init so that the letters depend on the context) and the items."""
    out = tmp_path_factory.mktemp("lmeval")
    config = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 4, "max_position_embeddings": MAX_POSITIONS, "initializer_range": 0.5}
    save_model(build_model(config, micro_tokenizer, seed=0), micro_tokenizer, out / "model")
    data = out / "wmdp-bio.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in wmdp_records()))
    return out / "model", load_wmdp(data)


# Run name -> (lm-eval's model args, this project's letter_logprobs options).
RUNS = {
    "default": ({}, {}),                                                  # BOS from the tokenizer, max_length 64
    "bos": ({"add_bos_token": True}, {"add_bos_token": True}),
    "no_bos": ({"add_bos_token": False}, {"add_bos_token": False}),       # lm-eval <= 0.4.9.1's default
    "max_length_110": ({"max_length": 110}, {"max_length": 110}),  # an override: two more items cut
}


def test_letter_scores_equal_lm_evaluation_harness_item_by_item(lm_eval_site, scored_model):
    model_dir, items = scored_model
    model, tokenizer = load_model(model_dir, torch.float32), load_tokenizer(model_dir)
    prompts = [format_prompt(it) for it in items]
    assert items[0].subject == "biology"
    # The cases are really there: a BOS-adding tokenizer, a two-token letter, items over the model's length.
    contexts, conts = encode_continuations(tokenizer, prompts)
    assert all(ctx[0] == tokenizer.bos_token_id for ctx in contexts)
    assert {len(c) for per in conts for c in per} == {1, 2}
    long = [i for i, (ctx, per) in enumerate(zip(contexts, conts)) if len(ctx) + max(map(len, per)) > MAX_POSITIONS + 1]
    assert len(long) >= 5 and len(long) < len(items)

    theirs = harness_loglikelihoods(lm_eval_site, model_dir, prompts, {k: v[0] for k, v in RUNS.items()})
    assert theirs["default"][0] == resolve_max_length(model.config, tokenizer) == MAX_POSITIONS
    for name, (_, options) in RUNS.items():
        ours = letter_logprobs(model, tokenizer, items, batch_size=5, **options).double()
        diff = (ours - theirs[name][1]).abs().max().item()
        assert diff <= 1e-4, f"{name}: max abs diff {diff:.2e}"
        assert ours.argmax(-1).tolist() == theirs[name][1].argmax(-1).tolist(), name
    # ... and they tell the cases apart: BOS and truncation change the scores.
    assert (theirs["no_bos"][1] - theirs["default"][1]).abs().max() > 1e-2
    untruncated = letter_logprobs(model, tokenizer, items, max_length=10 ** 6).double()
    assert (untruncated[long] - theirs["default"][1][long]).abs().max() > 1e-2
