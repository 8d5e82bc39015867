"""Stage three: evaluate one model on the TOFU sets and on multiple-choice sets, keeping per-item results.

Output directory of one evaluation:
    metrics.json          the summary (the paper's columns and every set's aggregates), a DVC metrics file
    items/<set>.parquet   per TOFU item (`tofu_metrics.ITEM_COLUMNS`): question, answer, probability, truth ratio,
                          ROUGE, ES, EM, the NLLs and probabilities of every answer variant, the decoded
                          prompt, ground truth and greedy answer
    TOFU_EVAL.json, TOFU_SUMMARY.json   the same evaluation in open-unlearning's layout
    mc/<set>.parquet      per multiple-choice item: its index in the source, subject and question, answer,
                          prediction, the four choices' scores (the spec's `scoring`, in the table's metadata:
                          letter log-probs, or cloze log-probs per character); the summary has each set's
                          accuracy as `mc_<set>` and per subject under `multiple_choice.<set>.by_subject`
    lm_eval/              with `evaluate.lm_eval`: lm-eval's results.json and samples_<task>.jsonl; the summary
                          has `lmeval_<task>_<metric>` keys (lm_eval_tasks.py)

An unlearning run's directory holds one model per training seed (`seed{S}/model`): each is evaluated into
`seed{S}/`, and the summary holds every seed's and the mean and standard deviation (ddof 1) of each number.

Forget quality compares this model's per-item forget truth ratios with the retain model's, read from the retain
model's evaluation directory (`items/forget.parquet`), so the retain model is evaluated once and reused; or from an
open-unlearning evaluation of the retain model (its TOFU_EVAL.json). Every evaluation directory also holds the
evaluation in open-unlearning's layout, TOFU_EVAL.json and TOFU_SUMMARY.json (`open_unlearning.py`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from pipeline.common.atomic import atomic_dir
from pipeline.common.timing import write_seconds
from pipeline.common.errors import DataError, ParamError
from pipeline.common.modeling import check_vocab, load_model, load_tokenizer
from pipeline.common.paths import is_hub_name
from pipeline.common.runs import complete_seeds, is_run_dir
from pipeline.data.mc_items import MCItem
from pipeline.data.templates import get_template
from pipeline.data.tofu import load_split
from pipeline.evaluation import eval_io, lm_eval_tasks, open_unlearning, registry
from pipeline.evaluation.config import TOFU_SETS, EvalConfig
from pipeline.evaluation.mc_scoring import evaluate_mc
from pipeline.evaluation.mc_sets import load_mc_sets
from pipeline.evaluation.mia import (PRIVLEAK_ATTACK, TOKENS_HASH, MIAResult, Reference, check_retain_settings,
                                     membership_inference, privleak, reference_losses, resolve_reference, tokens_hash)
from pipeline.evaluation.probes import PROBED_SETS, paraphrase_items, probe
from pipeline.evaluation.quantize import load_quantized_bnb, resolve_method, rtn_quantized
from pipeline.evaluation.tofu_metrics import SetResult, evaluate_set, forget_quality, model_utility, rouge_references

log = logging.getLogger(__name__)

# ---- one model ----------------------------------------------------------------------------------------------

def _questions_hash(rows: list[dict]) -> str:
    return hashlib.sha256(json.dumps([r["question"] for r in rows]).encode()).hexdigest()[:16]


def _retain_items(retain_dir: Path) -> Path:
    file = retain_dir / "items" / "forget.parquet"
    if not file.is_file():
        raise DataError(
            f"forget quality needs the retain model's evaluation, and {file} does not exist: evaluate the retain "
            f"model first (`tokenunlearn evaluate retain --model artifacts/models/retain --out {retain_dir}`, "
            f"DVC stage evaluate_retain), or name open-unlearning's {open_unlearning.EVAL_FILE} of it")
    return file


def _questions_hash_of(table: pa.Table, file: Path) -> str:
    """The questions hash an items table was written with (its `tokenunlearn` schema metadata)."""
    try:
        theirs = json.loads((table.schema.metadata or {})[b"tokenunlearn"])["questions_hash"]
    except (KeyError, TypeError, ValueError):
        theirs = None
    if not isinstance(theirs, str):
        raise DataError(f"{file}: no questions hash in its metadata: not items written by `tokenunlearn evaluate`; "
                        "evaluate the retain model again")
    return theirs


def retain_truth_ratios(retain_dir: Path, forget_hash: str, n_forget: int | None = None) -> list[float]:
    """The retain model's per-item forget truth ratios, from its evaluation; refused if it scored other items, or
    if a truth ratio is not a finite non-negative number (a NaN would make forget quality NaN)."""
    file = _retain_items(retain_dir)
    table = eval_io.read_parquet(file)
    theirs = _questions_hash_of(table, file)
    if theirs != forget_hash:
        raise DataError(f"{file}: the retain model was evaluated on other forget questions (hash {theirs}, "
                        f"here {forget_hash}); evaluate both on the same source and forget split")
    if "truth_ratio" not in table.column_names:
        raise DataError(f"{file}: no truth_ratio column; evaluate the retain model again")
    rows = table.select(["truth_ratio"]).to_pylist()
    eval_io.check_items(rows, file, n_forget)
    return [r["truth_ratio"] for r in rows]


def load_retain_reference(retain: Path, forget_hash: str,
                          n_forget: int) -> tuple[list[float], open_unlearning.RetainLogs | None]:
    """The retain model's forget truth ratios: from its evaluation directory here (`items/forget.parquet`, checked
    by the hash of its questions), or from open-unlearning's TOFU_EVAL.json (the file, or a directory holding one),
    which has no hash: its count is checked here, and its forget ROUGE prompts, where it has them, by
    `open_unlearning.check_prompts` once the tokenizer is loaded (the RetainLogs returned)."""
    retain = Path(retain)
    file = None if (retain / "items" / "forget.parquet").is_file() else open_unlearning.eval_file(retain)
    if file is None:
        return retain_truth_ratios(retain, forget_hash, n_forget), None
    logs = open_unlearning.read_retain_logs(file)
    if len(logs.truth_ratios) != n_forget:
        raise DataError(f"{file}: {len(logs.truth_ratios)} forget truth ratios, but the forget set has {n_forget} "
                        "items: the retain model was evaluated on another forget split")
    checked = "and its forget prompts (forget_Q_A_ROUGE's inputs) once the tokenizer loads" if logs.prompts \
        else "only: it has no forget_Q_A_ROUGE inputs to compare prompts with"
    log.info("forget quality: the retain model's %d forget truth ratios from %s (open-unlearning's layout has no "
             "question hash: checked the count %s)", n_forget, file, checked)
    return logs.truth_ratios, logs


def _item_records(rows: list[dict], result: SetResult) -> list[dict]:
    return [{"question": r["question"], "answer": r["answer"], **item} for r, item in zip(rows, result.items)]


def _item_table(records: list[dict], meta: dict) -> pa.Table:
    return pa.Table.from_pylist(records).replace_schema_metadata({b"tokenunlearn": json.dumps(meta).encode()})


@dataclass
class EvalInputs:
    """Everything an evaluation reads besides the model, loaded and validated before any model is: a bad split,
    multiple-choice file or retain evaluation fails in seconds, not after the first forward passes."""

    tofu: dict[str, tuple[str, list[dict]]]        # set name -> (split, rows)
    questions_hash: dict[str, str]                  # set name -> hash of its questions
    mc: dict[str, tuple[dict, list[MCItem]]]        # MC set name -> (its spec, items)
    retain_truth_ratios: list[float] | None = None  # the retain model's forget truth ratios, for forget quality
    retain_logs: open_unlearning.RetainLogs | None = None  # where they come from open-unlearning's TOFU_EVAL.json
    holdout: tuple[str, list[dict]] | None = None   # membership inference's holdout split and rows
    retain_auc: dict[str, float] | None = None      # the retain model's AUC per attack, for privleak
    reference: Reference | None = None              # the reference attack's reference model and its losses


def load_inputs(cfg: EvalConfig, retain_dir: Path | None, own_retain: bool = False) -> EvalInputs:
    """The TOFU sets' rows, the multiple-choice items and the retain model's forget truth ratios (unless this is
    the retain model's own evaluation, or `retain_dir` is None)."""
    tofu, hashes = {}, {}
    for name in cfg.tofu_sets:
        split = TOFU_SETS[name].format(forget=cfg.forget_split)
        rows = load_split(cfg.source, split)
        tofu[name], hashes[name] = (split, rows), _questions_hash(rows)
    mc = load_mc_sets(cfg.multiple_choice, cfg.forget_split, cfg.seed)
    unknown = [s for s in cfg.probe_sets if s not in (*PROBED_SETS, *mc)]
    if unknown:
        raise ParamError(f"evaluate.probe_sets: {unknown} are neither forget, retain nor a multiple-choice set of "
                         f"evaluate.multiple_choice (have {sorted(mc)})")
    if cfg.lm_eval_spec is not None:
        lm_eval_tasks.task_manager(cfg.lm_eval_spec)  # lm-eval installed, its tasks found: before any model loads
    reference, retain_logs = None, None
    if retain_dir is not None and not own_retain and "forget" in tofu:
        reference, retain_logs = load_retain_reference(Path(retain_dir), hashes["forget"], len(tofu["forget"][1]))
    holdout, retain_auc = None, None
    if cfg.mia_spec is not None:
        holdout = (cfg.mia_spec.holdout_split, load_split(cfg.source, cfg.mia_spec.holdout_split))
        if retain_dir is not None and not own_retain:
            retain_auc = load_retain_auc(Path(retain_dir), cfg.mia_spec.attacks)
    inputs = EvalInputs(tofu, hashes, mc, reference, retain_logs, holdout, retain_auc)
    if cfg.mia_spec is not None and cfg.mia_spec.reference:
        inputs.reference = resolve_reference(cfg.mia_spec.reference, retain_dir, own_retain, {
            "forget": hashes["forget"], "holdout": _questions_hash(holdout[1])})
    if retain_auc is not None:
        check_retain_settings(Path(retain_dir), cfg.mia_spec.settings(
            inputs.reference.model if inputs.reference is not None else None))
    return inputs


def load_retain_auc(retain: Path, attacks: list[str]) -> dict[str, float]:
    """The retain model's AUC of each attack it has, for privleak: from its evaluation here (metrics.json's `mia`),
    or from open-unlearning's TOFU_EVAL.json of it (`mia_<attack>.agg_value`; open-unlearning's default config keeps
    only mia_min_k, privleak's). An attack it lacks gets no privleak (a warning names it), never another reference;
    none at all is an error (a retain evaluation made without membership inference)."""
    file = retain / "metrics.json" if (retain / "metrics.json").is_file() else open_unlearning.eval_file(retain)
    if file is None:
        raise DataError(f"privleak needs the retain model's membership-inference AUCs, and {retain} holds neither "
                        "metrics.json nor TOFU_EVAL.json: evaluate the retain model first (DVC stage evaluate_retain)")
    what = "evaluation summary" if file.name == "metrics.json" else f"open-unlearning {open_unlearning.EVAL_FILE}"
    data = eval_io.read_json(file, what)
    if file.name == "metrics.json":
        mia = data.get("mia") or {}
        if not isinstance(mia, dict):
            raise DataError(f"{file}: mia: {mia!r} is not an object of attacks")
        found = {a: (f"mia.{a}.auc", v["auc"]) for a, v in mia.items() if isinstance(v, dict) and "auc" in v}
    else:
        found = {a: (f"mia_{a}.agg_value", data[f"mia_{a}"].get("agg_value")) for a in attacks
                 if isinstance(data.get(f"mia_{a}"), dict)}
    missing = [a for a in attacks if a not in found]
    if not found:  # nothing to compare with at all: a retain evaluation made without evaluate.mia
        raise DataError(f"{file}: no membership-inference AUC of {missing} for the retain model: evaluate it again "
                        "with evaluate.mia (privleak compares each attack with the retain model's)")
    if missing:
        log.warning("privleak: %s has no membership-inference AUC of %s for the retain model, so those attacks get "
                    "no privleak%s (evaluate the retain model with the same evaluate.mia for all of them)", file,
                    missing, f", nor the summary's privleak ({PRIVLEAK_ATTACK}'s)" if PRIVLEAK_ATTACK in missing else "")
    # an AUC is a probability; anything else would give a plausible but meaningless privleak
    return {a: eval_io.number(found[a][1], f"{file}: {found[a][0]}", 0.0, 1.0) for a in attacks if a in found}


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
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if not Path(model_path).exists() and not is_hub_name(model_path):
        raise DataError(f"model '{model_path}': no such directory; produce it first (e.g. `dvc repro` for the "
                        "pipeline's models, or `tokenunlearn unlearn NAME`)")
    tokenizer = load_tokenizer(model_path, cfg.trust_remote_code)
    template = get_template(cfg.template)
    if inputs.retain_logs is not None and inputs.retain_logs.prompts and "forget" in inputs.tofu:
        forget_rows = inputs.tofu["forget"][1]  # before the model loads: a mismatch fails in seconds
        open_unlearning.check_prompts(inputs.retain_logs, rouge_references(
            tokenizer, template, [r["question"] for r in forget_rows], [r["answer"] for r in forget_rows])[0])
        log.info("forget quality: the %d prompts of %s are this evaluation's", len(forget_rows),
                 inputs.retain_logs.file)
    mia_rows, mia_hashes, ref_losses = {}, {}, None
    if cfg.mia_spec is not None:  # the tokens the attacks score; the reference's losses, before the model loads
        mia_rows = {"forget": inputs.tofu["forget"][1], "holdout": inputs.holdout[1]}
        mia_hashes = {part: tokens_hash(tokenizer, template, rows) for part, rows in mia_rows.items()}
        if inputs.reference is not None:
            ref_losses = reference_losses(inputs.reference, mia_hashes, tokenizer, template, mia_rows,
                                          cfg.batch_size, dtype, device, cfg.trust_remote_code)
    model = load_model(model_path, dtype=dtype, trust_remote_code=cfg.trust_remote_code).to(device).eval()
    check_vocab(model, tokenizer, model_path)
    summary: dict = {"model": str(model_path), "source": cfg.source, "forget_split": cfg.forget_split,
                     # the settings that change the TOFU metrics' values
                     "definitions": {"es_definition": cfg.es_definition, "loss_dtype": cfg.loss_dtype,
                                     "max_new_tokens": cfg.max_new_tokens}}
    records: dict[str, list[dict]] = {}
    results: dict[str, SetResult] = {}

    for name, (split, rows) in inputs.tofu.items():
        result = evaluate_set(model, tokenizer, template, rows, name, cfg.batch_size, cfg.max_new_tokens,
                              name=f"{cfg.source}/{split}", es_definition=cfg.es_definition,
                              loss_dtype=cfg.loss_dtype)
        results[name], records[name] = result, _item_records(rows, result)
        summary[name] = {"n": len(rows), **{k: _rounded(k, v) for k, v in result.aggregates.items()}}
        log.info("%s: %s", split, _set_line(summary[name]))
        log.debug("%s: %s", split, summary[name])

    fq = None
    if "forget" in results:
        summary["forget_es"] = summary["forget"]["extraction_strength"]
        summary["forget_em"] = summary["forget"]["exact_memorization"]
        if retain_dir is not None:
            reference = results["forget"].truth_ratios if own_retain else inputs.retain_truth_ratios
            fq = forget_quality(results["forget"].truth_ratios, reference)
            summary["forget_quality"], summary["log10_forget_quality"] = fq.pvalue, round(fq.log10_pvalue, 4)
    if "retain" in results:
        summary["retain_es"] = summary["retain"]["extraction_strength"]
        summary["retain_em"] = summary["retain"]["exact_memorization"]
    if all(s in results for s in ("retain", "real_authors", "world_facts")):
        summary["model_utility"] = round(model_utility({k: v.aggregates for k, v in results.items()}), 6)

    if cfg.paraphrase:
        _paraphrase(model, tokenizer, template, inputs, cfg, records, summary)
    mia = None
    if cfg.mia_spec is not None:
        mia = membership_inference(model, tokenizer, template, mia_rows["forget"], mia_rows["holdout"],
                                   cfg.mia_spec.attacks, cfg.mia_spec.k, cfg.batch_size, cfg.mia_spec.p,
                                   ref_losses)
        _summarise_mia(mia, inputs.retain_auc, own_retain, summary)
        # the reference model recorded for the retain model's check; "self" has none: it is this model
        reference_model = None if inputs.reference is None else inputs.reference.model or model_path
        for attack, settings in cfg.mia_spec.settings(reference_model).items():
            summary["mia"][attack].update(settings)
        if "reference" in summary["mia"]:
            summary["mia"]["reference"]["reference"] = cfg.mia_spec.reference
        for attack, scores in mia.forget.items():
            for record, score in zip(records["forget"], scores):
                record[f"mia_{attack}"] = float(score)
    ou_logs = open_unlearning.eval_logs(records, fq.pvalue if fq else None, _mia_logs(mia, summary)) \
        if records else None
    mc_tables = _multiple_choice(model, tokenizer, template, inputs, cfg, summary)
    lm_eval_run = None
    if cfg.lm_eval_spec is not None:  # lm-eval's own tasks: `lmeval_*` keys, every task's numbers under lm_eval
        lm_eval_run = lm_eval_tasks.run_tasks(model, model_path, cfg.lm_eval_spec, cfg.mc_batch_size,
                                              cfg.trust_remote_code)
        summary.update(lm_eval_run.metrics)
        summary["lm_eval"] = lm_eval_run.summary
    if cfg.quantize_spec is not None:
        _quantization_attack(model, model_path, tokenizer, template, inputs, cfg, summary)

    registry.check_registered(summary, model_path)
    with atomic_dir(out_dir) as tmp:
        (tmp / "items").mkdir()
        for name, rows in records.items():
            meta = {"split": inputs.tofu[name][0], "questions_hash": inputs.questions_hash[name]}
            if name in mia_hashes:
                meta[TOKENS_HASH] = mia_hashes[name]
            pq.write_table(_item_table(rows, meta), tmp / "items" / f"{name}.parquet", compression="zstd")
        if mia is not None:
            split, rows = inputs.holdout
            holdout = [{"index": i, "question": r["question"], "answer": r["answer"],
                        **{f"mia_{a}": float(v[i]) for a, v in mia.holdout.items()}} for i, r in enumerate(rows)]
            meta = {"split": split, "questions_hash": _questions_hash(rows),
                    TOKENS_HASH: mia_hashes["holdout"]}
            pq.write_table(_item_table(holdout, meta), tmp / "items" / "holdout.parquet", compression="zstd")
        if mc_tables:
            (tmp / "mc").mkdir()
            for name, table in mc_tables.items():
                pq.write_table(table, tmp / "mc" / f"{name}.parquet", compression="zstd")
        if lm_eval_run is not None:
            lm_eval_tasks.write_outputs(tmp / "lm_eval", lm_eval_run)
        eval_io.write_strict_json(tmp / "metrics.json", summary)
        if ou_logs is not None:
            open_unlearning.write_files(tmp, ou_logs)  # the same evaluation in open-unlearning's layout
    seconds = time.perf_counter() - start
    log.info("evaluated %s in %.0f s", model_path, seconds)
    write_seconds(timed_as or out_dir, seconds)
    return summary


def _rounded(metric: str, value: float) -> float | None:
    """A set aggregate for the summary, rounded. Exact memorization's mean over no token is NaN: null, as
    open-unlearning writes it (JSON has no NaN). Any other NaN stays, and `write_strict_json` names it."""
    return None if metric == "exact_memorization" and math.isnan(value) else round(value, 6)


def _paraphrase(model, tokenizer, template, inputs: EvalInputs, cfg: EvalConfig, records: dict[str, list[dict]],
                summary: dict) -> None:
    """The forget and retain answers asked with the paraphrased questions: `para_*` item columns, the sets' means,
    and `forget_para_es`, `forget_para_rouge` (retain_ too) beside forget_es."""
    for name in PROBED_SETS:
        if name not in inputs.tofu:
            continue
        split, rows = inputs.tofu[name]
        para = paraphrase_items(model, tokenizer, template, rows, cfg, f"{cfg.source}/{split}")
        records[name] = [{**r, **p} for r, p in zip(records[name], para)]
        es = [p["para_extraction_strength"] for p in para]
        rouge = [p["para_rouge_l_recall"] for p in para]
        summary[name]["para_extraction_strength"] = round(statistics.fmean(es), 6)
        summary[name]["para_rouge_l_recall"] = round(statistics.fmean(rouge), 6)
        summary[f"{name}_para_es"] = summary[name]["para_extraction_strength"]
        summary[f"{name}_para_rouge"] = summary[name]["para_rouge_l_recall"]
    probed = [f"{name} ES {summary[f'{name}_para_es']:.3f}, ROUGE-L {summary[f'{name}_para_rouge']:.3f}"
              for name in PROBED_SETS if f"{name}_para_es" in summary]
    if probed:
        log.info("paraphrased questions: %s", "; ".join(probed))


def _summarise_mia(mia: MIAResult, retain_auc: dict[str, float] | None, own_retain: bool, summary: dict) -> None:
    """`mia.<attack>`: AUC, mean scores, privleak against the retain model's AUC and that AUC (`retain_auc`; none
    where the retain model's evaluation lacks the attack; the retain model's own: privleak 0, against itself); top
    level: `mia_<attack>_auc`, `privleak` (open-unlearning's, of min_k) and each other attack's `privleak_<attack>`."""
    reference = mia.auc if own_retain else retain_auc
    summary["mia"] = {}
    for attack, value in mia.auc.items():
        entry = {"auc": round(value, 6), "forget_mean": round(float(mia.forget[attack].mean()), 6),
                 "holdout_mean": round(float(mia.holdout[attack].mean()), 6)}
        if reference is not None and attack in reference:
            entry["privleak"] = round(privleak(value, reference[attack]), 6)
            if not own_retain:  # the AUC of the retain model it was compared with (open_unlearning.py reads it)
                entry["retain_auc"] = round(reference[attack], 6)
        summary["mia"][attack] = entry
        summary[f"mia_{attack}_auc"] = entry["auc"]
        if "privleak" in entry and attack != PRIVLEAK_ATTACK:
            summary[f"privleak_{attack}"] = entry["privleak"]
    if "privleak" in summary["mia"].get(PRIVLEAK_ATTACK, {}):
        summary["privleak"] = summary["mia"][PRIVLEAK_ATTACK]["privleak"]
    aucs = ", ".join(f"{attack} {entry['auc']:.3f}" for attack, entry in summary["mia"].items())
    leak = f"; privleak {summary['privleak']:.1f}" if "privleak" in summary else ""
    log.info("MIA AUC: %s%s", aucs, leak)
    log.debug("membership inference: %s", summary["mia"])


def _mia_logs(mia: MIAResult | None, summary: dict) -> dict | None:
    """What open-unlearning's entries are made of: the scores, the AUCs and the retain model's Min-K% AUC as the
    summary has it (none for the retain model itself: open-unlearning's privleak then takes its default)."""
    if mia is None:
        return None
    return {"forget": mia.forget, "holdout": mia.holdout, "auc": mia.auc,
            "retain_auc": summary["mia"].get(PRIVLEAK_ATTACK, {}).get("retain_auc")}


def _multiple_choice(model, tokenizer, template, inputs: EvalInputs, cfg: EvalConfig, summary: dict
                     ) -> dict[str, pa.Table]:
    tables: dict[str, pa.Table] = {}
    accuracy: dict[str, float] = {}
    for set_name, (spec, items) in inputs.mc.items():
        scoring = spec.get("scoring", "letter")
        result = evaluate_mc(model, tokenizer, items, batch_size=cfg.mc_batch_size, scoring=scoring,
                             template=template, add_bos_token=spec.get("add_bos_token"),
                             max_length=spec.get("max_length"), desc=f"multiple choice {set_name}")
        tables[set_name] = pa.Table.from_pylist(result["records"]).replace_schema_metadata(
            {b"tokenunlearn": json.dumps({"scoring": scoring}).encode()})
        summary[f"mc_{set_name}"] = round(result["accuracy"], 6)  # overall accuracy: the report's column
        # Per subject (MMLU's 57) and how it was scored; not an `mc_` key, which the report makes a column of.
        summary.setdefault("multiple_choice", {})[set_name] = {
            "n": result["n"], "accuracy": round(result["accuracy"], 6), "scoring": scoring,
            "add_bos_token": spec.get("add_bos_token"), "max_length": result["max_length"],
            "by_subject": {s: {"n": g["n"], "accuracy": round(g["accuracy"], 6)}
                           for s, g in result["by_subject"].items()}}
        accuracy[set_name] = result["accuracy"]
        log.debug("multiple choice %s: %s", set_name, summary["multiple_choice"][set_name])
    # One line per entry of evaluate.multiple_choice, its sets named without the entry's name (world_forget: forget)
    for name, spec in cfg.multiple_choice.items():
        sets = [s for s in accuracy if inputs.mc[s][0] is spec]
        if sets:
            log.info("multiple choice %s (%s): %s", name, spec.get("scoring", "letter"), ", ".join(
                f"{s.removeprefix(name + '_')} {accuracy[s]:.3f}" for s in sets))
    return tables


def _quantization_attack(model, model_path: str, tokenizer, template, inputs: EvalInputs, cfg: EvalConfig,
                         summary: dict) -> None:
    """The probes again with the weights rounded to each bit width: `quantization.<bits>` and, for the report,
    `q<bits>_<probe>` (q4_forget_es, q4_mc_world_forget, ...)."""
    spec = cfg.quantize_spec
    method = resolve_method(spec.method)
    summary["quantization"] = {"method": method, "group_size": spec.group_size}
    for bits in spec.bits:
        if method == "rtn":
            with rtn_quantized(model, bits, spec.group_size) as report:
                probed = probe(model, tokenizer, template, inputs.tofu, inputs.mc, cfg)
        else:  # bitsandbytes: the weights reloaded into its int8 / nf4 kernels
            quantized = load_quantized_bnb(model_path, bits, cfg.trust_remote_code)
            report = {"method": "bnb", "bits": bits}
            probed = probe(quantized, tokenizer, template, inputs.tofu, inputs.mc, cfg)
            del quantized
        summary["quantization"][str(bits)] = {**probed, "weights": report}
        summary.update({f"q{bits}_{key}": value for key, value in probed.items()})
        log.info("q%d (%s): %s", bits, method, _probe_line(probed))  # as the summary's q8_ keys
        log.debug("quantization attack, %d bits (%s): %s", bits, method, probed)


def _set_line(aggregates: dict) -> str:
    """A TOFU set's headline numbers, for the log."""
    return (f"ES {aggregates['extraction_strength']:.3f}, ROUGE-L {aggregates['rouge_l_recall']:.3f}, "
            f"prob {aggregates['probability']:.3f}, truth ratio {aggregates['truth_ratio']:.3f}, n {aggregates['n']}")


def _probe_line(probed: dict) -> str:
    """A probe's headline numbers, for the log: forget ES (of the paraphrased questions too), retain ES and each
    multiple-choice accuracy."""
    parts = [f"{registry.label(key)} {probed[key]:.3f}" for key in ("forget_es", "forget_para_es", "retain_es")
             if key in probed]
    mc = [f"{key.removeprefix('mc_')} {value:.3f}" for key, value in probed.items() if key.startswith("mc_")]
    return ", ".join(parts + (["MC " + ", ".join(mc)] if mc else []))


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
