"""Stages `world-muse` (the embedded world in MUSE's layout) and `evaluate-muse` (MUSE's VerbMem, KnowMem, utility
and PrivLeak of one model: `evaluate` with MUSE's evaluator alone, its settings as options rather than params)."""

import logging
from pathlib import Path

import click

from pipeline.common.atomic import hold_outputs
from pipeline.data.muse import write_world_as_muse
from pipeline.evaluation.config import EvalConfig
from pipeline.evaluation.eval_io import write_strict_json
from pipeline.evaluation.evaluate import evaluate_path
from pipeline.evaluation.muse import KNOWMEM_MAX_NEW_TOKENS, MIN_K, PRIVLEAK_ATTACKS, VERBMEM_MAX_NEW_TOKENS

from .options import NAME

log = logging.getLogger(__name__)


@click.command("world-muse")
@click.option("--world", "world_dir", default="artifacts/world", show_default=True,
              type=click.Path(exists=True, file_okay=False), help="A world written by `make-world`.")
@click.option("--forget-split", default="forget10", show_default=True,
              help="Whose biographies are the forget corpus (a forget split of the world).")
@click.option("--icl", "n_icl", default=1, show_default=True, type=int,
              help="In-context examples of each knowmem split (MUSE has 10; the embedded model's context is short).")
@click.option("--out", default="artifacts/world_muse", show_default=True, type=click.Path(file_okay=False),
              help="Output directory, in the layout of the hub's muse-bench/MUSE-News.")
def world_command(world_dir: str, forget_split: str, n_icl: int, out: str) -> None:
    """Write the world's biographies and fact questions as MUSE's raw, knowmem, verbmem and privleak configs."""
    with hold_outputs(out):
        summary = write_world_as_muse(Path(world_dir), Path(out), forget_split, n_icl)
    log.info("wrote %s: %s", out, ", ".join(f"{k}={v}" for k, v in summary["counts"].items()))


@click.command("evaluate-muse")
@click.argument("name", type=NAME)
@click.option("--model", "model_path", required=True, help="A model directory (safetensors) or hub name.")
@click.option("--tokenizer", "tokenizer_path",
              help="The tokenizer, where the model has none [the model's] (MUSE's models: meta-llama/Llama-2-7b-hf).")
@click.option("--source", default="muse-bench/MUSE-News", show_default=True,
              help="MUSE: a hub dataset (muse-bench/MUSE-News, muse-bench/MUSE-Books) or a local copy in its "
                   "layout (huggingface-cli download ... --repo-type dataset; `world-muse` writes one).")
@click.option("--out", type=click.Path(file_okay=False), help="Output directory [artifacts/eval_muse/NAME].")
@click.option("--metrics", type=click.Path(dir_okay=False), help="Also write the summary here.")
@click.option("--retain-results", type=click.Path(),
              help="The retain model's evaluate-muse output (its --out, or its metrics.json), for PrivLeak; the "
                   "same as --out when NAME is the retain model.")
@click.option("--retain-auc", type=float,
              help="Or the retain model's published AUC (MUSE's retrained models, Min-40%: News 0.4772, Books "
                   "0.5393). Neither: no PrivLeak.")
@click.option("--verbmem-max-new-tokens", default=VERBMEM_MAX_NEW_TOKENS, show_default=True, type=int,
              help="Greedy tokens after each verbmem prompt; the reference is gt cut to as many (MUSE: 128).")
@click.option("--knowmem-max-new-tokens", default=KNOWMEM_MAX_NEW_TOKENS, show_default=True, type=int,
              help="Greedy tokens of each knowmem answer (MUSE: 32).")
@click.option("--k", default=MIN_K, show_default=True, type=float, help="Min-K%'s fraction of tokens.")
@click.option("--attack", default="min_k", show_default=True, type=click.Choice(PRIVLEAK_ATTACKS),
              help="The membership attack PrivLeak reads (MUSE: Min-K% Prob).")
@click.option("--stem/--no-stem", default=False, show_default=True,
              help="Stem words in ROUGE (open-unlearning does; MUSE does not).")
@click.option("--batch-size", default=8, show_default=True, type=int,
              help="Prompts per generation batch (left-padded) and texts per scoring batch.")
def command(name, model_path, tokenizer_path, source, out, metrics, retain_results, retain_auc, verbmem_max_new_tokens,
            knowmem_max_new_tokens, k, attack, stem, batch_size) -> None:
    """Evaluate model NAME (or each seed of run NAME) on MUSE; writes OUT/metrics.json and per-item
    OUT/items/*.parquet. The same as `tokenunlearn evaluate NAME` with `evaluate.muse` set and the TOFU sets off."""
    muse = {"source": source, "verbmem_max_new_tokens": verbmem_max_new_tokens,
            "knowmem_max_new_tokens": knowmem_max_new_tokens, "k": k, "attack": attack, "stem": stem,
            "batch_size": batch_size, "retain_auc": retain_auc}
    cfg = EvalConfig.from_params({"tofu_sets": [], "multiple_choice": {}, "muse": muse, "tokenizer": tokenizer_path},
                                 "evaluate-muse")
    out_dir = Path(out or f"artifacts/eval_muse/{name}")
    with hold_outputs(out_dir):
        summary = evaluate_path(model_path, cfg, out_dir, Path(retain_results) if retain_results else None,
                                name=name)
        if metrics:
            write_strict_json(Path(metrics), summary)
    log.info("evaluate-muse %s: wrote %s", name, out_dir)


commands = (world_command, command)
