"""The reference attack's reference model (`evaluate.mia.reference`): its per-sample losses on the forget and the
holdout rows, read from its own evaluation where there is one, so no second model is loaded; else the model loaded
once, scored, and freed before the model evaluated loads.

`reference` names it:
  retain   the retain model, through the evaluation `--retain-results` names (the retain model's own evaluation is
           its own reference: every score 0, AUC 0.5, privleak 0)
  DIR      another evaluation directory of this pipeline (its items/forget.parquet and items/holdout.parquet)
  MODEL    a model directory or hub name to load, where no evaluation of it is at hand

A cached loss is used only where it scored the very tokens scored here: the questions hash of each set (checked
before any model loads) and the hash of the encoded samples (`mia.tokens_hash`: questions, answers, their order,
the template and the tokenizer; checked once the tokenizer loads). Anything else is refused, naming the file.
"""

from __future__ import annotations

import gc
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pipeline.common.errors import DataError, ParamError
from pipeline.common.modeling import check_vocab, load_model
from pipeline.common.paths import is_hub_name
from pipeline.data.templates import PromptTemplate
from pipeline.evaluation import eval_io
from pipeline.evaluation.mia import TOKENS_HASH, ReferenceLosses, answer_tokens, loss_score

log = logging.getLogger(__name__)

RETAIN = "retain"
PARTS = ("forget", "holdout")  # the two sets the attacks score, as items/<part>.parquet
LOSS_COLUMN = "mia_loss"       # the loss attack's per-item score: the reference attack's reference loss


@dataclass
class Reference:
    """Where the reference losses come from: "self" (the model evaluated is the reference), "cached" (an
    evaluation's items, `losses` read and `tokens_hash` to check) or "model" (loaded on first use; `losses` and
    `tokens_hash` kept then, so the seeds of a run load it once)."""

    name: str                                     # as evaluate.mia.reference gives it
    kind: str
    source: str                                   # the evaluation directory read, or the model to load
    model: str | None = None                      # the reference model (None for "self": the model evaluated)
    losses: tuple[np.ndarray, np.ndarray] | None = None
    tokens_hash: dict[str, str] | None = None


def resolve_reference(name: str, retain_dir: Path | None, own_retain: bool,
                      questions_hash: dict[str, str]) -> Reference:
    """The reference `name` stands for, its cached losses read and checked against this evaluation's questions
    (`questions_hash`: forget and holdout), before any model loads."""
    where = "evaluate.mia.reference"
    if name == RETAIN:
        if retain_dir is None:
            raise ParamError(f"{where}: retain reads the retain model's evaluation, and none is named: pass "
                             "--retain-results DIR, or name the reference model's evaluation or the model itself")
        if own_retain:
            return Reference(name, "self", str(retain_dir))
        path = Path(retain_dir)
        if not (path / "items" / "holdout.parquet").is_file():
            raise DataError(f"{where}: retain reads {path / 'items'}/{{forget,holdout}}.parquet, and {path} has no "
                            "items/holdout.parquet (an evaluation without evaluate.mia, or open-unlearning's "
                            "TOFU_EVAL.json, which has no hash to check its items by): evaluate the retain model "
                            "with evaluate.mia, or name the retain model itself to load")
        return _cached(name, path, questions_hash)
    path = Path(name)
    if (path / "items").is_dir() or (path / "metrics.json").is_file():
        if not (path / "items" / "holdout.parquet").is_file():
            raise DataError(f"{where}: {path} is an evaluation without membership inference (no "
                            "items/holdout.parquet): evaluate that model with evaluate.mia, or name the model")
        return _cached(name, path, questions_hash)
    if path.is_dir() or is_hub_name(name):
        return Reference(name, "model", name, name)
    raise ParamError(f"{where}: '{name}' is neither retain, an evaluation directory (items/holdout.parquet) nor a "
                     "model directory or hub name")


