"""Stage two: unlearning on the DeepSpeed engine, from the attribution shards and retain data.

The forget set streams from the shards (`ForgetStream`), with token weights ω computed here from Δ and H, so
r, τ, mix and α are this stage's params and changing them never reruns attribution. Each method is a module of
`pipeline.training.methods` (its token loss, hyper-parameters and own retain term); this loop combines the method's
token losses with ω (`reduction`: per sample, or over the batch's tokens), and adds a retention term from
`RETAIN_LOSSES` (λ·KL(p_ref ‖ p_θ) on retain answers by default, NLL, or RMU's activation matching).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import re
import shutil
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Callable

import torch

from pipeline.attribution.reference import ReferenceCache
from pipeline.attribution.shards import read_manifest
from pipeline.attribution.variants import parse_score
from pipeline.attribution.weights import FOCUS, WEIGHTING
from pipeline.common.atomic import atomic_dir, write_json
from pipeline.common.distributed import init_distributed, is_main_process
from pipeline.common.errors import ParamError
from pipeline.common.modeling import check_vocab, decoder, lm_head_logits, load_model, load_tokenizer, write_model
from pipeline.common.params import (at_least, between, check_keys, check_rules, dataclass_from_params, one_of,
                                    origins_of, positive, section)
from pipeline.common.runs import COMPLETE_RECORD, SEED_RECORD, seed_dir
from pipeline.data.batching import StepSchedule, pad_batch
from pipeline.data.config import DataConfig, retain_samples
from pipeline.data.templates import EncodedSample
from pipeline.training.engine import (Engine, TrainConfig, deepspeed_config, fingerprint, prepare_model, to_device,
                                      train_loop, zero3_loading)
from pipeline.training.finetune import write_history
from pipeline.training.forget_stream import ForgetStream, Weighting, forget_batch, write_token_weights
from pipeline.training.lora import is_peft, reference_view, write_trained
from pipeline.training.losses import (FORGET_REDUCTIONS, by_chunks, forward_kl_from_logits, token_logp_from_logits,
                                      topk_kl_from_logits, without_first_scored)
from pipeline.training.methods import (HYPERPARAMETERS, METHODS, ForwardOut, Prepared, check_hyperparameters,
                                       method_params)

log = logging.getLogger(__name__)


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
    def retain(self) -> "RetainLoss | None":
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
        raise ParamError(f"unlearn.runs: expected a mapping of run names, e.g. {{npo: {{method: npo}}}}")
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


# ---- the forward pass: the decoder's hidden states, and the LM head only where a loss reads it --------------------
# No [batch, length, vocab] logits: the head runs at the scored positions, `chunk_size` at a time, each chunk's logits
# recomputed in the backward pass (pipeline.training.losses.by_chunks).

def _net(model):
    """The Hugging Face model inside a DeepSpeed engine: its decoder and head are called directly."""
    return getattr(model, "module", model)


def _forward(net, batch: dict, output_hidden_states: bool = False):
    return decoder(net)(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                        output_hidden_states=output_hidden_states)


def _head(net) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda hidden: lm_head_logits(net, hidden)


def next_token_values(fn: Callable, net, last_hidden: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor,
                      chunk_size: int, *at_token: torch.Tensor) -> torch.Tensor:
    """fn(logits predicting token i, ids[b, i], *(x[b, i] for x in at_token)) at the positions marked (i ≥ 1), 0
    elsewhere: [B, T]. `fn` maps [N, vocab] logits, [N] tokens (and the [N, ...] values of `at_token`, [B, T, ...]
    each) to [N]; it runs on `chunk_size` positions at a time."""
    positions = positions.clone()
    positions[:, 0] = False  # the first token has no prefix
    rows, cols = positions.nonzero(as_tuple=True)
    values = by_chunks(fn, _head(net), last_hidden[rows, cols - 1], ids[rows, cols],
                       *(x[rows, cols] for x in at_token), chunk=chunk_size)
    return torch.zeros(ids.shape, dtype=values.dtype, device=values.device).index_put((rows, cols), values)


def next_token_logp(net, last_hidden: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor,
                    chunk_size: int) -> torch.Tensor:
    """log p_θ(ids[b, i] | s_<i) at the positions marked (i ≥ 1), 0 elsewhere: [B, T]."""
    return next_token_values(token_logp_from_logits, net, last_hidden, ids, positions, chunk_size)


def _predicting(batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, positions) p whose next token p + 1 is labelled: where the retain terms compare distributions."""
    return (batch["labels"][:, 1:] != -100).nonzero(as_tuple=True)


