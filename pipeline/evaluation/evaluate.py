"""Stage three: evaluate one model, or every seed of a run, with the evaluators the params name (`EVALUATORS`: the
benchmarks of `benchmarks/`, the attacks of `attacks/`), keeping per-item results.

Output directory of one evaluation:
    metrics.json          the summary (the paper's columns and every set's aggregates), a DVC metrics file
    items/<set>.parquet   per TOFU item (`tofu_sets.ITEM_COLUMNS`): question, answer, probability, truth ratio,
                          ROUGE, ES, EM, the NLLs and probabilities of every answer variant, the decoded
                          prompt, ground truth and greedy answer
    TOFU_EVAL.json, TOFU_SUMMARY.json   the same evaluation in open-unlearning's layout
    mc/<set>.parquet      per multiple-choice item: its index in the source, subject and question, answer,
                          prediction, the four choices' scores (the spec's `scoring`, in the table's metadata:
                          letter log-probs, or cloze log-probs per character); the summary has each set's
                          accuracy as `mc_<set>` and per subject under `multiple_choice.<set>.by_subject`
    lm_eval/              with `evaluate.lm_eval`: lm-eval's results.json and samples_<task>.jsonl; the summary
                          has `lmeval_<task>_<metric>` keys (lm_eval_tasks.py)
    sampling/forget.parquet   with `evaluate.sampling`: each forget question's sampled answers and which leak;
                          the summary has `leak_at_<k>` (attacks/sampling.py)

With `evaluate.perturbed: false`, a user's own question-answer splits instead of TOFU's perturbed ones: the forget
set is `forget_split` and the retain set `retain_split`, each scored without truth ratio or answer variants; the
summary says `perturbed: false`, has `forget_rouge` and `retain_rouge`, and names under `skipped` each metric or
evaluator that needs what such data lacks, with the reason (`EvalConfig.skipped`).

With `evaluate.muse`, MUSE's benchmark alone (benchmarks/muse.py): metrics.json is MUSE's summary, and items/ holds
verbmem, knowmem_forget, knowmem_retain, privleak_forget and privleak_holdout.

An unlearning run's directory holds one model per training seed (`seed{S}/model`): each is evaluated into
`seed{S}/`, and the summary holds every seed's and the mean and standard deviation (ddof 1) of each number.

Forget quality compares this model's per-item forget truth ratios with the retain model's, read from the retain
model's evaluation directory (`items/forget.parquet`), so the retain model is evaluated once and reused; or from an
open-unlearning evaluation of the retain model (its TOFU_EVAL.json). Every evaluation directory also holds the
evaluation in open-unlearning's layout, TOFU_EVAL.json and TOFU_SUMMARY.json (`open_unlearning.py`).
"""

from __future__ import annotations

import logging
import statistics
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch

from pipeline.common.atomic import atomic_dir
from pipeline.common.errors import DataError
from pipeline.common.modeling import check_vocab, load_model, load_tokenizer
from pipeline.common.paths import is_hub_name
from pipeline.common.runs import complete_seeds, is_run_dir
from pipeline.common.timing import write_seconds
from pipeline.data.templates import get_template
from pipeline.evaluation import eval_io, open_unlearning, registry
from pipeline.evaluation.attacks.mia import MembershipInference
from pipeline.evaluation.attacks.paraphrase import Paraphrase
from pipeline.evaluation.attacks.quantization import Quantization
from pipeline.evaluation.attacks.sampling import Sampling
from pipeline.evaluation.benchmarks.lm_eval import LMEval
from pipeline.evaluation.benchmarks.multiple_choice import MultipleChoice
from pipeline.evaluation.benchmarks.muse import Muse
from pipeline.evaluation.benchmarks.tofu import TofuSets
from pipeline.evaluation.config import EvalConfig
from pipeline.evaluation.evaluator import Context, Evaluator, merge
from pipeline.evaluation.inputs import EvalInputs, load_inputs

log = logging.getLogger(__name__)

# The evaluators, in the order they run and their keys appear in the summary; each runs where the params ask for it.
EVALUATORS: tuple[type[Evaluator], ...] = (TofuSets, Paraphrase, MembershipInference, MultipleChoice, LMEval,
                                           Quantization, Sampling, Muse)


# ---- one model ----------------------------------------------------------------------------------------------

def _own_retain(out_dir: Path, retain_dir: Path | None) -> bool:
    return retain_dir is not None and Path(retain_dir).resolve() == Path(out_dir).resolve()


