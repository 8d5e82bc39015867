"""A run's config: its params, layered from `unlearn.defaults`, the method's own retain term, its method's and
weighting's sections and its own keys (`_run_layers`), checked into an `UnlearnConfig` and a `TrainConfig`
(`run_configs`); and the params its weights depend on (`params_used`), which its record and fingerprint name.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from pipeline.attribution.variants import parse_score
from pipeline.attribution.weights import FOCUS, WEIGHTING
from pipeline.common.errors import ParamError
from pipeline.common.params import (at_least, between, check_keys, check_rules, dataclass_from_params, one_of,
                                    origins_of, positive, section)
from pipeline.training.engine import TrainConfig
from pipeline.training.forget_stream import Weighting
from pipeline.training.losses import FORGET_REDUCTIONS
from pipeline.training.methods import HYPERPARAMETERS, METHODS, check_hyperparameters, method_params
from pipeline.training.retain_terms import RETAIN_LOSSES, RetainLoss


@dataclass(frozen=True)
class UnlearnConfig:
    method: str = "ga"                 # a module of pipeline/training/methods: ga | wga | npo | rmu | graddiff |
                                       # simnpo | satimp | ceu | idkdpo | altpo | idknll | undial | pdu
    weighting: str = "uniform"         # uniform (sequence level) | hard (T-) | soft (S-)
    r: float = 0.2                     # hard: the top-r fraction of φ
    tau: float = 0.5                   # soft: softmax(φ / τ)
    mix: float = 0.0                   # hard, soft: the share of each sample's push spread evenly over its scored
                                       # tokens, ω = mix·1/n + (1 − mix)·ω/Σω (0: the weights alone; 1: uniform's)
    focus: str = "all"                 # hard, soft: all | first (each stretch of selected tokens pushed at its
                                       # first token, with the stretch's summed weight)
    alpha: float = 0.7                 # φ = α·minmax(Δ) + (1−α)·minmax(H), recomputed from the shards' Δ and H
    score: str = "phi"                 # the attribution variant weighted (phi: the paper's; e.g. learned+span, see
                                       # pipeline/attribution/variants.py); its columns must be in the shards
    retain_split: str = "retain90"
    retain_corpus: str = ""            # instead of retain_split: passages (JSON Lines, `text`), e.g. the world's
                                       # biographies, less those of the forget split's authors (WMDP-style runs)
    retain_loss: str = "kl"            # kl: λ·KL(p_ref ‖ p_θ) on retain answers | nll | activation (RMU's) | none
    retain_weight: float = 0.1         # λ (PDU: λ's value at the first step, then its dual variable)
    reduction: str = "sample"          # how the token losses ℓ_i pool with ω: sample (Σ ω ℓ / Σ ω per sample, then
                                       # the mean over samples) | token (Σ ω ℓ / Σ ω over the micro-batch's tokens)
    rmu_layer: int = 2                 # the layer RMU steers and its `activation` retain term matches
                                       # (hidden_states index)
    retain_batch_size: int = 0         # retain samples per micro-batch; 0: the forget micro-batch size
    retain_reference: str = "cache"    # θ_o for kl / activation: cache (`tokenunlearn reference`; no second model
                                       # in memory) | model (θ_o loaded beside the trained model, the exact KL)
    reference_top_k: int = 32          # cache: θ_o's tokens kept per position, when the run builds its own cache
                                       # (no --reference; the stage's cache has reference.top_k)
    chunk_size: int = 1024             # positions per LM-head chunk (memory: chunk x vocab floats at a time)
    trust_remote_code: bool = False
    hyperparameters: dict = field(default_factory=dict)  # the methods' keys the run sets (beta, gamma, rmu_steer,
                                                         # ...), declared by their modules: `method_params`

    @classmethod
    def from_params(cls, values: dict, where: str, origins: dict[str, str] | None = None) -> "UnlearnConfig":
        method = METHODS.get(values.get("method", cls.method))
        if method is not None and method.own_retain:  # its own retain term, unless the values set one
            values = {"retain_loss": method.own_retain[0], "retain_weight": method.own_retain[1], **values}
        own_keys = [f.name for f in fields(cls) if f.name != "hyperparameters"]
        unknown = sorted(set(values) - set(own_keys) - set(HYPERPARAMETERS))
        if unknown:
            keys = ", ".join((origins or {}).get(k, f"{where}.{k}") for k in unknown)
            raise ParamError(f"{keys}: unknown parameter{'s' if len(unknown) > 1 else ''} "
                             f"(known: {sorted(own_keys + list(HYPERPARAMETERS))})")
        hyper = {k: v for k, v in values.items() if k in HYPERPARAMETERS}
        cfg = dataclass_from_params(cls, {**{k: v for k, v in values.items() if k not in hyper},
                                          "hyperparameters": hyper}, where, origins)
        rules = {"method": one_of(sorted(METHODS)), "weighting": one_of(sorted(WEIGHTING)),
                 "r": between(0, 1, lo_open=True), "tau": positive(), "mix": between(0, 1), "alpha": between(0, 1),
                 "focus": one_of(list(FOCUS)),
                 "retain_loss": one_of(sorted(RETAIN_LOSSES)), "retain_weight": at_least(0),
                 "reduction": one_of(sorted(FORGET_REDUCTIONS)), "rmu_layer": at_least(1),
                 "retain_batch_size": at_least(0), "retain_reference": one_of(["cache", "model"]),
                 "chunk_size": at_least(1), "reference_top_k": at_least(1)}
        check_rules(cfg, rules, where, origins)
        check_hyperparameters(cfg.method, hyper, where, origins)
        parse_score(cfg.score, (origins or {}).get("score", f"{where}.score"))  # names what is wrong with it
        if cfg.weighting == "uniform" and "mix" in values:  # the key itself, even 0: it would mean nothing here
            key = (origins or {}).get("mix", f"{where}.mix")
            raise ParamError(f"{key}={values['mix']!r}: the uniform weighting spreads the push evenly already; mix "
                             f"is for the hard and soft weightings (unlearn.weightings.hard.mix / soft.mix)")
        if cfg.weighting == "uniform" and "focus" in values:
            key = (origins or {}).get("focus", f"{where}.focus")
            raise ParamError(f"{key}={values['focus']!r}: uniform weights select no stretch of the answer; focus is "
                             f"for the hard and soft weightings (unlearn.weightings.hard.focus / soft.focus)")
        if not METHODS[cfg.method].token_weights and cfg.weighting != "uniform":
            key = (origins or {}).get("weighting", f"{where}.weighting")
            raise ParamError(f"{key}={cfg.weighting!r}: {cfg.method} trains on each sample's "
                             f"{METHODS[cfg.method].alternative} answer alone, and token weights are defined on the "
                             f"forget answer's tokens (stage one scores those); use weighting: uniform")
        own = METHODS[cfg.method].own_retain
        if own and cfg.retain_loss != own[0]:
            key = (origins or {}).get("retain_loss", f"{where}.retain_loss")
            raise ParamError(f"{key}={cfg.retain_loss!r}: method {cfg.method} has its own retain term, "
                             f"{own[0]} (for GA with another retain term, use method: ga)")
        if cfg.reduction == "token" and cfg.sequence_level:
            key = (origins or {}).get("reduction", f"{where}.reduction")
            if not METHODS[cfg.method].token_weights:
                raise ParamError(f"{key}='token': {cfg.method} is a loss of whole sequences (each sample's mean "
                                 f"NLL of its {METHODS[cfg.method].alternative} answer), one value per sample, with "
                                 f"no token losses to pool; use reduction: sample")
            if METHODS[cfg.method].weighs_itself:
                raise ParamError(f"{key}='token': {cfg.method} is a loss of whole sequences under every weighting "
                                 f"(ω enters each sample's weighted mean), one value per sample, with no token "
                                 f"losses to pool; use reduction: sample")
            raise ParamError(f"{key}='token': {cfg.method} with uniform weights is its sequence-level loss, one value "
                             f"per sample, with no token losses to pool; use reduction: sample, or hard or soft "
                             f"weights (its token-level form)")
        return cfg

    @property
    def method_params(self):
        """The method's hyper-parameters (its module's `Params`): the values the run sets, its defaults else."""
        return method_params(self.method, self.hyperparameters)

    @property
    def sequence_level(self) -> bool:
        """Whether the forget loss is the method's loss of whole sequences (NPO with uniform weights, SimNPO with
        any)."""
        method = METHODS[self.method]
        return method.weighs_itself or (self.weighting == "uniform" and method.sequence_loss is not None)

    @property
    def weighting_spec(self) -> Weighting:
        return Weighting(self.weighting, self.r, self.tau, self.alpha, self.score, self.mix, self.focus)

    @property
    def hidden_layer(self) -> int:
        """The hidden_states index that a method's input `hidden` and a retain term that reads hidden states
        (`activation`) read: the param rmu_layer, named after RMU, the first method to read one."""
        return self.rmu_layer

    @property
    def retain(self) -> RetainLoss | None:
        """The retention term in use (`retain_loss`); None if off. A dual λ (PDU's) needs it even from λ = 0."""
        on = self.retain_weight > 0 or METHODS[self.method].dual is not None
        return RETAIN_LOSSES[self.retain_loss] if self.retain_loss != "none" and on else None


RUN_KEYS = ("model", "seeds", "train", "defaults", "weightings", "methods", "runs", "monitor")  # `unlearn`'s keys
OWN_RETAIN = "own retain term"  # the layer of a method's own retain term (GradDiff's), named in errors by the run


def _run_layers(params: dict, name: str) -> tuple[list[tuple[str, dict]], dict]:
    """The mappings run NAME's config is merged from, lowest first, each with the key it sits at: `unlearn.defaults`
    (every run), the method's own retain term (GradDiff), `unlearn.methods.METHOD` (its knobs: beta, gamma, ...),
    `unlearn.weightings.WEIGHTING` (r, tau, mix, focus, alpha, score), then the run's own keys. Split this way, DVC
    tracks for each run only the sections it reads: a change of tau reruns the soft runs alone. Also the run's
    `train:`."""
    check_keys(section(params, "unlearn"), RUN_KEYS, "unlearn")
    runs = section(params, "unlearn.runs")
    if not isinstance(runs, dict):
        raise ParamError("unlearn.runs: expected a mapping of run names, e.g. {npo: {method: npo}}")
    if name not in runs:
        raise ParamError(f"unlearn.runs: no run named '{name}' (have {sorted(runs)})")
    where = f"unlearn.runs.{name}"
    spec = runs[name]
    if not isinstance(spec, dict):
        raise ParamError(f"{where}: expected a mapping such as {{method: ga, weighting: hard}}")
    spec = dict(spec)
    train = spec.pop("train", None) or {}
    if not isinstance(train, dict):
        raise ParamError(f"{where}.train: expected a mapping such as {{lr: 1.0e-4}}")
    unlearn = params["unlearn"]
    defaults = _mapping(unlearn.get("defaults"), "unlearn.defaults")
    method = spec.get("method", defaults.get("method", UnlearnConfig.method))
    weighting = spec.get("weighting", defaults.get("weighting", UnlearnConfig.weighting))
    layers = [("unlearn.defaults", defaults)]
    own = METHODS[method].own_retain if method in METHODS else None
    if own:
        layers.append((OWN_RETAIN, {k: v for k, v in zip(("retain_loss", "retain_weight"), own) if k not in spec}))
    for group, key, known in (("methods", method, METHODS), ("weightings", weighting, WEIGHTING)):
        table = _mapping(unlearn.get(group), f"unlearn.{group}")
        unknown = sorted(set(table) - set(known))
        if unknown:
            raise ParamError(f"unlearn.{group}: unknown {group[:-1]}(s) {unknown} (known: {sorted(known)})")
        layers.append((f"unlearn.{group}.{key}", _mapping(table.get(key), f"unlearn.{group}.{key}")))
    layers.append((where, spec))
    return layers, train


def _mapping(value, where: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ParamError(f"{where}: expected a mapping, got {type(value).__name__}")
    return value


def run_spec(params: dict, name: str) -> dict:
    """Run NAME's flat config, as unlearning reads it (method, weighting, r, tau, alpha, score, beta, ...): what a
    report or `inspect --run` needs to know of a run, without checking it."""
    layers, _ = _run_layers(params, name)
    return {k: v for _, layer in layers for k, v in layer.items()}


def run_configs(params: dict, name: str) -> tuple[UnlearnConfig, TrainConfig]:
    """Run NAME of `unlearn.runs`: its method config (`_run_layers`), and its training config, which is
    `unlearn.train` with the run's own `train:` overrides (a tuned learning rate, say). A method with its own
    retain term (GradDiff: NLL, λ = 1) takes it unless the run itself sets `retain_loss` or `retain_weight`."""
    layers, overrides = _run_layers(params, name)
    where = f"unlearn.runs.{name}"
    origins: dict[str, str] = {}
    for at, layer in layers:
        origins |= {key: f"{where}.{key} (the method's own)" if at is OWN_RETAIN else f"{at}.{key}" for key in layer}
    cfg = UnlearnConfig.from_params(run_spec(params, name), where, origins)
    base = section(params, "unlearn.train")
    train_origins = origins_of(**{"unlearn.train": base, f"{where}.train": overrides})
    train = TrainConfig.from_params({**base, **overrides}, f"{where}.train", train_origins)
    return cfg, train


def params_used(cfg: UnlearnConfig) -> dict:
    """The method params a run's weights depend on: the weighting's own (no τ for hard or uniform weights), the
    forget loss's, and the retain term's. A change of any other param leaves the run's output byte-identical, so
    DVC does not re-evaluate it."""
    used = {"method": cfg.method, **cfg.weighting_spec.used(), "trust_remote_code": cfg.trust_remote_code}
    used.update(asdict(cfg.method_params))  # all its loss can read
    if "hidden" in METHODS[cfg.method].inputs:  # under the param's own name, as records have it
        used["rmu_layer"] = cfg.hidden_layer
    if cfg.reduction != "sample":  # named only where it is not the default: earlier records stay valid
        used["reduction"] = cfg.reduction
    if cfg.retain is not None:
        used.update({k: getattr(cfg, k) for k in ("retain_loss", "retain_weight", "retain_split", "retain_corpus",
                                                   "retain_batch_size")})
        if cfg.retain.reads_hidden:
            used["rmu_layer"] = cfg.hidden_layer
        if cfg.retain.needs_reference:
            used["retain_reference"] = cfg.retain_reference
    return used
