"""The Python API: a forget request from a notebook, on a `transformers` model (or a path), with the CLI's params.

    from pipeline.api import ForgetRequest
    request = ForgetRequest(model, tokenizer, params="params.yaml", work_dir="artifacts/requests/varnholm")
    request.prepare(forget=[{"question": ..., "answer": ...}, ...], retain="keep.csv")
    scores = request.attribute()            # a DataFrame: one row per answer token (Δ, H, φ, the weights)
    lr = request.tune("s_npo_ens")           # its rate bisected onto the utility floor (optional)
    unlearned = request.unlearn("s_npo_ens")  # the unlearned model (transformers), at that rate
    summary = request.evaluate()             # the evaluation's summary (before: request.evaluate("before"))
    request.export("artifacts/requests/varnholm/export")  # model + card + before/after tables

Each step calls the library functions the stages call (own-data, attribute, reference, tune, unlearn, evaluate,
export), on the params the CLI reads, with the own-data settings of configs/own-data.yaml (`OWN_DATA`); its
artifacts go under `work_dir`, so a step reruns alone and the CLI can read them. A model object is saved there
first (safetensors): every stage reads a model from a path.
"""

from __future__ import annotations

import copy
import json
import logging
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterable

from pipeline.common.errors import ParamError
from pipeline.common.params import apply_overlay, load_params, section

log = logging.getLogger(__name__)

# What configs/own-data.yaml sets besides the files (a test keeps the two equal): the stages read the splits
# own-data writes, the evaluation runs what applies to data without perturbed answers, tuning holds retain ES.
OWN_DATA: dict = {
    "attribution": {"split": "forget"},
    "reference": {"split": "retain", "forget_split": "forget"},
    "unlearn": {"defaults": {"retain_split": "retain"},
                "monitor": {"every": 5, "perturbed": False, "retain_split": "retain"}},
    "evaluate": {"perturbed": False, "forget_split": "forget", "retain_split": "retain",
                 "tofu_sets": ["forget", "retain"], "multiple_choice": None, "probe_sets": ["forget", "retain"]},
    "tune": {"utility": "retain_es"},
}


def passage_settings(source: str | Path) -> dict:
    """What configs/own-passages.yaml sets besides the files, for the splits own-data wrote into `source` (a test
    keeps the two equal): stage one in corpus mode on the forget passages, the retain term and θ_o's cache on the
    retain passages, the probes read with the `passage` template."""
    return {"data": {"template": "passage"},
            "attribution": {"mode": "corpus", "corpus": f"{source}/forget_corpus.jsonl"},
            "reference": {"corpus": f"{source}/retain_corpus.jsonl"},
            "unlearn": {"defaults": {"retain_corpus": f"{source}/retain_corpus.jsonl"}}}


HOLDOUT = {"evaluate": {"mia": {"holdout_split": "holdout"}}}  # given a holdout set: membership inference against it


def _records_file(records: str | Path | Iterable[dict], path: Path) -> str:
    """A file the own-data reader checks: the user's own file as it is, or their records as JSON Lines."""
    if isinstance(records, (str, Path)):
        return str(records)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in records:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return str(path)