# ---- retention terms on retain data, from a registry -------------------------------------------------------
# θ_o comes from the reference cache (`batch["ref"]`, written by `tokenunlearn reference`) or, with
# `retain_reference: model`, from the frozen model itself (`reference`): a loaded copy, or, for a model with LoRA
# adapters, the trained model with its adapters switched off (ADAPTERS_OFF: no second copy).

ADAPTERS_OFF = "adapters switched off"


@contextlib.contextmanager
def theta_o(net, reference):
    """θ_o for the exact retain terms: the trained model's base with its adapters off, or the reference model."""
    if reference == ADAPTERS_OFF:
        with reference_view(net) as base:
            yield base
    elif reference is None:
        raise ParamError("a retain term that reads θ_o needs the reference cache or retain_reference: model")
    else:
        yield _net(reference)


def _retain_kl(net, reference, batch: dict, cfg: UnlearnConfig) -> torch.Tensor:
    """KL(p_θo ‖ p_θ) summed over each sample's answer positions, averaged over samples."""
    hidden, ref = _forward(net, batch).last_hidden_state, batch.get("ref")
    if ref is not None:  # θ_o's top-k and tail bucket: pipeline.training.losses.topk_kl_from_logits
        kl = by_chunks(topk_kl_from_logits, _head(net), hidden[ref["rows"], ref["cols"]], ref["topk_ids"],
                       ref["topk_logp"], ref["tail_logp"], chunk=cfg.chunk_size)
    else:  # the exact KL; θ_o's logits at the answer positions are kept (no gradient): the measuring option
        rows, cols = _predicting(batch)
        with torch.no_grad(), theta_o(net, reference) as ref_net:
            ref_logits = lm_head_logits(ref_net, _forward(ref_net, batch).last_hidden_state[rows, cols])
        kl = by_chunks(lambda logits, ref: forward_kl_from_logits(ref, logits), _head(net), hidden[rows, cols],
                       ref_logits, chunk=cfg.chunk_size)
    return kl.sum() / batch["input_ids"].size(0)


def _retain_nll(net, reference, batch: dict, cfg: UnlearnConfig) -> torch.Tensor:
    """The mean NLL of the retain answer tokens (GradDiff's term)."""
    rows, cols = _predicting(batch)
    logp = by_chunks(token_logp_from_logits, _head(net), _forward(net, batch).last_hidden_state[rows, cols],
                     batch["input_ids"][rows, cols + 1], chunk=cfg.chunk_size)
    return -logp.mean()


def _retain_activation(net, reference, batch: dict, cfg: UnlearnConfig) -> torch.Tensor:
    """RMU's retain loss: ‖h_θ − h_θo‖² at rmu_layer (mean over hidden dimensions and answer positions)."""
    hidden, ref = _forward(net, batch, output_hidden_states=True).hidden_states[cfg.rmu_layer], batch.get("ref")
    if ref is not None:
        rows, cols, ref_hidden = ref["rows"], ref["cols"], ref["act"]
    else:
        rows, cols = _predicting(batch)
        with torch.no_grad(), theta_o(net, reference) as ref_net:
            ref_hidden = _forward(ref_net, batch, output_hidden_states=True).hidden_states[cfg.rmu_layer][rows, cols]
    if rows.numel() == 0:
        return hidden.sum() * 0.0
    return (hidden[rows, cols].float() - ref_hidden.float()).pow(2).mean(-1).mean()


