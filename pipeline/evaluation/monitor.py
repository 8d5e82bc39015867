"""Evaluation during unlearning: every `every` optimizer steps, a cheap evaluation on a fixed subsample, so the
trade-off can be watched as it moves (a DVC plot per seed), and, optionally, the weights kept at the step a
declared rule selects (open-unlearning users ask for this: their issue #187).

Metrics, each as stage three computes it, on `n_items` forget and retain rows drawn once from the seed:
  eval_forget_es     forget extraction strength (teacher forcing only)
  eval_retain_es     retain extraction strength
  eval_retain_mu     MU's retain part: the harmonic mean of the retain probability, ROUGE-L recall and truth-ratio
                     aggregate (each also a column), what model utility loses first
On plain splits (`perturbed: false`: a user's own data, no perturbed answers) the rows are the forget and retain
splits themselves and there is no truth ratio, so no eval_retain_mu: a rule reads eval_retain_es instead.
Rule (`select`): the lowest `minimize` among the evaluated steps whose `floor_metric` is at least `floor` × its
value before unlearning (step 0, always evaluated and always eligible: if no unlearned step keeps the floor, the
rule returns the model unchanged, and says so); ties go to the earlier step.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import asdict, dataclass, field

from pipeline.common.errors import ParamError
from pipeline.common.params import at_least, between, check_rules, dataclass_from_params, one_of
from pipeline.data.templates import get_template
from pipeline.data.tofu import load_split
from pipeline.evaluation.registry import MONITOR, keys_of
from pipeline.evaluation.tofu_metrics import ES_DEFINITIONS, LOSS_DTYPES, answer_statistics, harmonic_mean
from pipeline.evaluation.tofu_sets import evaluate_set

log = logging.getLogger(__name__)

METRICS = keys_of(MONITOR)  # eval_forget_es, eval_retain_es, eval_retain_mu and MU's three parts
PERTURBED_ONLY = ("eval_retain_mu", "eval_retain_truth_ratio")  # not on plain splits


@dataclass(frozen=True)
class SelectionRule:
    minimize: str = "eval_forget_es"
    floor_metric: str = "eval_retain_mu"
    floor: float = 0.95                # × the floor metric's value at step 0


@dataclass(frozen=True)
class MonitorConfig:
    every: int = 0                     # evaluate every N optimizer steps and after the last; 0: off
    n_items: int = 32                  # forget and retain rows evaluated (all where the set is smaller)
    seed: int = 0                      # which rows
    select: dict = field(default_factory=dict)  # a SelectionRule; {}: keep the last step's weights
    batch_size: int = 32
    max_new_tokens: int = 64           # greedy answers for the retain ROUGE
    # from `data` and `evaluate` (the unlearn stage tracks these keys alone, so no other evaluation param reruns
    # unlearning): the TOFU splits and the metrics' definitions, as stage three's
    source: str = "artifacts/world"
    template: str | dict = field(default="plain", metadata={"types": (str, dict)})
    forget_split: str = "forget10"
    perturbed: bool = True             # false: the plain splits forget_split and retain_split (own data)
    retain_split: str = "retain"       # the plain retain split (perturbed: the retain_perturbed set, as stage three)
    es_definition: str = "open-unlearning"
    loss_dtype: str = "float32"

    @classmethod
    def from_params(cls, values: dict, where: str = "unlearn.monitor") -> "MonitorConfig":
        cfg = dataclass_from_params(cls, values or {}, where)
        check_rules(cfg, {"every": at_least(0), "n_items": at_least(1), "batch_size": at_least(1),
                          "max_new_tokens": at_least(1), "es_definition": one_of(ES_DEFINITIONS),
                          "loss_dtype": one_of(LOSS_DTYPES)}, where)
        if cfg.select:
            rule = dataclass_from_params(SelectionRule, cfg.select, f"{where}.select")
            check_rules(rule, {"minimize": one_of(METRICS), "floor_metric": one_of(METRICS),
                               "floor": between(0, 1)}, f"{where}.select")
            unmeasured = [(k, m) for k, m in (("minimize", rule.minimize), ("floor_metric", rule.floor_metric))
                          if m in PERTURBED_ONLY]
            if not cfg.perturbed and unmeasured:
                key, metric = unmeasured[0]
                raise ParamError(f"{where}.select: {metric} needs perturbed answers, which plain splits "
                                 f"({where}.perturbed: false) do not have; choose {key}: "
                                 + ("eval_retain_es" if key == "floor_metric" else "eval_forget_es"))
            if not cfg.every:
                raise ParamError(f"{where}.select: needs {where}.every > 0 (the steps it chooses among)")
        return cfg

    @property
    def rule(self) -> SelectionRule | None:
        return SelectionRule(**self.select) if self.select else None


class TrainingMonitor:
    """Called by the unlearning loop (`pipeline.training.unlearn.run_unlearn`): `evaluate(model, step)` gives the
    metrics row, `keep(row)` whether the weights of that step are the rule's choice so far."""

    def __init__(self, cfg: MonitorConfig, tokenizer):
        self.cfg, self.tokenizer = cfg, tokenizer
        self.every, self.selects = cfg.every, bool(cfg.select)
        self.template = get_template(cfg.template)
        rng = random.Random(cfg.seed)
        # the sets of stage three's forget and retain metrics (config.TOFU_SETS), or the plain splits
        suffix = "_perturbed" if cfg.perturbed else ""
        self.forget = self._sample(load_split(cfg.source, f"{cfg.forget_split}{suffix}"), rng)
        self.retain = self._sample(load_split(cfg.source, "retain_perturbed" if cfg.perturbed else cfg.retain_split),
                                   rng)
        self.best: dict | None = None      # the chosen row so far
        self.reference: float | None = None  # the floor metric at step 0

    def _sample(self, rows: list[dict], rng: random.Random) -> list[dict]:
        if len(rows) <= self.cfg.n_items:
            return rows
        return [rows[i] for i in sorted(rng.sample(range(len(rows)), self.cfg.n_items))]

    def evaluate(self, model, step: int) -> dict:
        started, was_training = time.perf_counter(), model.training
        model.eval()
        c = self.cfg
        forget = answer_statistics(model, self.tokenizer, self.template, [r["question"] for r in self.forget],
                                   [r["answer"] for r in self.forget], c.batch_size, c.es_definition, c.loss_dtype)
        retain = evaluate_set(model, self.tokenizer, self.template, self.retain, "retain", c.batch_size,
                              c.max_new_tokens, name="monitor retain", es_definition=c.es_definition,
                              loss_dtype=c.loss_dtype, perturbed=c.perturbed).aggregates
        model.train(was_training)
        parts = [retain["probability"], retain["rouge_l_recall"], retain.get("truth_ratio")]
        row = {"step": step, "eval_forget_es": float(forget.extraction_strength.mean()),
               "eval_retain_es": retain["extraction_strength"],
               "eval_retain_mu": harmonic_mean(parts) if c.perturbed else None,
               "eval_retain_probability": parts[0], "eval_retain_rouge": parts[1], "eval_retain_truth_ratio": parts[2]}
        row = {k: round(v, 6) if isinstance(v, float) else v for k, v in row.items()
               if c.perturbed or k not in PERTURBED_ONLY}  # plain splits: no truth ratio, so no MU
        row["eval_seconds"] = round(time.perf_counter() - started, 3)
        return row

    def keep(self, row: dict) -> bool:
        """Whether `row`'s step is the rule's choice among the steps seen so far (always False without a rule)."""
        rule = self.cfg.rule
        if rule is None:
            return False
        if row["step"] == 0:
            self.reference = row[rule.floor_metric]
        if row[rule.floor_metric] < rule.floor * self.reference:
            return False
        if self.best is None or row[rule.minimize] < self.best[rule.minimize]:
            self.best = row
            return True
        return False


