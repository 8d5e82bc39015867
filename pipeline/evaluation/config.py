"""What an evaluation is asked to do: the `evaluate` params section (`EvalConfig`, over `data`'s source and template),
with its membership-inference and quantization specs and lm-eval's tasks (`lm_eval_tasks.LMEvalSpec`), every value
checked before any work.

Its own module so that the evaluation (`evaluate.py`) and the probes it runs (`probes.py`) both read it, one way.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from pipeline.common.errors import ParamError
from pipeline.common.params import (at_least, between, check_rules, dataclass_from_params, one_of, origins_of,
                                    positive, section)
from pipeline.evaluation import lm_eval_tasks
from pipeline.evaluation.mc_sets import check_mc_spec
from pipeline.evaluation.mia import DEFAULT_ATTACKS, GRADNORM_ORDERS, MIA_ATTACKS
from pipeline.evaluation.muse import KNOWMEM_MAX_NEW_TOKENS, MIN_K, VERBMEM_MAX_NEW_TOKENS, MuseSettings
from pipeline.evaluation.quantize import BITS, QUANT_METHODS
from pipeline.evaluation.tofu_metrics import ES_DEFINITIONS, LOSS_DTYPES

# The paper's TOFU sets: name -> the perturbed split that holds it ({forget} is the forget split's name).
TOFU_SETS = {"forget": "{forget}_perturbed", "retain": "retain_perturbed",
             "real_authors": "real_authors_perturbed", "world_facts": "world_facts_perturbed"}
# With `perturbed: false`, a user's own question-answer splits: the sets that have one, and the split that holds it.
PLAIN_SETS = {"forget": "{forget}", "retain": "{retain}"}
DEFAULT_RETAIN_SPLIT = "retain90"


@dataclass(frozen=True)
class EvalConfig:
    source: str = "artifacts/world"    # TOFU splits: a directory (the embedded world, ../shared/data/tofu) or the hub
    forget_split: str = "forget10"
    perturbed: bool = True             # TOFU's perturbed splits (truth ratio, forget quality, model utility); false:
                                       # plain question-answer splits, forget_split and retain_split (`skipped`)
    retain_split: str = DEFAULT_RETAIN_SPLIT  # the retain set's split where perturbed is false
    template: str | dict = field(default="plain", metadata={"types": (str, dict)})  # data.template: a name or tags
    tofu_sets: list = field(default_factory=lambda: list(TOFU_SETS))
    batch_size: int = 32               # teacher forcing and generation
    max_new_tokens: int = 64           # greedy answers for ROUGE (open-unlearning's generation config: 64)
    forget_rouge: bool = True          # the forget set's greedy answers and ROUGE; the tuner's trials switch it off
                                       # (they read forget ES, and the generation is most of the forget set's time)
    es_definition: str = "open-unlearning"  # or strict: ES = 0, not 1/n, when even the last answer token is wrong
    loss_dtype: str = "float32"        # the NLLs' arithmetic: float32 logits (open-unlearning's) or the model's dtype
    multiple_choice: dict = field(default_factory=dict)  # name -> {format: world|wmdp|mmlu, source, scoring, ...}
    mc_batch_size: int = 16
    seed: int = 0                      # the world's MC sets: the order of the choices
    trust_remote_code: bool = False
    # Is it forgotten or only hidden (docs/evaluation.md); each off when empty (null) or false
    mia: dict = field(default_factory=dict)        # membership inference: {holdout_split, k, attacks, p,
                                                    # reference} (MIASpec)
    paraphrase: bool = False           # forget and retain answers also asked with TOFU's paraphrased questions
    quantize: dict = field(default_factory=dict)   # the quantization attack: {bits, group_size, method} (QuantizeSpec)
    probe_sets: list = field(default_factory=list)  # what the attacks' probes score: forget, retain and MC set
                                                    # names (world_forget, ...); []: forget, retain and every MC set
    lm_eval: dict = field(default_factory=dict)    # lm-eval's own tasks: {tasks, num_fewshot, limit, batch_size,
                                                   # include_path} (lm_eval_tasks.LMEvalSpec); needs the lmeval extra
    sampling: dict = field(default_factory=dict)   # the sampling attack: {k, temperature, top_p, seed,
                                                   # rouge_threshold, max_new_tokens} (SamplingSpec)
    muse: dict = field(default_factory=dict)       # MUSE's benchmark instead of TOFU's: {source, ...} (MuseSpec)
    tokenizer: str | None = None       # where the model has none (MUSE's models: meta-llama/Llama-2-7b-hf's); null:
                                       # the model's

    @classmethod
    def from_params(cls, values: dict, where: str = "evaluate", origins: dict[str, str] | None = None) -> "EvalConfig":
        cfg = dataclass_from_params(cls, values, where, origins)
        unknown = [s for s in cfg.tofu_sets if s not in TOFU_SETS]
        if unknown:
            raise ParamError(f"{where}.tofu_sets: unknown {unknown} (choose from {list(TOFU_SETS)})")
        # real_authors and world_facts in tofu_sets are skipped, not refused, without perturbed splits: params.yaml
        # lists them, and a user's overlay need not repeat tofu_sets; paraphrase is off unless asked for
        if not cfg.perturbed and cfg.paraphrase:
            raise ParamError(f"{where}.paraphrase: needs TOFU's paraphrased questions, which plain question-answer "
                             f"splits ({where}.perturbed: false) do not have: set {where}.paraphrase: false")
        if cfg.perturbed and cfg.retain_split != DEFAULT_RETAIN_SPLIT:
            raise ParamError(f"{where}.retain_split={cfg.retain_split!r}: read only with {where}.perturbed: false "
                             f"(TOFU's retain set is {TOFU_SETS['retain']}): remove it, or set {where}.perturbed: "
                             "false")
        check_rules(cfg, {"batch_size": at_least(1), "mc_batch_size": at_least(1), "max_new_tokens": at_least(1),
                          "es_definition": one_of(ES_DEFINITIONS), "loss_dtype": one_of(LOSS_DTYPES)},
                    where, origins)
        # a set an overlay switches off (`NAME: null`) is left out, as any other setting null switches off
        cfg = replace(cfg, multiple_choice={n: s for n, s in cfg.multiple_choice.items() if s is not None})
        for name, spec in cfg.multiple_choice.items():
            check_mc_spec(spec, f"{where}.multiple_choice.{name}")
        if cfg.mia and "forget" not in cfg.tofu_sets:
            raise ParamError(f"{where}.mia: membership inference scores the forget set: add forget to "
                             f"{where}.tofu_sets, or switch it off: {where}.mia: null")
        if cfg.mia:
            MIASpec.from_params(cfg.mia, f"{where}.mia")  # their checks, before any work
        if cfg.quantize:
            QuantizeSpec.from_params(cfg.quantize, f"{where}.quantize")
        if cfg.lm_eval:
            lm_eval_tasks.LMEvalSpec.from_params(cfg.lm_eval, f"{where}.lm_eval")
        if cfg.sampling:
            SamplingSpec.from_params(cfg.sampling, f"{where}.sampling")
            if "forget" not in cfg.tofu_sets:
                raise ParamError(f"{where}.sampling: the sampling attack asks the forget questions: add forget to "
                                 f"{where}.tofu_sets, or switch it off: {where}.sampling: null")
        if cfg.muse:
            MuseSpec.from_params(cfg.muse, f"{where}.muse")
            # MUSE's summary is its own (its privleak is not membership inference's on TOFU's forget set)
            also = [name for name, on in (("tofu_sets", cfg.tofu_sets), ("multiple_choice", cfg.multiple_choice),
                                          ("mia", cfg.mia), ("paraphrase", cfg.paraphrase),
                                          ("quantize", cfg.quantize), ("lm_eval", cfg.lm_eval),
                                          ("sampling", cfg.sampling)) if on]
            if also:
                raise ParamError(f"{where}.muse: MUSE is evaluated on its own, and {where}.{also[0]} is on too: "
                                 f"switch off {', '.join(f'{where}.{a}' for a in also)} (tofu_sets: [], the others "
                                 "null), or evaluate MUSE in an evaluation of its own (`tokenunlearn evaluate-muse`)")
        return cfg

    @property
    def set_splits(self) -> dict[str, str]:
        """The TOFU sets evaluated: name -> its split (perturbed, or a user's plain one)."""
        if self.perturbed:
            return {name: TOFU_SETS[name].format(forget=self.forget_split) for name in self.tofu_sets}
        return {name: PLAIN_SETS[name].format(forget=self.forget_split, retain=self.retain_split)
                for name in self.tofu_sets if name in PLAIN_SETS}

    @property
    def skipped(self) -> dict[str, str]:
        """What a TOFU evaluation has that plain question-answer splits, or a forget set without greedy answers,
        cannot give: metric or evaluator -> why (the summary's `skipped`); empty for a whole evaluation of perturbed
        splits, and in MUSE's evaluation, which has its own."""
        out = {}
        if not self.forget_rouge and "forget" in self.tofu_sets and not self.muse:
            out["forget_rouge"] = "no greedy answers on the forget set (evaluate.forget_rouge: false)"
        if self.perturbed or self.muse:
            return out
        why = "no perturbed answers in plain question-answer splits (evaluate.perturbed: false)"
        out |= {"truth_ratio": why,
                "forget_quality": "needs the forget set's truth ratios, which need perturbed answers",
                "model_utility": "needs TOFU's real_authors and world_facts sets and truth ratios"}
        out.update({name: "evaluate.perturbed false reads only the forget and retain splits"
                    for name in self.tofu_sets if name not in PLAIN_SETS})
        out["paraphrase"] = "no paraphrased questions in plain question-answer splits"
        if not self.multiple_choice:
            out["multiple_choice"] = "none configured (evaluate.multiple_choice)"
        return out

    @property
    def mia_spec(self) -> "MIASpec | None":
        return MIASpec.from_params(self.mia, "evaluate.mia") if self.mia else None

    @property
    def quantize_spec(self) -> "QuantizeSpec | None":
        return QuantizeSpec.from_params(self.quantize, "evaluate.quantize") if self.quantize else None

    @property
    def lm_eval_spec(self) -> "lm_eval_tasks.LMEvalSpec | None":
        return lm_eval_tasks.LMEvalSpec.from_params(self.lm_eval) if self.lm_eval else None

    @property
    def sampling_spec(self) -> "SamplingSpec | None":
        return SamplingSpec.from_params(self.sampling, "evaluate.sampling") if self.sampling else None

    @property
    def muse_spec(self) -> "MuseSpec | None":
        return MuseSpec.from_params(self.muse, "evaluate.muse") if self.muse else None


@dataclass(frozen=True)
class MIASpec:
    """Membership inference of the forget set against a holdout set of authors the models never saw."""

    holdout_split: str = "holdout10"   # TOFU's and the embedded world's holdout01/05/10
    k: float = 0.4                     # Min-K% and Min-K%++ (open-unlearning's TOFU config)
    attacks: list = field(default_factory=lambda: list(DEFAULT_ATTACKS))  # gradnorm, reference: by name
    p: float = 2.0                     # gradnorm's norm order: 1, 2 or .inf (open-unlearning's TOFU config: 2)
    reference: str | None = None       # the reference attack's reference model: retain, an evaluation directory
                                       # or a model (mia.py)

    @classmethod
    def from_params(cls, values: dict, where: str) -> "MIASpec":
        spec = dataclass_from_params(cls, values, where)
        check_rules(spec, {"k": between(0, 1, lo_open=True), "p": one_of(GRADNORM_ORDERS)}, where)
        unknown = [a for a in spec.attacks if a not in MIA_ATTACKS]
        if unknown or not spec.attacks:
            raise ParamError(f"{where}.attacks={spec.attacks!r}: choose one or more of {list(MIA_ATTACKS)}")
        if ("reference" in spec.attacks) != bool(spec.reference):
            raise ParamError(f"{where}.reference={spec.reference!r}: the reference attack needs a reference model "
                             "(retain, an evaluation directory or a model), and a reference is set only with it: "
                             f"set both {where}.reference and reference in {where}.attacks, or neither")
        return spec

    def settings(self, reference_model: str | None) -> dict[str, dict]:
        """What gradnorm's and reference's AUCs depend on beyond the model, as `mia.<attack>` records it: privleak
        compares them only with the retain model's of the same settings."""
        out = {}
        if "gradnorm" in self.attacks:
            out["gradnorm"] = {"p": "inf" if self.p == float("inf") else int(self.p)}
        if "reference" in self.attacks:
            out["reference"] = {"reference_model": reference_model}
        return out


@dataclass(frozen=True)
class QuantizeSpec:
    """The quantization attack: the weights rounded to each of `bits`, then the probes again."""

    bits: list = field(default_factory=lambda: [8, 4])
    group_size: int = 128              # input columns sharing one scale (w4g128, the common weight-only baseline)
    method: str = "auto"               # rtn (weight-only round-to-nearest, any device) | bnb (bitsandbytes, CUDA) |
                                       # auto (bnb where it runs, else rtn)

    @classmethod
    def from_params(cls, values: dict, where: str) -> "QuantizeSpec":
        spec = dataclass_from_params(cls, values, where)
        check_rules(spec, {"method": one_of(QUANT_METHODS), "group_size": at_least(0)}, where)
        if not spec.bits or not all(isinstance(b, int) and not isinstance(b, bool) and b in BITS for b in spec.bits):
            raise ParamError(f"{where}.bits={spec.bits!r}: a non-empty list of bit widths of {list(BITS)}, e.g. [8, 4]")
        return spec


@dataclass(frozen=True)
class SamplingSpec:
    """The sampling attack: answers sampled per forget question, and whether any of the first k says the fact."""

    k: list = field(default_factory=lambda: [1, 5, 20])  # leak@k for each; max(k) samples per question
    temperature: float = 1.0
    top_p: float = 1.0                 # nucleus sampling; 1: the whole distribution
    seed: int = 0
    rouge_threshold: float = 0.7       # where the data has no fact annotations (TOFU): a sample leaks at ROUGE-L
                                       # recall ≥ this of the answer (benchmarks/leak_threshold.py: why 0.7)
    max_new_tokens: int | None = None  # null: evaluate.max_new_tokens

    @classmethod
    def from_params(cls, values: dict, where: str) -> "SamplingSpec":
        spec = dataclass_from_params(cls, values, where)
        ks = spec.k
        if not ks or not all(isinstance(k, int) and not isinstance(k, bool) and k >= 1 for k in ks) \
                or len(set(ks)) != len(ks):
            raise ParamError(f"{where}.k={ks!r}: a list of distinct sample counts of at least 1, e.g. [1, 5, 20]")
        check_rules(spec, {"temperature": positive(), "top_p": between(0, 1, lo_open=True),
                           "rouge_threshold": between(0, 1, lo_open=True)}, where)
        if spec.max_new_tokens is not None and (not isinstance(spec.max_new_tokens, int) or spec.max_new_tokens < 1):
            raise ParamError(f"{where}.max_new_tokens={spec.max_new_tokens!r}: a positive integer, or null")
        return spec


@dataclass(frozen=True)
class MuseSpec:
    """MUSE's benchmark (muse.py): where its sets are and what changes its numbers; the defaults are MUSE's."""

    source: str = "muse-bench/MUSE-News"  # a hub dataset (muse-bench/MUSE-News, -Books) or a local copy in its layout
    verbmem_max_new_tokens: int = VERBMEM_MAX_NEW_TOKENS
    knowmem_max_new_tokens: int = KNOWMEM_MAX_NEW_TOKENS
    k: float = MIN_K                   # Min-K%'s fraction of tokens
    attack: str = "min_k"              # the membership attack PrivLeak reads (MUSE: Min-K% Prob)
    stem: bool = False                 # stem words in ROUGE (open-unlearning does; MUSE does not)
    batch_size: int = 8                # prompts per generation batch, texts per scoring batch
    retain_auc: float | None = None    # the retain model's published AUC, where its evaluation is not at hand (MUSE's
                                       # retrained models, Min-40%: News 0.4772, Books 0.5393)

    @classmethod
    def from_params(cls, values: dict, where: str) -> "MuseSpec":
        spec = dataclass_from_params(cls, values, where)
        try:
            spec.settings()
        except ParamError as e:
            raise ParamError(f"{where}.{e}") from None
        if spec.retain_auc is not None and not 0 <= spec.retain_auc <= 1:
            raise ParamError(f"{where}.retain_auc={spec.retain_auc}: an AUC is between 0 and 1")
        return spec

    def settings(self) -> MuseSettings:
        return MuseSettings(self.verbmem_max_new_tokens, self.knowmem_max_new_tokens, self.k, self.attack, self.stem,
                            self.batch_size)


def eval_config(params: dict) -> EvalConfig:
    """The `evaluate` section over `data`'s source and template: what every evaluation of the pipeline uses."""
    data = params.get("data") or {}
    values = {"source": data.get("source"), "template": data.get("template"), **section(params, "evaluate")}
    origins = {"source": "data.source", "template": "data.template"}
    origins.update(origins_of(evaluate=section(params, "evaluate")))
    return EvalConfig.from_params({k: v for k, v in values.items() if v is not None}, "evaluate", origins)