@dataclass(frozen=True)
class RetainLoss:
    loss: Callable[..., torch.Tensor]
    needs_reference: bool = False


RETAIN_LOSSES: dict[str, RetainLoss | None] = {
    "kl": RetainLoss(_retain_kl, needs_reference=True),
    "nll": RetainLoss(_retain_nll),
    "activation": RetainLoss(_retain_activation, needs_reference=True),  # RMU's original retain loss
    "none": None,
}


# ---- evaluation during training ----------------------------------------------------------------------------------
# The monitor is stage three's (pipeline.evaluation.monitor, handed in by the stage: training does not import
# evaluation). It gives `every`, `selects`, `evaluate(model, step) -> row` and `keep(row) -> bool`.

# A monitor factory: called with the tokenizer, a new monitor for one seed; its `selection` is what a selection rule
# makes the written weights depend on (None without a rule), part of each seed's fingerprint.
MonitorFactory = Callable[[object], object]
EVAL_PREFIX = "eval_"  # a monitor row's metrics, in the history rows of the steps it evaluated


class Watch:
    """One seed's monitor in the training loop: step 0 (θ_o) before the first step, then every `every` steps and
    after the last; the weights of the step its rule keeps, copied to CPU memory."""

    def __init__(self, monitor, engine: Engine, total_steps: int, train: TrainConfig):
        if monitor.selects and train.checkpoint_every:
            raise ParamError("unlearn.monitor.select: the kept weights are held in memory, so a run resumed from a "
                             "checkpoint could not restore them; set the run's train.checkpoint_every to 0")
        self.monitor, self.engine, self.total_steps = monitor, engine, total_steps
        self.selected: tuple[int, dict] | None = None  # (step, state dict) the rule keeps
        self.first = self._evaluate(0)  # the weights before any step (also when a checkpoint is resumed)

    def _evaluate(self, step: int) -> dict:
        row = self.monitor.evaluate(_net(self.engine.engine), step)
        if self.monitor.keep(row):
            state = self.engine.full_state_dict()
            self.selected = (step, {k: v.detach().cpu().clone() for k, v in state.items()} if state else None)
        return row

    def on_step(self, step: int, row: dict | None = None) -> dict | None:
        if step % self.monitor.every and step != self.total_steps:
            return None
        return {k: v for k, v in self._evaluate(step).items() if k != "step"}

    def rows(self, history: list[dict]) -> list[dict]:
        """The monitor's rows, step 0 first: what the DVC plot shows."""
        later = [{"step": r["step"], **{k: v for k, v in r.items() if k.startswith(EVAL_PREFIX)}}
                 for r in history if any(k.startswith(EVAL_PREFIX) for k in r)]
        return [self.first] + later


# ---- the run ------------------------------------------------------------------------------------------------

def tokens_read(cfg: UnlearnConfig) -> Callable[[dict], int]:
    """The tokens of a micro-batch {forget, retain} that the run's loss reads, for the loss curve's tokens/s: the
    forget answers (all but IdkNLL's), their alternative answers (IdkDPO, AltPO, IdkNLL) and the retain batch where
    there is a retain term (none for GA: its retain batch is built, never read)."""
    method = METHODS[cfg.method]

    def count(batch: dict) -> int:
        parts = [batch["forget"]] if method.reads_forget_answer else []
        parts += [batch["forget"]["alternative"]] if method.alternative else []
        parts += [batch["retain"]] if cfg.retain is not None else []
        return sum(int(part["attention_mask"].sum()) for part in parts)

    return count