class MonitorSpec:
    """A new `TrainingMonitor` per seed (`spec(tokenizer)`), as `pipeline.training.unlearn` takes it."""

    def __init__(self, cfg: MonitorConfig):
        self.cfg = cfg

    def __call__(self, tokenizer) -> TrainingMonitor:
        return TrainingMonitor(self.cfg, tokenizer)

    @property
    def selection(self) -> dict | None:
        """What the kept weights depend on (None without a rule): the whole config, rows and metrics included (the
        plain splits' keys only where they are read, so a perturbed run's record is what it was before them)."""
        if not self.cfg.select:
            return None
        values = asdict(self.cfg)
        if self.cfg.perturbed:
            del values["perturbed"], values["retain_split"]
        return values


# the keys of `evaluate` the monitor reads (the unlearn stage's DVC params list them)
EVALUATE_KEYS = ("forget_split", "es_definition", "loss_dtype")


def monitor_from_params(params: dict) -> MonitorSpec | None:
    """`unlearn.monitor` with the data's source and template and stage three's definitions; None when off."""
    data, evaluate = params.get("data") or {}, params.get("evaluate") or {}
    values = {**{k: data[k] for k in ("source", "template") if k in data},
              **{k: evaluate[k] for k in EVALUATE_KEYS if k in evaluate},
              **((params.get("unlearn") or {}).get("monitor") or {})}
    cfg = MonitorConfig.from_params(values)
    return MonitorSpec(cfg) if cfg.every else None