class ForgetRequest:
    """One forget request: its model, params and work directory; the steps in order (each reads the last's
    artifacts under `work_dir`, so a new kernel picks up where the last one stopped)."""

    def __init__(self, model: Any, tokenizer: Any = None, params: str | Path | dict = "params.yaml",
                 overlays: Iterable[str | Path] = (), overrides: Iterable[str] = (),
                 work_dir: str | Path = "artifacts/requests/request") -> None:
        self.work = Path(work_dir)
        base = copy.deepcopy(params) if isinstance(params, dict) else load_params(params, list(overlays),
                                                                                   list(overrides))
        self.params = apply_overlay(base, OWN_DATA, "ForgetRequest's own-data settings")
        self.model_path = self._model_path(model, tokenizer)
        self.params["data"]["source"] = str(self.work / "data")
        for key in ("attribution", "reference", "unlearn"):
            self.params[key]["model"] = self.model_path
        self._base = copy.deepcopy(self.params)  # what prepare() starts from: another request's data leaves nothing
        self.tuned: dict[str, float] = {}        # run -> the rate tune() chose, which unlearn() trains at

    def _model_path(self, model: Any, tokenizer: Any) -> str:
        if isinstance(model, (str, Path)):
            return str(model)
        if not hasattr(model, "save_pretrained") or tokenizer is None:
            raise ParamError("model: a transformers model with its tokenizer, or a model directory's path")
        path = self.work / "model_before"
        model.save_pretrained(path, safe_serialization=True)  # safetensors: never a pickle
        tokenizer.save_pretrained(path)
        return str(path)

    # --- the steps -------------------------------------------------------------------------------------------

    def prepare(self, forget, retain, holdout=None, fields: dict | None = None) -> dict:
        """Check the forget and retain data (and a holdout set), each a file (JSON Lines, JSON, CSV, Parquet) or a
        list of {question, answer} (or {text}) records, and write them as splits; returns own-data's manifest.
        Passages set the passage settings (`passage_settings`), a holdout set membership inference against it. New
        data clears what was made from the last (attribution, reference, tunings, evaluations, runs)."""
        from pipeline.common.atomic import hold_outputs
        from pipeline.common.modeling import load_tokenizer
        from pipeline.data.config import DataConfig
        from pipeline.data.own_data import write_splits
        from pipeline.data.own_files import DataFile, read_file

        self.params, self.tuned = copy.deepcopy(self._base), {}
        data = self.params["data"]
        for name, records in (("forget", forget), ("retain", retain), ("holdout", holdout)):
            if records is None:
                data.pop(name, None)
                continue
            path = _records_file(records, self.work / "input" / f"{name}.jsonl")
            data[name] = {"path": path, "fields": fields} if fields else path
        # passages or pairs: the file decides, and the passage settings go in before own-data checks the template
        if read_file(DataFile.from_params(data["forget"], "data.forget"), "data.forget").spec.kind == "text":
            self.params = apply_overlay(self.params, passage_settings(data["source"]),
                                        "ForgetRequest's passage settings")
        if holdout is not None:
            self.params = apply_overlay(self.params, HOLDOUT, "ForgetRequest's holdout setting")
        cfg = DataConfig.from_params(section(self.params, "data"))
        before = self._manifest_sets()
        with hold_outputs(cfg.source):
            manifest = write_splits(cfg, Path(cfg.source), load_tokenizer(self.model_path))
        if before is not None and before != manifest["sets"]:
            for made in ("attribution", "reference", "tuning", "eval", "unlearn", "monitor", "checkpoints", "plots"):
                shutil.rmtree(self.work / made, ignore_errors=True)
            log.info("%s: new data, so what was made from the last is cleared", self.work)
        return manifest

    def _manifest_sets(self) -> dict | None:
        try:
            return json.loads((self.work / "data" / "manifest.json").read_text())["sets"]
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def attribute(self):
        """Stage one on the forget set: the token scores as a DataFrame (`token_scores`)."""
        from pipeline.attribution.inspect import token_scores
        from pipeline.attribution.run import AttributionConfig, run_attribution
        from pipeline.common.atomic import hold_outputs
        from pipeline.data.config import DataConfig

        out = self.work / "attribution"
        with hold_outputs(out):
            run_attribution(AttributionConfig.from_params(section(self.params, "attribution")),
                            DataConfig.from_params(section(self.params, "data")), out, self.work / "attribution.json")
        weighting = section(self.params, "unlearn.weightings")
        return token_scores(out, r=weighting["hard"]["r"], tau=weighting["soft"]["tau"])

    def tune(self, run: str) -> float:
        """Bisect `run`'s learning rate onto the utility floor (tune.utility_floor × the model's own tune.utility
        before unlearning; tune.utility is retain ES here), as `tokenunlearn tune --run RUN` does; `unlearn(run)`
        then trains at that rate. Returns the rate (the tuning: work_dir/tuning/RUN/choice.json)."""
        from pipeline.common.atomic import hold_outputs
        from pipeline.studies.tune_runs import chosen_lr, run_tuning

        if not (self.work / "eval" / "before" / "metrics.json").is_file():
            self.evaluate("before")
        out = self.work / "tuning" / run
        with hold_outputs(out):
            run_tuning(self.params, run, [run], self.work / "attribution", self._reference(),
                       self.work / "eval" / "before" / "metrics.json", None, out)
        self.tuned[run] = chosen_lr(out / "choice.json", run)  # checked as `unlearn --lr-from` checks it
        return self.tuned[run]

    def unlearn(self, run: str, seed: int = 0):
        """Run `run` of unlearn.runs (θ_o's retain cache first, where its retain term reads one) at the rate tune()
        chose for it, if it was tuned (here or in an earlier kernel), and return the unlearned model."""
        from pipeline.common.atomic import hold_outputs
        from pipeline.common.modeling import load_model
        from pipeline.data.config import DataConfig
        from pipeline.evaluation.monitor import monitor_from_params
        from pipeline.training.run_config import run_configs
        from pipeline.training.unlearn import run_unlearn_seeds

        cfg, train = run_configs(self.params, run)
        choice = self.work / "tuning" / run / "choice.json"
        if run not in self.tuned and choice.is_file():  # tuned in an earlier kernel
            from pipeline.studies.tune_runs import chosen_lr
            self.tuned[run] = chosen_lr(choice, run)
            log.info("unlearn %s: the rate tuned before, %.3g (%s)", run, self.tuned[run], choice)
        if run in self.tuned:
            train = replace(train, lr=self.tuned[run])
        data = DataConfig.from_params(section(self.params, "data"))
        reference = self._reference()
        monitor = monitor_from_params(self.params)  # forget and retain ES every few steps (unlearn.monitor)
        self.run, out = run, self.work / "unlearn" / run
        with hold_outputs(out):
            run_unlearn_seeds(run, cfg, train, data, self.model_path, self.work / "attribution", out,
                              self.work / "checkpoints" / run, self.work / "plots" / run, [seed], True, reference,
                              monitor, self.work / "monitor" / run if monitor else None)
        self.unlearned = out / f"seed{seed}" / "model"
        return load_model(self.unlearned)

    def _reference(self) -> Path:
        """θ_o's top-k on the retain data (`tokenunlearn reference`), made once under work_dir."""
        from pipeline.attribution.reference import ReferenceConfig, run_reference
        from pipeline.common.atomic import hold_outputs
        from pipeline.data.config import DataConfig

        reference = self.work / "reference"
        if not (reference / "_manifest.json").is_file():
            with hold_outputs(reference):
                run_reference(ReferenceConfig.from_params(section(self.params, "reference")),
                              DataConfig.from_params(section(self.params, "data")), reference,
                              self.work / "reference.json")
        return reference

    def evaluate(self, which: str = "after") -> dict:
        """Evaluate the model `before` unlearning or `after` it on the forget and retain sets (and what else the
        params name that applies); returns the summary."""
        from pipeline.common.atomic import hold_outputs
        from pipeline.evaluation.config import eval_config
        from pipeline.evaluation.evaluate import evaluate_model

        if which not in ("before", "after"):
            raise ParamError(f"evaluate: which={which!r}: before or after")
        model = self.model_path if which == "before" else str(self._unlearned())
        out = self.work / "eval" / which
        with hold_outputs(out):
            return evaluate_model(model, eval_config(self.params), out, None)

    def export(self, out: str | Path, retain_sample: int = 20) -> dict:
        """The unlearned model with its model card and the before/after tables (`tokenunlearn export`); both
        evaluations are made first where they are not there."""
        from pipeline.common.atomic import hold_outputs
        from pipeline.studies.request import export_request, run_settings
        from pipeline.training.run_config import run_configs

        for which in ("before", "after"):
            if not (self.work / "eval" / which / "metrics.json").is_file():
                self.evaluate(which)
        run_config = run_settings(*run_configs(self.params, self.run))
        manifest = json.loads((self.work / "data" / "manifest.json").read_text())
        with hold_outputs(out):
            return export_request(self.run, run_config, self._unlearned(), self.work / "eval" / "before",
                                  self.work / "eval" / "after", Path(out), manifest, retain_sample)

    def _unlearned(self) -> Path:
        if getattr(self, "unlearned", None) is None:
            raise ParamError("no unlearned model yet: call unlearn(RUN) first")
        return self.unlearned