def make_loss_fn(cfg: UnlearnConfig, reference, retain_weight: Callable[[], float] | None = None) -> Callable:
    """The step's loss: the method's forget loss plus λ times the retain term. `reference`: θ_o for a retain term
    computed from the model itself (`retain_reference: model`), else None (the cache rides in the retain batch).
    `retain_weight`: λ at this step, where it changes during training (PDU's dual variable); else the run's."""
    method, params, retain = METHODS[cfg.method], cfg.method_params, cfg.retain
    reduce = FORGET_REDUCTIONS[cfg.reduction]

    def forget_loss(out: ForwardOut, f: dict) -> torch.Tensor:
        if cfg.sequence_level:
            return method.sequence_loss(out, f, params)
        return reduce(method.token_loss(out, f, params), f["weights"])

    def loss_fn(model, batch: dict) -> tuple[torch.Tensor, dict[str, float]]:
        net, f = _net(model), batch["forget"]
        if method.skip_first:  # CE-U leaves each answer's first token out: no loss, no weight
            f = without_first_scored(f, method.skip_first)
        logp = hidden = from_logits = alternative_logp = None
        if method.reads_forget_answer:
            out = _forward(net, f, output_hidden_states=method.needs_hidden)
            scored = f["scored"] > 0
            logp = next_token_logp(net, out.last_hidden_state, f["input_ids"], scored, cfg.chunk_size) \
                if method.needs_logp else None
            hidden = out.hidden_states[cfg.rmu_layer] if method.needs_hidden else None
            teacher = [f[k] for k in ("teacher_ids", "teacher_logp", "teacher_tail", "ref_logp")] \
                if method.teacher else []  # θ_o at each token, stage one's (UNDIAL)
            from_logits = next_token_values(functools.partial(method.from_logits, params=params), net,
                                            out.last_hidden_state, f["input_ids"], scored, cfg.chunk_size,
                                            *teacher) if method.from_logits else None
        if method.alternative:  # the answer it prefers (or trains on), stage one's
            alt = f["alternative"]
            alternative_logp = next_token_logp(net, _forward(net, alt).last_hidden_state, alt["input_ids"],
                                               alt["scored"] > 0, cfg.chunk_size)
        forget = forget_loss(ForwardOut(logp, hidden, from_logits, alternative_logp), f)
        loss, metrics = forget, {"forget_loss": forget.item()}
        if retain is not None:
            retain_value = retain.loss(net, reference, batch["retain"], cfg)
            loss = loss + (retain_weight() if retain_weight else cfg.retain_weight) * retain_value
            metrics["retain_loss"] = retain_value.item()
        return loss, metrics

    return loss_fn


@torch.no_grad()
def retain_nll_at_start(engine: Engine, retain: list[EncodedSample], indices: list[int], micro_batch_size: int,
                        pad_id: int, chunk_size: int) -> float:
    """The model's mean NLL per retain answer token over `indices` (before the first step: θ_o's), the same on
    every process: each runs every index, in the same order."""
    net, total, count = _net(engine.engine), 0.0, 0
    training = net.training
    net.eval()  # no dropout: the measure draws none of training's random numbers
    for start in range(0, len(indices), micro_batch_size):
        batch = to_device(pad_batch([retain[i] for i in indices[start:start + micro_batch_size]], pad_id),
                          engine.device)
        rows, cols = _predicting(batch)
        logp = by_chunks(token_logp_from_logits, _head(net), _forward(net, batch).last_hidden_state[rows, cols],
                         batch["input_ids"][rows, cols + 1], chunk=chunk_size)
        total, count = total - logp.double().sum().item(), count + logp.numel()
    net.train(training)
    return total / max(count, 1)


def prepare_reference(model_path: str, ds_config: dict, device, trust_remote_code: bool):
    """The frozen θ_o for the KL term, in the engine's precision (an fp32 reference beside a bf16 model would make
    its forward pass the slowest part of a GPU step). Under ZeRO-3 it is held once, partitioned, in an inference
    engine."""
    dtype = torch.bfloat16 if ds_config["bf16"]["enabled"] else None
    ref = load_model(model_path, dtype=dtype, trust_remote_code=trust_remote_code).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    if ds_config["zero_optimization"]["stage"] == 3:
        import deepspeed

        config = {k: v for k, v in ds_config.items() if k not in ("optimizer", "gradient_clipping")}
        engine = deepspeed.initialize(model=ref, config=config)[0]
        engine.eval()
        return engine
    return ref.to(device)


