"""Membership inference as an evaluator: each attack's scores of the forget and holdout rows (the attacks: `mia.py`),
their AUC, privleak against the retain model's AUC of the same attack, per-item score columns on the forget items,
and the holdout's scores as `items/holdout.parquet`."""

from __future__ import annotations

import logging
from pathlib import Path

import pyarrow.parquet as pq

from pipeline.evaluation import eval_io
from pipeline.evaluation.config import EvalConfig
from pipeline.evaluation.evaluator import Context, Evaluator, Part
from pipeline.evaluation.inputs import questions_hash
from pipeline.evaluation.mia import PRIVLEAK_ATTACK, TOKENS_HASH, MIAResult, membership_inference, privleak, tokens_hash
from pipeline.evaluation.mia_reference import reference_losses
from pipeline.evaluation.registry import MIA

log = logging.getLogger(__name__)


class MembershipInference(Evaluator):
    name, benchmark = "mia", MIA

    def enabled(self, cfg: EvalConfig) -> bool:
        return cfg.mia_spec is not None

    def prepare(self, ctx: Context) -> None:
        """The tokens the attacks score, hashed, and the reference model's losses of them: before the model loads."""
        inputs = ctx.inputs
        self.rows = {"forget": inputs.tofu["forget"][1], "holdout": inputs.holdout[1]}
        self.hashes = {part: tokens_hash(ctx.tokenizer, ctx.template, rows) for part, rows in self.rows.items()}
        self.reference_losses = None if inputs.reference is None else reference_losses(
            inputs.reference, self.hashes, ctx.tokenizer, ctx.template, self.rows, ctx.cfg.batch_size, ctx.dtype,
            ctx.device, ctx.cfg.trust_remote_code)

    def run(self, model, ctx: Context) -> Part:
        spec, inputs = ctx.cfg.mia_spec, ctx.inputs
        mia = membership_inference(model, ctx.tokenizer, ctx.template, self.rows["forget"], self.rows["holdout"],
                                   spec.attacks, spec.k, ctx.cfg.batch_size, spec.p, self.reference_losses)
        summary = summarise(mia, inputs.retain_auc, ctx.own_retain)
        # the reference model recorded for the retain model's check; "self" has none: it is this model
        reference_model = None if inputs.reference is None else inputs.reference.model or ctx.model_path
        for attack, settings in spec.settings(reference_model).items():
            summary["mia"][attack].update(settings)
        if "reference" in summary["mia"]:
            summary["mia"]["reference"]["reference"] = spec.reference
        for attack, scores in mia.forget.items():
            for record, score in zip(ctx.items["forget"], scores):
                record[f"mia_{attack}"] = float(score)
        ctx.item_meta["forget"][TOKENS_HASH] = self.hashes["forget"]
        # what open-unlearning's entries are made of (none for the retain model itself: its privleak's default)
        ctx.found["mia"] = {"forget": mia.forget, "holdout": mia.holdout, "auc": mia.auc,
                            "retain_auc": summary["mia"].get(PRIVLEAK_ATTACK, {}).get("retain_auc")}
        return Part(summary, {"items/holdout.parquet": lambda path: self._write_holdout(path, mia, inputs.holdout)})

    def _write_holdout(self, path: Path, mia: MIAResult, holdout: tuple[str, list[dict]]) -> None:
        split, rows = holdout
        records = [{"index": i, "question": r["question"], "answer": r["answer"],
                    **{f"mia_{a}": float(v[i]) for a, v in mia.holdout.items()}} for i, r in enumerate(rows)]
        meta = {"split": split, "questions_hash": questions_hash(rows), TOKENS_HASH: self.hashes["holdout"]}
        pq.write_table(eval_io.item_table(records, meta), path, compression="zstd")


def summarise(mia: MIAResult, retain_auc: dict[str, float] | None, own_retain: bool) -> dict:
    """`mia.<attack>`: AUC, mean scores, privleak against the retain model's AUC and that AUC (`retain_auc`; none
    where the retain model's evaluation lacks the attack; the retain model's own: privleak 0, against itself); top
    level: `mia_<attack>_auc`, `privleak` (open-unlearning's, of min_k) and each other attack's `privleak_<attack>`."""
    reference = mia.auc if own_retain else retain_auc
    summary = {"mia": {}}
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
    return summary
