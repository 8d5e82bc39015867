"""The time of each attribution variant's extra signal against the paper's φ, on the same batches, in one run.

φ costs stage one's two forward passes (original and masked) over a batch; every variant adds its signal on top
(pipeline/attribution/variants.py). Per batch and repeat, in interleaved order, this times:
  phi           score_batch: both passes, log p and entropy at the scored positions (the paper's)
  copy          the copied-token flags (text only)
  span          the tagger on the answers (no tag cache) and the span ids
  per_noun      one forward pass per noun of the prompt
  grad_x_input  one forward and backward pass
  learned       per batch: the hidden states kept and the scorer applied; once: fitting it (both passes over its
                training rows and L-BFGS), reported against φ over the whole scored split
The variants' scores themselves (nocopy, span pooling, signed Δ) are NumPy on a few tokens: not timed.

    python benchmarks/bench_attribution_variants.py       # the held-out world's target (make heldout), ~1 min
    python benchmarks/bench_attribution_variants.py --model artifacts/models/target --world artifacts/world
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pipeline.attribution.run import (AttributionConfig, ExtraSignals, fit_learned_scorer,  # noqa: E402
                                      mask_token_id)
from pipeline.attribution.signals import build_qa_inputs, score_batch  # noqa: E402
from pipeline.attribution.tagging import make_tagger, with_upos  # noqa: E402
from pipeline.attribution.variants import CONTENT_UPOS, LearnedScorer  # noqa: E402
from pipeline.common.modeling import load_model, load_tokenizer  # noqa: E402
from pipeline.data.config import DataConfig  # noqa: E402
from pipeline.data.templates import get_template  # noqa: E402
from pipeline.data.tofu import load_split  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="experiments/artifacts/heldout/models/target")
    ap.add_argument("--world", default="experiments/artifacts/heldout/world")
    ap.add_argument("--split", default="forget10")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model).eval()
    _, mask_id = mask_token_id(tokenizer, "")
    tagger = make_tagger("spacy")
    data = DataConfig(source=args.world)
    rows = load_split(args.world, args.split)
    inputs = build_qa_inputs(rows, tokenizer, get_template(data.template), tagger, mask_id)
    batches = [inputs[i : i + args.batch_size] for i in range(0, len(inputs), args.batch_size)]
    pad = tokenizer.pad_token_id
    cfg = AttributionConfig(model=args.model, split=args.split, batch_size=args.batch_size, tagger="spacy",
                            signals=["copy", "span", "per_noun", "grad_x_input", "learned"])

    start = time.perf_counter()
    scorer, info = fit_learned_scorer(cfg, data, rows, model, tokenizer, tagger, mask_id)
    fit_seconds = time.perf_counter() - start
    content = with_upos(tagger, CONTENT_UPOS)  # the raw tagger: no cache, every call tags

    def only(name):
        return ExtraSignals(AttributionConfig(**{**cfg.__dict__, "signals": [name]}), model, pad, content, scorer)

    extras = {name: only(name) for name in ("copy", "span", "per_noun", "grad_x_input")}
    totals = {name: 0.0 for name in ("phi", *extras, "learned")}
    for _ in range(args.repeats):
        for batch in batches:  # interleaved: every variant on this batch before the next batch
            t = time.perf_counter()
            signals = score_batch(model, batch, pad, return_hidden=False)
            totals["phi"] += time.perf_counter() - t
            for name, extra in extras.items():
                t = time.perf_counter()
                extra(batch, signals)
                totals[name] += time.perf_counter() - t
            t = time.perf_counter()
            with_hidden = score_batch(model, batch, pad, return_hidden=True)
            for x, sig in zip(batch, with_hidden):
                scorer.predict(LearnedScorer.features_of(sig, x.scored))
            totals["learned"] += time.perf_counter() - t
    # learned: its pass replaces φ's (the hidden states come from the same forward), so its extra is the difference
    totals["learned"] -= totals["phi"]
    phi = totals["phi"]
    n_nouns = np.mean([len(x.noun_tokens) for x in inputs])
    report = {
        "model": args.model, "params": sum(p.numel() for p in model.parameters()), "samples": len(inputs),
        "batch_size": args.batch_size, "repeats": args.repeats, "nouns_per_question": round(float(n_nouns), 2),
        "phi_seconds_per_sample": phi / args.repeats / len(inputs),
        "extra_time_over_phi": {name: round(v / phi, 3) for name, v in totals.items() if name != "phi"},
        "learned_fit_over_phi_on_the_split": round(fit_seconds / (phi / args.repeats), 2),
        "learned_training": info,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    from pipeline.common.cli_errors import run_script  # as the CLI: one line per error, an exit status
    run_script(main)