def evaluate_model(model_path: str, cfg: EvalConfig, out_dir: Path, retain_dir: Path | None,
                   inputs: EvalInputs | None = None, timed_as: Path | None = None) -> dict:
    """Evaluate one model and write `out_dir` (atomically). `retain_dir`: the retain model's evaluation, for
    forget quality and privleak (None: neither; `out_dir` itself: this is the retain model). `inputs`: already
    loaded by `load_inputs` (several models on the same inputs), else loaded here, before the model. Its seconds
    go beside `timed_as` (`out_dir`; common/timing.py), never into an output."""
    start = time.perf_counter()
    log.info("evaluating %s", model_path)
    own_retain = _own_retain(out_dir, retain_dir)
    inputs = inputs or load_inputs(cfg, retain_dir, own_retain)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not Path(model_path).exists() and not is_hub_name(model_path):
        raise DataError(f"model '{model_path}': no such directory; produce it first (e.g. `dvc repro` for the "
                        "pipeline's models, or `tokenunlearn unlearn NAME`)")
    ctx = Context(cfg, inputs, model_path, load_tokenizer(cfg.tokenizer or model_path, cfg.trust_remote_code),
                  get_template(cfg.template), own_retain, retain_dir is not None, device,
                  torch.bfloat16 if device.type == "cuda" else torch.float32)
    evaluators = [e for e in (kind() for kind in EVALUATORS) if e.enabled(cfg)]
    for evaluator in evaluators:
        evaluator.prepare(ctx)  # before the model loads: a bad input fails in seconds
    model = load_model(model_path, dtype=ctx.dtype, trust_remote_code=cfg.trust_remote_code).to(device).eval()
    check_vocab(model, ctx.tokenizer, model_path)
    summary: dict = {"model": str(model_path)}
    if not cfg.muse:  # MUSE's evaluation names its own source and definitions
        summary.update({"source": cfg.source, "forget_split": cfg.forget_split,
                        **({} if cfg.perturbed else {"retain_split": cfg.retain_split, "perturbed": False}),
                        # the settings that change the TOFU metrics' values
                        "definitions": {"es_definition": cfg.es_definition, "loss_dtype": cfg.loss_dtype,
                                        "max_new_tokens": cfg.max_new_tokens}})
    files = {}
    for evaluator in evaluators:
        part = evaluator.run(model, ctx)
        merge(summary, part.summary)
        files.update(part.files)
    if cfg.skipped:
        summary[registry.SKIPPED] = cfg.skipped
    registry.check_registered(summary, model_path, registry.MUSE if cfg.muse else None)
    ou_logs = open_unlearning.eval_logs(ctx.items, ctx.found.get("forget_quality"), ctx.found.get("mia"),
                                        cfg.perturbed) if ctx.items else None

    with atomic_dir(out_dir) as tmp:
        (tmp / "items").mkdir()
        for name, rows in ctx.items.items():
            pq.write_table(eval_io.item_table(rows, ctx.item_meta[name]), tmp / "items" / f"{name}.parquet",
                           compression="zstd")
        for relative, write in files.items():
            (tmp / relative).parent.mkdir(parents=True, exist_ok=True)
            write(tmp / relative)
        eval_io.write_strict_json(tmp / "metrics.json", summary)
        if ou_logs is not None:
            open_unlearning.write_files(tmp, ou_logs)  # the same evaluation in open-unlearning's layout
    seconds = time.perf_counter() - start
    log.info("evaluated %s in %.0f s", model_path, seconds)
    write_seconds(timed_as or out_dir, seconds)
    return summary


# ---- several seeds of one run --------------------------------------------------------------------------------

def aggregate_seeds(per_seed: dict[int, dict]) -> dict:
    """Each top-level number as the mean over seeds, with `<name>_std` (sample standard deviation; 0 for one seed)."""
    summaries = list(per_seed.values())
    out: dict = {"seeds": list(per_seed)}
    for key, value in summaries[0].items():
        values = [s.get(key) for s in summaries]
        if isinstance(value, (int, float)) and not isinstance(value, bool) and all(
                isinstance(v, (int, float)) for v in values):
            out[key] = round(statistics.fmean(values), 6)
            out[f"{key}_std"] = round(statistics.stdev(values), 6) if len(values) > 1 else 0.0
        elif all(v == value for v in values):
            out[key] = value  # the same for every seed: source, forget split
    out["per_seed"] = {str(seed): s for seed, s in per_seed.items()}
    return out


def evaluate_path(model_path: str, cfg: EvalConfig, out_dir: Path, retain_dir: Path | None,
                  metrics_file: Path | None = None, name: str = "NAME") -> dict:
    """Evaluate a model, or every seed of a complete unlearning run (into `out_dir/seed{S}`), and write the summary
    also to `metrics_file` (DVC metrics cannot live inside an output directory). An incomplete run is refused,
    and every input is checked before the first model loads."""
    seeds = complete_seeds(Path(model_path), name) if is_run_dir(Path(model_path)) else {}
    inputs = load_inputs(cfg, retain_dir, own_retain=not seeds and _own_retain(out_dir, retain_dir))
    if seeds:
        with atomic_dir(out_dir) as tmp:  # all seeds or none
            per_seed = {seed: evaluate_model(str(model), cfg, tmp / f"seed{seed}", retain_dir, inputs,
                                             timed_as=Path(f"{out_dir}.seed{seed}"))
                        for seed, model in seeds.items()}
            summary = {"model": str(model_path), **aggregate_seeds(per_seed)}
            eval_io.write_strict_json(tmp / "metrics.json", summary)
    else:
        summary = evaluate_model(model_path, cfg, out_dir, retain_dir, inputs)
    if metrics_file is not None:
        eval_io.write_strict_json(metrics_file, summary)  # creates its directory
    return summary


def headline_metrics(summary: dict) -> dict:
    """The numbers `dvc metrics show` lists per model, one short row each (the full summary has hundreds of keys):
    the registry's headline metrics and each multiple-choice set's forget accuracy, where evaluated (means over the
    seeds of a run)."""
    keys = [*registry.HEADLINE_KEYS, *sorted(k for k in summary if k.startswith("mc_") and k.endswith("_forget"))]
    return {k: summary[k] for k in keys if isinstance(summary.get(k), (int, float))}