def load_retain(cfg: UnlearnConfig, data: DataConfig, tokenizer, forget_split: str) -> list[EncodedSample]:
    """The retain samples: question-answer rows of `retain_split`, or the passages of `retain_corpus` that are not
    the forget split's."""
    return retain_samples(data, tokenizer, cfg.retain_split, cfg.retain_corpus, forget_split)


def params_used(cfg: UnlearnConfig) -> dict:
    """The method params a run's weights depend on: the weighting's own (no τ for hard or uniform weights), the
    forget loss's, and the retain term's. A change of any other param leaves the run's output byte-identical, so
    DVC does not re-evaluate it."""
    used = {"method": cfg.method, **cfg.weighting_spec.used(), "trust_remote_code": cfg.trust_remote_code}
    used.update(asdict(cfg.method_params))  # all its loss can read
    if METHODS[cfg.method].needs_hidden:
        used["rmu_layer"] = cfg.rmu_layer
    if cfg.reduction != "sample":  # named only where it is not the default: earlier records stay valid
        used["reduction"] = cfg.reduction
    if cfg.retain is not None:
        used.update({k: getattr(cfg, k) for k in ("retain_loss", "retain_weight", "retain_split", "retain_corpus",
                                                   "retain_batch_size")})
        if cfg.retain_loss == "activation":
            used["rmu_layer"] = cfg.rmu_layer
        if cfg.retain.needs_reference:
            used["retain_reference"] = cfg.retain_reference
    return used


def seed_fingerprint(name: str, cfg: UnlearnConfig, train: TrainConfig, model_path: str, manifest: dict,
                     reference_dir: Path | None = None, selection: dict | None = None) -> str:
    """What one seed's model depends on: the params it uses, the model, the forget shards and the reference cache it
    reads, and a monitor's selection rule (not the number of processes, which gives the same weights)."""
    cache = None
    if cfg.retain is not None and cfg.retain.needs_reference and cfg.retain_reference == "cache":
        cache = read_manifest(reference_dir)["shards"] if reference_dir is not None else cfg.reference_top_k
    return fingerprint({"name": name, "params": params_used(cfg), "train": asdict(train), "model": model_path,
                        "shards": manifest["shards"], "source": manifest["metadata"].get("model_hash"),
                        **({"reference": cache} if cache is not None else {}),
                        **({"selection": selection} if selection else {})})


def retain_reference(cfg: UnlearnConfig, retain: list, engine, forget: ForgetStream, model_path: str,
                     reference_dir: Path | None, used: list[int], pad_id: int):
    """θ_o for the retain term, as (reference model, cache), before the first step: nothing (no term, or one without
    θ_o), the cache of `reference_dir` (`tokenunlearn reference`), the run's own cache of the retain samples it
    will use (built from the model before it is trained, when no directory is given), or θ_o itself
    (`retain_reference: model`)."""
    if cfg.retain is None or not cfg.retain.needs_reference:
        return None, None
    layers = [cfg.rmu_layer] if cfg.retain_loss == "activation" else []
    if cfg.retain_reference == "model":
        if is_peft(engine.module):  # θ_o is the base under the adapters: nothing to load
            return ADAPTERS_OFF, None
        return prepare_reference(model_path, engine.ds_config, engine.device, cfg.trust_remote_code), None
    if reference_dir is None:
        return None, ReferenceCache.build(_net(engine.engine), retain, used, pad_id, cfg.reference_top_k, layers,
                                          cfg.retain_batch_size or engine.cfg.micro_batch_size, cfg.chunk_size)
    cache = ReferenceCache.load(reference_dir)
    cache.check(retain, cfg.retain_corpus or cfg.retain_split, forget.manifest["metadata"].get("model_hash"),
                layers[0] if layers else None, _net(engine.engine).get_input_embeddings().num_embeddings)
    return None, cache