def _cached(name: str, eval_dir: Path, questions_hash: dict[str, str]) -> Reference:
    losses, hashes = [], {}
    for part in PARTS:
        file = eval_dir / "items" / f"{part}.parquet"
        if not file.is_file():
            raise DataError(f"{file}: missing; the reference attack reads the reference model's {part} losses there")
        table = eval_io.read_parquet(file)
        try:
            meta = json.loads((table.schema.metadata or {})[b"tokenunlearn"])
        except (KeyError, TypeError, ValueError):
            meta = {}
        if meta.get("questions_hash") != questions_hash[part]:
            raise DataError(f"{file}: the reference model was evaluated on other {part} questions (hash "
                            f"{meta.get('questions_hash')}, here {questions_hash[part]}); evaluate both on the same "
                            "source, forget split and holdout split")
        if not isinstance(meta.get(TOKENS_HASH), str):
            raise DataError(f"{file}: no record of the tokens its attacks scored ({TOKENS_HASH}; an evaluation "
                            "written before the reference attack): evaluate the reference model again")
        if LOSS_COLUMN not in table.column_names:
            raise DataError(f"{file}: no {LOSS_COLUMN} column: evaluate the reference model with loss among "
                            "evaluate.mia.attacks")
        column = table.column(LOSS_COLUMN).to_pylist()
        losses.append(np.array([eval_io.number(v, f"{file}: row {i}: {LOSS_COLUMN}", 0.0)
                                for i, v in enumerate(column)]))
        hashes[part] = meta[TOKENS_HASH]
    summary = eval_dir / "metrics.json"  # which model it evaluated, for the retain model's check (privleak)
    model = eval_io.read_json(summary, "evaluation summary").get("model") if summary.is_file() else None
    return Reference(name, "cached", str(eval_dir), model if isinstance(model, str) else str(eval_dir),
                     (losses[0], losses[1]), hashes)


def reference_losses(ref: Reference, tokens_hash: dict[str, str], tokenizer, template: PromptTemplate,
                     rows: dict[str, list[dict]], batch_size: int, dtype: torch.dtype, device: torch.device,
                     trust_remote_code: bool = False) -> ReferenceLosses:
    """The reference losses for the membership inference of a model whose samples hash to `tokens_hash` (forget,
    holdout): "self"; the cached ones, once their tokens are checked; or the reference model's, loaded with this
    tokenizer, scored and freed (again only where the tokens changed: the seeds of a run load it once)."""
    if ref.kind == "self":
        return "self"
    if ref.kind == "model" and ref.tokens_hash != tokens_hash:
        log.info("reference attack: loading the reference model %s", ref.source)
        model = load_model(ref.source, dtype=dtype, trust_remote_code=trust_remote_code).to(device).eval()
        check_vocab(model, tokenizer, ref.source)
        scored = []
        for part in PARTS:
            samples = answer_tokens(model, tokenizer, template, [r["question"] for r in rows[part]],
                                    [r["answer"] for r in rows[part]], batch_size, desc=f"reference model: {part}")
            scored.append(np.array([loss_score(s.logp) for s in samples]))
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        ref.losses, ref.tokens_hash = (scored[0], scored[1]), dict(tokens_hash)
    for part, losses in zip(PARTS, ref.losses):
        if ref.tokens_hash[part] != tokens_hash[part]:
            raise DataError(f"{Path(ref.source) / 'items' / f'{part}.parquet'}: the reference model scored other "
                            f"{part} tokens (hash {ref.tokens_hash[part]}, here {tokens_hash[part]}): the same "
                            "questions encoded with another template or tokenizer; evaluate both alike, or name "
                            "the reference model to load")
        if len(losses) != len(rows[part]):
            raise DataError(f"{ref.source}: {len(losses)} reference {part} losses for {len(rows[part])} rows")
    if ref.kind == "cached":
        log.info("reference attack: the reference model's losses from %s (no model loaded)", ref.source)
    return ref.losses


def check_retain_settings(retain_dir: Path, settings: dict[str, dict]) -> None:
    """privleak compares each attack's AUC with the retain model's: refused where the retain model's evaluation
    ran an attack with other settings (`settings`: attack -> {key: value}, as written under `mia.<attack>`; paths
    compared as the places they name)."""
    file = Path(retain_dir) / "metrics.json"
    if not file.is_file():
        return  # open-unlearning's TOFU_EVAL.json records none of them
    mia = eval_io.read_json(file, "evaluation summary").get("mia") or {}
    for attack, wanted in settings.items():
        entry = mia.get(attack) if isinstance(mia, dict) else None
        for key, value in wanted.items():
            theirs = entry.get(key) if isinstance(entry, dict) else None
            if theirs is not None and _place(theirs) != _place(value):
                raise DataError(f"{file}: mia.{attack}.{key} is {theirs!r}, here {value!r}: privleak would compare "
                                "with another attack; evaluate the retain model with the same evaluate.mia")


def _place(value):
    return str(Path(value).resolve()) if isinstance(value, str) and Path(value).exists() else value