def run_unlearn_seeds(name: str, cfg: UnlearnConfig, train: TrainConfig, data: DataConfig, model_path: str,
                      shard_dir: Path, out_dir: Path, ckpt_dir: Path, plots_dir: Path, seeds: list[int],
                      resume: bool, reference_dir: Path | None = None, monitor: "MonitorFactory | None" = None,
                      monitor_dir: Path | None = None, whole_set: bool = False) -> list[dict]:
    """Run NAME once per seed into `out_dir/seed{S}/`, then write `out_dir/complete.json` last: a killed run
    has no record, so evaluation refuses it. With `resume`, a seed already finished with the same params is
    skipped (and a seed killed midway continues from its checkpoint). `monitor`: makes each seed's evaluation
    during training (`Monitor`), whose rows go to `monitor_dir/seed{S}.csv`. `whole_set`: `seeds` are all the
    run's seeds (`unlearn.seeds`), so any other seed an earlier call left in the outputs is removed, and they hold
    what a fresh run writes (a DVC stage keeps its outputs between runs, `persist`, for the finished seeds);
    otherwise (`--seed 1` after `--seed 0`) the earlier seeds of the same params stay."""
    seeds = check_seeds(seeds)
    init_distributed()
    manifest = read_manifest(shard_dir)
    earlier = {} if whole_set else \
        _earlier_seeds(name, cfg, train, model_path, manifest, reference_dir, monitor, out_dir, seeds)
    if is_main_process():
        (out_dir / COMPLETE_RECORD).unlink(missing_ok=True)  # incomplete until every seed is done
    summaries, fingerprints = [], {}
    selection = monitor.selection if monitor is not None else None
    for seed in seeds:
        seed_train = replace(train, seed=seed)
        fingerprints[str(seed)] = seed_fingerprint(name, cfg, seed_train, model_path, manifest, reference_dir,
                                                   selection)
        record = seed_dir(out_dir, seed) / SEED_RECORD
        curves = [plots_dir / f"seed{seed}.csv"] + ([monitor_dir / f"seed{seed}.csv"] if monitor_dir else [])
        if resume and record.is_file() and json.loads(record.read_text()).get("fingerprint") == \
                fingerprints[str(seed)] and all(c.is_file() for c in curves):
            log.info("unlearn %s seed %d: already finished with these params (%s), skipped", name, seed, record)
            summaries.append({"name": name, "seed": seed, "skipped": True})
            continue
        summaries.append(run_unlearn(name, cfg, seed_train, data, model_path, shard_dir, seed_dir(out_dir, seed),
                                     ckpt_dir / f"seed{seed}", plots_dir / f"seed{seed}.csv", resume, reference_dir,
                                     monitor, monitor_dir / f"seed{seed}.csv" if monitor_dir else None, selection))
    if is_main_process():
        fingerprints = {**earlier, **fingerprints}
        _remove_other_seeds(fingerprints, [out_dir, plots_dir, *([monitor_dir] if monitor_dir else [])])
        write_json(out_dir / COMPLETE_RECORD, {"run": name, "seeds": sorted(int(s) for s in fingerprints),
                                               "fingerprints": fingerprints})
    return summaries


def _remove_other_seeds(kept: dict[str, str], dirs: list[Path]) -> None:
    """Remove the seed directories (`seed{S}/`) and curves (`seed{S}.csv`, `seed{S}.timing.csv`) of seeds not in
    `kept` from `dirs`."""
    for directory in dirs:
        for path in directory.glob("seed*") if directory.is_dir() else ():
            seed = re.fullmatch(r"seed(\d+)(\..*)?", path.name)
            if seed and seed.group(1) not in kept:
                log.info("removing %s: seed %s is not one of this run's", path, seed.group(1))
                shutil.rmtree(path) if path.is_dir() else path.unlink()


def check_seeds(seeds) -> list[int]:
    """`unlearn.seeds` (or --seed): a non-empty list of distinct integers."""
    ok = isinstance(seeds, (list, tuple)) and seeds and len(set(seeds)) == len(seeds) and \
        all(isinstance(s, int) and not isinstance(s, bool) for s in seeds)
    if not ok:
        raise ParamError(f"unlearn.seeds={seeds!r}: expected a non-empty list of distinct integers, e.g. [0, 1, 2]")
    return list(seeds)


def _recorded_fingerprint(record: Path) -> str | None:
    try:
        return json.loads(record.read_text()).get("fingerprint")
    except (OSError, ValueError, AttributeError):
        return None


def _earlier_seeds(name, cfg, train, model_path, manifest, reference_dir, monitor, out_dir: Path,
                   seeds: list[int]) -> dict[str, str]:
    """The seeds an earlier call wrote into `out_dir` (`--seed 0`, then `--seed 1`) that are still there and were
    made with these same params: they stay in complete.json beside the new ones. Seeds of other params are left
    out, with a warning, so evaluation never mixes two configurations."""
    record = out_dir / COMPLETE_RECORD
    try:
        listed = json.loads(record.read_text()).get("fingerprints", {}) if record.is_file() else {}
    except (ValueError, AttributeError):
        listed = {}
    kept, dropped = {}, []
    selection = monitor.selection if monitor is not None else None
    for key, recorded in (listed.items() if isinstance(listed, dict) else ()):
        if not str(key).isdigit() or int(key) in seeds:
            continue
        seed = int(key)
        now = seed_fingerprint(name, cfg, replace(train, seed=seed), model_path, manifest, reference_dir, selection)
        if recorded == now == _recorded_fingerprint(seed_dir(out_dir, seed) / SEED_RECORD):
            kept[str(seed)] = recorded
        else:
            dropped.append(seed)
    if dropped:
        log.warning("unlearn %s: seeds %s in %s were made with other params (or are gone): left out of %s",
                    name, dropped, out_dir, COMPLETE_RECORD)
    return kept


def run_unlearn(name: str, cfg: UnlearnConfig, train: TrainConfig, data: DataConfig, model_path: str,
                shard_dir: Path, out_dir: Path, ckpt_dir: Path, plot_file: Path, resume: bool,
                reference_dir: Path | None = None, monitor: "MonitorFactory | None" = None,
                monitor_file: Path | None = None, selection: dict | None = None) -> dict:
    """Unlearn and write `out_dir/model` (safetensors), `out_dir/token_weights.parquet` (the weights used) and
    the per-step total, forget and retain losses to `plot_file` (a DVC plot). `reference_dir`: the reference cache
    of the retain data (`tokenunlearn reference`), for a retain term that reads θ_o. `monitor`: an evaluation
    every few steps into `monitor_file`; with a selection rule, the weights written are those of the step it
    chooses."""
    rank, world_size = init_distributed()
    tokenizer = load_tokenizer(model_path, cfg.trust_remote_code)
    forget = ForgetStream(shard_dir, cfg.weighting_spec, seed=train.seed, alternative=METHODS[cfg.method].alternative,
                          method=cfg.method, teacher=METHODS[cfg.method].teacher)
    retain = load_retain(cfg, data, tokenizer, forget.manifest["metadata"].get("split", ""))
    schedule = StepSchedule(len(forget), train.micro_batch_size, train.grad_accum, world_size, train.seed,
                            order=forget.epoch_order)
    # Retain micro-batches follow their own schedule, paired with the forget micro-batches by position in
    # the global batch, so N processes see what one process with N-fold accumulation sees.
    retain_schedule = StepSchedule(len(retain), cfg.retain_batch_size or train.micro_batch_size, train.grad_accum,
                                   world_size, train.seed + 1)
    total_steps = train.total_steps(schedule.steps_per_epoch)
    ds_config = deepspeed_config(train, world_size, total_steps)
    keep_alive = zero3_loading(ds_config)  # noqa: F841
    model = load_model(model_path, trust_remote_code=cfg.trust_remote_code)
    check_vocab(model, tokenizer, model_path, data.max_length)
    forget.check_source(model, model_path, tokenizer)
    model = prepare_model(model, train, f"unlearn.runs.{name}.train")  # checkpointing, LoRA adapters (train.lora)
    method = METHODS[cfg.method]  # RMU trains a few layers and steers towards its control vector
    prepared = method.prepare(model, cfg.method_params, cfg.rmu_layer, train.seed) if method.prepare else Prepared()
    engine = Engine(model, train, total_steps, parameters=prepared.parameters)
    used = sorted({i for step in range(total_steps) for mb in retain_schedule.micro_batches(step, rank) for i in mb})
    reference, cache = retain_reference(cfg, retain, engine, forget, model_path, reference_dir, used,
                                        tokenizer.pad_token_id)
    layer = cfg.rmu_layer if cfg.retain_loss == "activation" else None
    log.info("unlearn %s: %s/%s, %d forget samples in %d shards, %d retain samples, %d steps", name, cfg.method,
             cfg.weighting, len(forget), len(forget.files), len(retain), total_steps)

    def batches_for_step(step: int) -> list[dict]:
        out = []
        for f_idx, r_idx in zip(schedule.micro_batches(step, rank), retain_schedule.micro_batches(step, rank)):
            batch = {"forget": {**forget_batch(forget.get(f_idx), tokenizer.pad_token_id), **prepared.forget_extras},
                     "retain": pad_batch([retain[i] for i in r_idx], tokenizer.pad_token_id)}
            if cache is not None:
                batch["retain"]["ref"] = cache.batch(r_idx, layer)
            out.append(batch)
        return out

    run_id = seed_fingerprint(name, cfg, train, model_path, forget.manifest, reference_dir, selection)
    watch = Watch(monitor(tokenizer), engine, total_steps, train) if monitor is not None else None
    dual = None
    if method.dual is not None:  # PDU: λ is a dual variable, θ_o's retain loss measured on every retain sample used
        every_rank = sorted({i for step in range(total_steps) for r in range(world_size)
                             for mb in retain_schedule.micro_batches(step, r) for i in mb})
        dual = method.dual(cfg.method_params, cfg.retain_weight, schedule.steps_per_epoch, functools.partial(
            retain_nll_at_start, engine, retain, every_rank, cfg.retain_batch_size or train.micro_batch_size,
            tokenizer.pad_token_id, cfg.chunk_size))
    hooks = [h for h in (dual and dual.after_step, watch and watch.on_step) if h]

    def on_step(done: int, row: dict) -> dict:
        return {k: v for hook in hooks for k, v in (hook(done, row) or {}).items()}

    # A checkpoint is partitioned by process: it is resumed only by the same number of processes.
    history = train_loop(engine, batches_for_step, make_loss_fn(cfg, reference, dual and (lambda: dual.value)),
                         ckpt_dir, fingerprint({"run": run_id, "world_size": world_size}), resume,
                         desc=f"unlearn {name}", on_step=on_step if hooks else None,
                         on_resume=dual.restore if dual is not None else None, tokens_of=tokens_read(cfg))

    def write(state_dict: dict | None) -> None:
        chosen = watch.selected if watch is not None else None
        with atomic_dir(out_dir) as tmp:
            write_trained(engine.module, tokenizer, tmp / "model", chosen[1] if chosen else state_dict,
                          train.lora_spec, base=model_path, write=write_model)
            write_token_weights(forget, tmp / "token_weights.parquet")
            write_json(tmp / SEED_RECORD, {"run": name, "seed": train.seed, "fingerprint": run_id,
                                           **({"selected_step": chosen[0]} if chosen else {})})
        write_history([{k: v for k, v in row.items() if not k.startswith(EVAL_PREFIX)} for row in history],
                      plot_file)
        if watch is not None and monitor_file is not None:
            write_history(watch.rows(history), monitor_file)

    engine.finish(write, ckpt_dir)
    return {"name": name, "method": cfg.method, "weighting": cfg.weighting, "steps": total_steps,
            "final": history[-1] if history else None}
