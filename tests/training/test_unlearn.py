"""Stage two on the micro world: weights from φ, every method, RMU's frozen layers, shard checks, resume."""

import math

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from pipeline.common.errors import DataError, ParamError
from pipeline.data.config import DataConfig
from pipeline.training.engine import TrainConfig
from pipeline.training.forget_stream import ForgetStream
from pipeline.training.methods import METHODS
from pipeline.training.run_config import UnlearnConfig, run_configs, run_spec
from pipeline.training.unlearn import load_retain, run_unlearn

from tests.conftest import ATTRIBUTION, killed_at_step, load_weights, shards_for

TRAIN = {"epochs": 2, "lr": 1e-3, "micro_batch_size": 2, "warmup_ratio": 0.0, "seed": 0}


def _run(tmp_path, model_dir, shards, world_dir, tag, resume=False, **cfg):
    cfg = UnlearnConfig.from_params({"rmu_layer": 2, **cfg}, "u")
    out = tmp_path / tag
    run_unlearn(tag, cfg, TrainConfig.from_params(TRAIN, "t"), DataConfig(source=str(world_dir)), str(model_dir),
                shards, out, tmp_path / f"ckpt-{tag}", tmp_path / f"{tag}.csv", resume)
    return out


@pytest.mark.parametrize("weighting", ["uniform", "hard", "soft"])
def test_weights_come_from_phi(attribution_dir, weighting):
    cfg = UnlearnConfig(weighting=weighting, r=0.2, tau=0.5)
    for s in ForgetStream(attribution_dir[0] / "shards", cfg.weighting_spec):
        w, n = s.weights[s.scored], s.scored.sum()
        assert (s.weights[~s.scored] == 0).all()
        if weighting == "uniform":
            assert (w == 1).all()
        elif weighting == "hard":
            assert sorted(set(w)) <= [0.0, 1.0] and w.sum() == max(1, math.ceil(0.2 * n))
            assert s.phi[s.scored][w == 1].min() >= s.phi[s.scored][w == 0].max(initial=-1)
        else:
            assert w.sum() == pytest.approx(1.0) and np.argmax(w) == np.argmax(s.phi[s.scored])


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_trains_and_writes_model_weights_and_curve(micro_model_dir, micro_world_dir, tmp_path, method,
                                                                 request):
    weighting = "hard" if METHODS[method].token_weights else "uniform"  # IdkNLL: no token weights
    out = _run(tmp_path, micro_model_dir, shards_for(method, request), micro_world_dir, method, method=method,
               weighting=weighting)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out / "model", use_safetensors=True)
    weights = pq.read_table(out / "token_weights.parquet").to_pylist()
    assert weights and all(sum(row["weight"]) >= 1 for row in weights)
    curve = (tmp_path / f"{method}.csv").read_text().splitlines()
    assert curve[0].startswith("step,forget_loss") and len(curve) > 2
    before, after = load_weights(micro_model_dir), load_weights(out / "model")
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed
    if method == "rmu":  # only layers 0 and 1 (below rmu_layer 2) are trained
        assert all(k.startswith(("model.layers.0.", "model.layers.1.")) for k in changed), sorted(changed)


@pytest.mark.parametrize("method, weighting",
                         [(m, w) for m in ("simnpo", "satimp", "ceu", "undial") for w in ("uniform", "soft")])
def test_the_later_methods_train_with_uniform_and_soft_weights(micro_model_dir, micro_world_dir, tmp_path, method,
                                                               weighting, request):
    # hard weights: test_every_method_trains_and_writes_model_weights_and_curve
    out = _run(tmp_path, micro_model_dir, shards_for(method, request), micro_world_dir, method, method=method,
               weighting=weighting, retain_loss="none")
    rows = (tmp_path / f"{method}.csv").read_text().splitlines()
    header, first = rows[0].split(","), dict(zip(rows[0].split(","), rows[1].split(",")))
    assert "forget_loss" in header and math.isfinite(float(first["forget_loss"])) and len(rows) > 2
    before, after = load_weights(micro_model_dir), load_weights(out / "model")
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_the_token_reduction_trains_and_moves_the_weights(attribution_dir, micro_model_dir, micro_world_dir,
                                                          tmp_path):
    # Hard weights select ⌈r·n⌉ tokens of each sample: pooled over the batch's tokens, a longer answer weighs more
    # than in the per-sample mean, so the two reductions train different weights.
    shards = attribution_dir[0] / "shards"
    trained = {reduction: load_weights(_run(tmp_path, micro_model_dir, shards, micro_world_dir, reduction,
                                            method="ga", weighting="hard", reduction=reduction) / "model")
               for reduction in ("sample", "token")}
    curve = (tmp_path / "token.csv").read_text().splitlines()
    assert curve[0].startswith("step,forget_loss") and len(curve) > 2
    assert any(not torch.equal(trained["sample"][k], trained["token"][k]) for k in trained["sample"])


def test_shards_of_another_model_are_refused(attribution_dir, micro_tokenizer, micro_world_dir, tmp_path):
    from pipeline.common.modeling import build_model, save_model

    from tests.conftest import TINY_MODEL

    save_model(build_model(TINY_MODEL, micro_tokenizer, seed=1), micro_tokenizer, tmp_path / "other")
    with pytest.raises(DataError, match="shards were made with model_hash="):
        _run(tmp_path, tmp_path / "other", attribution_dir[0] / "shards", micro_world_dir, "x", method="npo")
    assert not (tmp_path / "x").exists()


def test_undial_refuses_shards_without_the_teacher_naming_the_directory_and_the_param(attribution_dir,
                                                                                       micro_model_dir,
                                                                                       micro_world_dir, tmp_path):
    shards = attribution_dir[0] / "shards"
    with pytest.raises(ParamError, match=rf"^{shards}: method undial distils from θ_o's next-token distribution .*"
                                         r"set attribution.teacher_top_k \(e.g. attribution.teacher_top_k: 32\) "
                                         r"and rerun `attribute`$"):
        _run(tmp_path, micro_model_dir, shards, micro_world_dir, "undial", method="undial")
    assert not (tmp_path / "undial").exists()


def test_unknown_method_is_an_error():
    with pytest.raises(ParamError, match=r"u.method='dpo': must be one of \['altpo', 'ceu', 'ga', "):
        UnlearnConfig.from_params({"method": "dpo"}, "u")


def test_every_method_module_declares_what_the_loop_needs():
    from dataclasses import fields, is_dataclass

    from pipeline.common.params import check_rules
    from pipeline.training.methods import MODULES, ForwardOut, Method
    from pipeline.training.retain_terms import RETAIN_LOSSES

    assert sorted(METHODS) == ["altpo", "ceu", "ga", "graddiff", "idkdpo", "idknll", "npo", "pdu", "rmu", "satimp",
                               "simnpo", "undial", "wga"]
    config_keys = {f.name for f in fields(UnlearnConfig)}
    g = torch.Generator().manual_seed(0)
    batch = {"weights": torch.rand(2, 5, generator=g), "scored": torch.ones(2, 5),
             "ref_logp": -torch.rand(2, 5, generator=g), "control": torch.rand(4, generator=g),
             "alternative": {"scored": torch.ones(2, 3), "ref_logp": -torch.rand(2, generator=g)}}
    out = ForwardOut(-torch.rand(2, 5, generator=g), torch.rand(2, 5, 4, generator=g), torch.rand(2, 5, generator=g),
                     -torch.rand(2, 3, generator=g))
    for module in MODULES:
        method = module.METHOD
        assert isinstance(method, Method) and METHODS[method.name] is method
        assert module.__name__.endswith(f".{method.name}")  # method NAME lives in methods/NAME.py
        # it reads something of the forward pass: of the forget answer, or of its alternative answer
        assert method.reads_forget_answer or method.alternative, method.name
        assert method.token_weights or method.token_loss is None, method.name  # no ω: no token losses to pool
        assert is_dataclass(method.params) and method.params.__dataclass_params__.frozen, method.name
        check_rules(method.params(), method.rules, method.name)  # every knob has a default its rule accepts
        assert set(method.rules) <= set(method.hyperparameters), method.name
        assert not set(method.hyperparameters) & config_keys, method.name  # a key means one thing
        assert method.own_retain is None or method.own_retain[0] in RETAIN_LOSSES
        if method.token_loss is not None:
            assert method.token_loss(out, batch, method.params()).shape == (2, 5), method.name  # ℓ per token
        if method.sequence_loss is not None:
            assert method.sequence_loss(out, batch, method.params()).dim() == 0, method.name  # one scalar
    # what the three later methods read: SimNPO log p and ω (no θ_o, no token-level form), SatImp log p,
    # CE-U the whole next-token distribution, without each answer's first token
    simnpo, satimp, ceu = METHODS["simnpo"], METHODS["satimp"], METHODS["ceu"]
    assert simnpo.needs_logp and simnpo.weighs_itself and simnpo.hyperparameters == ("beta", "delta")
    assert (simnpo.params().beta, simnpo.params().delta) == (4.5, 0.0)  # open-unlearning's
    assert satimp.needs_logp and not satimp.weighs_itself and (satimp.params().beta1, satimp.params().beta2) == (5, 1)
    assert not ceu.needs_logp and ceu.from_logits is not None and ceu.skip_first == 1 and not ceu.hyperparameters
    assert all(m.own_retain is None for m in (simnpo, satimp, ceu))  # the run's retain term, as NPO's and WGA's
    # the methods of the paper and the log-probability ones read no distribution and skip no token (a new method
    # declares its own: the list stays open)
    assert all(METHODS[n].skip_first == 0 and METHODS[n].from_logits is None
               for n in ("ga", "wga", "npo", "rmu", "graddiff", "simnpo", "satimp", "idkdpo", "altpo", "idknll"))
    # UNDIAL: the whole next-token distribution against θ_o's top k, stage one's (the teacher), β = 10
    undial = METHODS["undial"]
    assert undial.teacher and undial.from_logits is not None and not undial.needs_logp and undial.skip_first == 0
    assert undial.hyperparameters == ("beta",) and undial.params().beta == 10.0 and undial.own_retain is None
    assert [name for name, m in METHODS.items() if m.teacher] == ["undial"]
    # PDU: the logit gap at every scored token, and the retain NLL weighted by a dual variable from λ₀ = 100
    pdu = METHODS["pdu"]
    assert pdu.from_logits is not None and not pdu.needs_logp and not pdu.teacher and pdu.own_retain == ("nll", 100.0)
    assert [name for name, m in METHODS.items() if m.dual] == ["pdu"]
    assert UnlearnConfig.from_params({"method": "pdu", "retain_weight": 0.0}, "u").retain is not None  # λ may rise
    for weighting in ("uniform", "hard", "soft"):
        assert UnlearnConfig.from_params({"method": "simnpo", "weighting": weighting}, "u").sequence_level
        assert not UnlearnConfig.from_params({"method": "ceu", "weighting": weighting}, "u").sequence_level


@pytest.mark.parametrize("values, message", [
    ({"method": "npo", "beta": 0}, r"^u.beta=0: must be positive and finite$"),
    ({"method": "ga", "beta": -1.0}, r"^u.beta=-1.0: must be positive and finite$"),  # another method's key is checked too
    ({"method": "wga", "gamma": "big"}, r"^u.gamma='big': expected float$"),
    ({"method": "rmu", "rmu_steer": -6.5}, r"^u.rmu_steer=-6.5: must be positive and finite$"),
    ({"method": "rmu", "rmu_update_layers": [0, -1]},
     r"^u.rmu_update_layers=\[0, -1\]: must be a list of decoder layer indices \(integers ≥ 0\)$"),
    ({"method": "npo", "bta": 0.1}, r"^u.bta: unknown parameter \(known: \['alpha', 'beta', "),
    ({"method": "npo", "reduction": "tokens"}, r"^u.reduction='tokens': must be one of \['sample', 'token'\]$"),
    ({"method": "npo", "reduction": "token"}, r"^u.reduction='token': npo with uniform weights is its sequence-level "
                                              r"loss, one value per sample, with no token losses to pool"),
    ({"method": "simnpo", "weighting": "soft", "reduction": "token"},
     r"^u.reduction='token': simnpo is a loss of whole sequences under every weighting \(ω enters each sample's "
     r"weighted mean\), one value per sample, with no token losses to pool; use reduction: sample$"),
    ({"method": "simnpo", "beta": 0}, r"^u.beta=0: must be positive and finite$"),
    ({"method": "simnpo", "delta": -1.0}, r"^u.delta=-1.0: must be at least 0 and finite$"),
    ({"method": "satimp", "beta1": -1.0}, r"^u.beta1=-1.0: must be at least 0 and finite$"),
    ({"method": "idkdpo", "beta": 0}, r"^u.beta=0: must be positive and finite$"),
    ({"method": "altpo", "beta": float("inf")}, r"^u.beta=inf: must be positive and finite$"),  # not at step 1
    ({"method": "simnpo", "delta": float("nan")}, r"^u.delta=nan: must be at least 0 and finite$"),
    ({"method": "altpo", "weighting": "hard", "reduction": "token"},
     r"^u.reduction='token': altpo is a loss of whole sequences under every weighting"),
    ({"method": "idknll", "weighting": "hard"},
     r"^u.weighting='hard': idknll trains on each sample's idk answer alone, and token weights are defined on the "
     r"forget answer's tokens \(stage one scores those\); use weighting: uniform$"),
    ({"method": "idknll", "weighting": "soft", "tau": 0.5}, r"^u.weighting='soft': idknll trains on each sample's"),
    ({"method": "pdu", "epsilon_kind": "relativ"},
     r"^u.epsilon_kind='relativ': must be one of \['absolute', 'relative'\]$"),
    ({"method": "pdu", "dual_step": -1.0}, r"^u.dual_step=-1.0: must be at least 0 and finite$"),
    ({"method": "pdu", "retain_loss": "kl"}, r"^u.retain_loss='kl': method pdu has its own retain term, nll"),
    ({"method": "idknll", "reduction": "token"},
     r"^u.reduction='token': idknll is a loss of whole sequences \(each sample's mean NLL of its idk answer\), one "
     r"value per sample, with no token losses to pool; use reduction: sample$"),
])
def test_a_bad_method_key_is_an_error_naming_it(values, message):
    with pytest.raises(ParamError, match=message):
        UnlearnConfig.from_params(values, "u")


def test_a_methods_keys_are_read_from_its_section_and_named_where_set():
    params = {"unlearn": {"train": TRAIN, "defaults": {"reduction": "token"},
                          "methods": {"npo": {"beta": 0.2}, "rmu": {"rmu_steer": 0.0}},
                          "runs": {"t_npo": {"method": "npo", "weighting": "hard"},
                                   "npo": {"method": "npo", "weighting": "uniform"},
                                   "t_rmu": {"method": "rmu", "weighting": "hard"}}}}
    cfg, _ = run_configs(params, "t_npo")
    assert (cfg.reduction, cfg.method_params.beta) == ("token", 0.2)
    with pytest.raises(ParamError, match=r"^unlearn.defaults.reduction='token': npo with uniform weights"):
        run_configs(params, "npo")
    with pytest.raises(ParamError, match=r"^unlearn.methods.rmu.rmu_steer=0.0: must be positive and finite$"):
        run_configs(params, "t_rmu")


def test_the_preference_methods_start_at_their_value_for_theta_o(alternatives_dir, micro_model_dir,
                                                                 micro_world_dir, tmp_path):
    # At the first step θ = θ_o: θ's log-likelihoods of both answers equal stage one's, so Δ_w = Δ_l = 0 and DPO
    # is (2/β)·ln 2 whatever the weighting (the scores cached in stage one belong to the answers trained on).
    shards = alternatives_dir[0] / "shards"
    for method, weighting in (("idkdpo", "uniform"), ("altpo", "soft"), ("idkdpo", "hard")):
        tag = f"{method}-{weighting}"
        _run(tmp_path, micro_model_dir, shards, micro_world_dir, tag, method=method, weighting=weighting,
             retain_loss="none", beta=0.5)
        first = float((tmp_path / f"{tag}.csv").read_text().splitlines()[1].split(",")[1])
        assert first == pytest.approx(4 * math.log(2), rel=1e-4), tag


def test_a_method_that_reads_alternatives_refuses_shards_without_them(attribution_dir, micro_model_dir,
                                                                       micro_world_dir, tmp_path):
    shards = attribution_dir[0] / "shards"  # stage one without attribution.alternatives
    for method, kind in (("idkdpo", "idk"), ("altpo", "perturbed"), ("idknll", "idk")):
        with pytest.raises(ParamError, match=rf"^{shards}: method {method} trains on each forget sample's {kind} "
                                             rf"answer, .* these shards hold no alternative answers: add {kind} to "
                                             r"attribution.alternatives .* and rerun `attribute`$"):
            _run(tmp_path, micro_model_dir, shards, micro_world_dir, method, method=method)
    # the methods that read none read such shards as before
    assert ForgetStream(shards, UnlearnConfig().weighting_spec).get([0])[0].alternative is None


def test_killed_and_resumed_unlearning_ends_with_the_same_weights(attribution_dir, micro_model_dir,
                                                                  micro_world_dir, tmp_path, monkeypatch):
    shards = attribution_dir[0] / "shards"
    monkeypatch.setitem(TRAIN, "checkpoint_every", 1)
    full = load_weights(_run(tmp_path, micro_model_dir, shards, micro_world_dir, "full", method="npo",
                             weighting="soft") / "model")
    with killed_at_step(2):
        _run(tmp_path, micro_model_dir, shards, micro_world_dir, "resumed", method="npo", weighting="soft")
    resumed = load_weights(_run(tmp_path, micro_model_dir, shards, micro_world_dir, "resumed", resume=True,
                                method="npo", weighting="soft") / "model")
    for name in full:
        assert torch.equal(full[name], resumed[name]), name


def test_pdu_moves_its_dual_variable_and_a_killed_run_resumes_it(attribution_dir, micro_model_dir, micro_world_dir,
                                                                   tmp_path, monkeypatch):
    shards = attribution_dir[0] / "shards"
    with pytest.raises(ParamError, match=r"^u.epsilon=-0.5: must be at least 0 and finite$"):
        _run(tmp_path, micro_model_dir, shards, micro_world_dir, "bad", method="pdu", epsilon=-0.5)
    # ε = θ_o's retain loss (relative, + 0): as the forget loss moves θ, λ = 1 follows λ + 10·(L_r − ε) every step
    run = {"method": "pdu", "weighting": "soft", "epsilon": 0.0, "retain_weight": 1.0, "dual_step": 10.0}
    monkeypatch.setitem(TRAIN, "checkpoint_every", 1)
    full = _run(tmp_path, micro_model_dir, shards, micro_world_dir, "full", **run)

    def curve(tag):
        rows = (tmp_path / f"{tag}.csv").read_text().splitlines()
        header = rows[0].split(",")
        return [{k: float(v) for k, v in zip(header, r.split(",")) if k in ("forget_loss", "retain_loss", "dual")}
                for r in rows[1:]]

    steps = curve("full")
    assert len(steps) > 2 and len({s["dual"] for s in steps}) > 2
    epsilon = steps[0]["retain_loss"] - (steps[0]["dual"] - 1.0) / 10.0  # from step 1's update
    assert 0.5 * steps[0]["retain_loss"] < epsilon < 2 * steps[0]["retain_loss"]  # step 1 runs at θ_o
    for before, step in zip(steps, steps[1:]):
        assert step["dual"] == pytest.approx(max(0.0, before["dual"] + 10.0 * (step["retain_loss"] - epsilon)))
    with killed_at_step(3):
        _run(tmp_path, micro_model_dir, shards, micro_world_dir, "resumed", **run)
    resumed = _run(tmp_path, micro_model_dir, shards, micro_world_dir, "resumed", resume=True, **run)
    assert curve("resumed") == steps  # λ restored from the checkpoint's history, not restarted at 1
    full_weights, resumed_weights = load_weights(full / "model"), load_weights(resumed / "model")
    for name in full_weights:
        assert torch.equal(full_weights[name], resumed_weights[name]), name


def test_rmu_with_its_activation_matching_retain_loss(attribution_dir, micro_model_dir, micro_world_dir, tmp_path):
    out = _run(tmp_path, micro_model_dir, attribution_dir[0] / "shards", micro_world_dir, "rmu_act", method="rmu",
               weighting="hard", retain_loss="activation", retain_weight=10.0)
    rows = (tmp_path / "rmu_act.csv").read_text().splitlines()
    header = rows[0].split(",")
    retain = [float(r.split(",")[header.index("retain_loss")]) for r in rows[1:]]
    assert retain[0] == 0.0 and max(retain) > 0  # θ starts at θ_o, then the steered layers drift
    assert (out / "model" / "model.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("method, zero_stage", [("npo", 2), ("npo", 3),
                                               ("pdu", 3),      # λ and θ_o's retain loss the same on both
                                               ("undial", 3),   # stage one's teacher in the forget batch
                                               ("altpo", 3)])   # the alternative answer's forward pass
def test_two_processes_match_one_process(micro_model_dir, micro_world_dir, tmp_path, method, zero_stage, request):
    # One process with two micro-batches per step against two processes with one each: the same forget and
    # retain samples per step (the KL term's reference model is partitioned too under ZeRO-3).
    import yaml

    from tests.conftest import read_curve, run_two_processes

    shards = shards_for(method, request)
    run = {"method": method, "weighting": "soft", "rmu_layer": 2}
    train = {**TRAIN, "micro_batch_size": 1, "epochs": 3}
    cfg = UnlearnConfig.from_params(run, "u")
    run_unlearn("one", cfg, TrainConfig.from_params({**train, "grad_accum": 2}, "t"),
                DataConfig(source=str(micro_world_dir)), str(micro_model_dir), shards, tmp_path / "one",
                tmp_path / "ckpt-one", tmp_path / "one.csv", False)
    params = {"data": {"source": str(micro_world_dir), "template": "plain", "max_length": 128},
              "unlearn": {"model": str(micro_model_dir), "train": {**train, "zero_stage": zero_stage},
                          "defaults": {}, "runs": {"two": run}}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    proc = run_two_processes(["unlearn", "two", "--params", str(tmp_path / "params.yaml"), "--shards", str(shards),
                              "--out", str(tmp_path / "two"), "--checkpoints", str(tmp_path / "ckpt-two"),
                              "--plots", str(tmp_path / "two"), "--seed", "0"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, two = read_curve(tmp_path / "one.csv"), read_curve(tmp_path / "two" / "seed0.csv")
    assert len(one) >= 4 and two == pytest.approx(one, rel=1e-4, abs=1e-6)
    # The weights, per tensor: the runs' largest difference within 1% of the tensor's largest update (from
    # micro_model_dir's initial weights). Not elementwise: the runs add the same gradients in another order, and
    # Adam's step m / (√v + eps) amplifies that float rounding where a gradient is near eps, past rtol 1e-4 and
    # atol 1e-6 (UNDIAL: 29 embedding entries up to 6.3e-6 apart, 0.18% of the largest update, 3.5e-3), while the
    # loss curves agree to 1e-4. Measured: one micro-batch of 2 for two of 1 gives 0.04%; a wrong gradient, from
    # other samples per step, 170%.
    initial = load_weights(micro_model_dir)
    weights_one = load_weights(tmp_path / "one" / "model")
    weights_two = load_weights(tmp_path / "two" / "seed0" / "model")
    assert weights_one.keys() == weights_two.keys()
    for name, w_one in weights_one.items():
        w_one, w_two, w_initial = w_one.double(), weights_two[name].double(), initial[name].double()
        update = (w_one - w_initial).abs().max().item()
        assert (w_one - w_two).abs().max().item() <= 0.01 * update, (name, update)


def test_run_configs_merge_defaults_run_and_its_train_overrides():
    params = {"unlearn": {"train": TRAIN, "defaults": {"r": 0.2, "beta": 0.1},
                          "runs": {"t_npo": {"method": "npo", "weighting": "hard", "r": 0.4, "train": {"lr": 5e-4}},
                                   "bad": {"method": "ga", "train": {"lr": -1.0}}}}}
    cfg, train = run_configs(params, "t_npo")
    assert (cfg.method, cfg.weighting, cfg.r, cfg.method_params.beta) == ("npo", "hard", 0.4, 0.1)
    assert train.lr == 5e-4 and train.epochs == TRAIN["epochs"]  # the rest of unlearn.train stays
    with pytest.raises(ParamError, match="unlearn.runs.bad.train.lr"):
        run_configs(params, "bad")
    with pytest.raises(ParamError, match="no run named 'nope'"):
        run_configs(params, "nope")


def test_a_run_reads_defaults_then_its_methods_then_its_weightings_section_then_its_own_keys():
    """So DVC can track, per run, only the sections it reads: a change of tau moves the soft runs alone."""
    params = {"unlearn": {"train": TRAIN, "defaults": {"retain_weight": 0.1, "r": 0.3},
                          "methods": {"npo": {"beta": 0.2}, "graddiff": {}},
                          "weightings": {"uniform": {}, "hard": {"r": 0.2, "alpha": 0.6}, "soft": {"tau": 0.5}},
                          "runs": {"npo": {"method": "npo", "weighting": "uniform"},
                                   "t_npo": {"method": "npo", "weighting": "hard"},
                                   "s_npo": {"method": "npo", "weighting": "soft", "beta": 0.3},
                                   "t_gd": {"method": "graddiff", "weighting": "hard"}}}}
    configs = {name: run_configs(params, name)[0] for name in params["unlearn"]["runs"]}
    assert (configs["t_npo"].r, configs["t_npo"].alpha, configs["t_npo"].method_params.beta) == (0.2, 0.6, 0.2)
    # its own keys win
    assert (configs["npo"].r, configs["s_npo"].tau, configs["s_npo"].method_params.beta) == (0.3, 0.5, 0.3)
    assert (configs["t_gd"].retain_loss, configs["t_gd"].retain_weight) == ("nll", 1.0)  # GradDiff's own term
    params["unlearn"]["weightings"]["soft"]["tau"] = 1.0
    moved = {name for name, cfg in configs.items() if run_configs(params, name)[0] != cfg}
    assert moved == {"s_npo"}
    assert run_spec(params, "s_npo") == {"retain_weight": 0.1, "r": 0.3, "beta": 0.3, "tau": 1.0,
                                         "method": "npo", "weighting": "soft"}
    params["unlearn"]["weightings"]["soft"]["tau"] = -1.0
    with pytest.raises(ParamError, match=r"^unlearn.weightings.soft.tau=-1.0: must be positive and finite$"):
        run_configs(params, "s_npo")
    params["unlearn"]["weightings"]["sotf"] = {}
    with pytest.raises(ParamError, match=r"unlearn.weightings: unknown weighting\(s\) \['sotf'\]"):
        run_configs(params, "npo")


def test_focus_is_read_like_mix_and_refused_on_uniform_weights():
    params = {"unlearn": {"train": TRAIN, "defaults": {},
                          "weightings": {"uniform": {}, "hard": {"r": 0.2}, "soft": {"tau": 0.5, "focus": "first"}},
                          "runs": {"t_first": {"method": "npo", "weighting": "hard", "focus": "first"},
                                   "s_npo": {"method": "npo", "weighting": "soft"},
                                   "npo": {"method": "npo", "weighting": "uniform", "focus": "all"}}}}
    assert run_configs(params, "t_first")[0].weighting_spec.focus == "first"  # the run's own reaches the weights
    assert run_configs(params, "s_npo")[0].focus == "first"                  # the weighting's
    with pytest.raises(ParamError, match=r"^unlearn.runs.npo.focus='all': uniform weights select no stretch"):
        run_configs(params, "npo")
    params["unlearn"]["runs"]["t_first"]["focus"] = "middle"
    with pytest.raises(ParamError, match=r"^unlearn.runs.t_first.focus='middle': must be one of"):
        run_configs(params, "t_first")


def test_mix_is_read_like_r_and_tau_and_refused_on_uniform_weights():
    params = {"unlearn": {"train": TRAIN, "defaults": {},
                          "weightings": {"uniform": {}, "hard": {"r": 0.2, "mix": 0.3}, "soft": {"tau": 0.5}},
                          "runs": {"t_npo": {"method": "npo", "weighting": "hard"},
                                   "t_half": {"method": "npo", "weighting": "hard", "mix": 0.5},
                                   "s_npo": {"method": "npo", "weighting": "soft"},
                                   "npo": {"method": "npo", "weighting": "uniform", "mix": 0.0}}}}
    assert run_configs(params, "t_npo")[0].mix == 0.3                  # the weighting's
    assert run_configs(params, "t_half")[0].weighting_spec.mix == 0.5   # the run's own wins, and reaches the weights
    assert run_configs(params, "s_npo")[0].mix == 0.0                   # the default: the weights alone
    with pytest.raises(ParamError, match=r"^unlearn.runs.npo.mix=0.0: the uniform weighting spreads the push evenly "
                                         r"already; mix is for the hard and soft weightings"):
        run_configs(params, "npo")
    del params["unlearn"]["runs"]["npo"]["mix"]
    params["unlearn"]["defaults"]["mix"] = 0.2
    with pytest.raises(ParamError, match=r"^unlearn.defaults.mix=0.2: the uniform weighting"):
        run_configs(params, "npo")
    params["unlearn"]["defaults"] = {}
    assert run_configs(params, "npo")[0].mix == 0.0
    params["unlearn"]["runs"]["t_half"]["mix"] = 1.5
    with pytest.raises(ParamError, match=r"^unlearn.runs.t_half.mix=1.5: must be in \[0, 1\]$"):
        run_configs(params, "t_half")
    params["unlearn"]["weightings"]["hard"]["mix"] = "lots"
    with pytest.raises(ParamError, match=r"^unlearn.weightings.hard.mix='lots': expected float$"):
        run_configs(params, "t_npo")


def test_corpus_unlearning_keeps_the_other_authors_passages(micro_world_dir, micro_model_dir, micro_tokenizer,
                                                            tmp_path):
    from pipeline.attribution.run import AttributionConfig, run_attribution
    from pipeline.data.tofu import read_json_records

    biographies = micro_world_dir / "biographies.json"
    data = DataConfig(source=str(micro_world_dir), max_length=128)
    cfg = UnlearnConfig.from_params({"method": "npo", "weighting": "hard", "retain_corpus": str(biographies)}, "u")
    retain = load_retain(cfg, data, micro_tokenizer, "forget10")
    passages = read_json_records(biographies)
    kept = [p["text"] for p in passages if "forget10" not in p["forget_splits"]]
    assert [s.text for s in retain] == kept and len(kept) == len(passages) - 1
    assert all(s.labels[0] == -100 and s.labels[1:] == s.input_ids[1:] for s in retain)

    attribution = AttributionConfig(**{**ATTRIBUTION, "model": str(micro_model_dir), "mode": "corpus",
                                       "corpus": str(biographies)})
    run_attribution(attribution, data, tmp_path / "shards", None)
    out = tmp_path / "npo"
    run_unlearn("npo", cfg, TrainConfig.from_params(TRAIN, "t"), data, str(micro_model_dir), tmp_path / "shards",
                out, tmp_path / "ckpt", tmp_path / "npo.csv", False)
    before, after = load_weights(micro_model_dir), load_weights(out / "model")
    assert any(not torch.equal(before[k], after[k]) for k in before)
    weights = pq.read_table(out / "token_weights.parquet").to_pylist()
    assert len(weights) == 1  # the forget10 author's passage


def test_graddiff_uses_its_own_retain_term_and_says_so():
    params = {"unlearn": {"train": TRAIN, "defaults": {"retain_loss": "kl", "retain_weight": 0.1},
                          "runs": {"graddiff": {"method": "graddiff"}, "ga": {"method": "ga"},
                                   "gd_half": {"method": "graddiff", "retain_weight": 0.5},
                                   "gd_kl": {"method": "graddiff", "retain_loss": "kl"}}}}
    graddiff, _ = run_configs(params, "graddiff")
    assert (graddiff.retain_loss, graddiff.retain_weight) == ("nll", 1.0)  # GA + NLL, equally weighted
    assert (run_configs(params, "ga")[0].retain_loss, run_configs(params, "ga")[0].retain_weight) == ("kl", 0.1)
    assert run_configs(params, "gd_half")[0].retain_weight == 0.5  # a run may change its λ
    with pytest.raises(ParamError, match=r"unlearn.runs.gd_kl.retain_loss='kl': method graddiff has its own retain "
                                         r"term, nll"):
        run_configs(params, "gd_kl")


def test_a_runs_record_depends_only_on_the_params_its_weights_use():
    from pipeline.training.run_config import params_used

    def used(**kw):
        return params_used(UnlearnConfig.from_params(kw, "u"))

    assert used(method="npo", weighting="uniform", tau=0.5) == used(method="npo", weighting="uniform", tau=1.0)
    assert used(method="npo", weighting="hard", tau=0.5) == used(method="npo", weighting="hard", tau=1.0)
    assert used(method="npo", weighting="soft", tau=0.5) != used(method="npo", weighting="soft", tau=1.0)
    assert used(method="npo", weighting="hard", mix=0.0) == used(method="npo", weighting="hard")  # as before mix
    assert used(method="npo", weighting="hard", mix=0.5) != used(method="npo", weighting="hard")
    assert used(method="npo", weighting="soft", focus="all") == used(method="npo", weighting="soft")  # as before
    assert used(method="npo", weighting="soft", focus="first") != used(method="npo", weighting="soft")
    assert used(method="ga", gamma=1.0) == used(method="ga", gamma=2.0)
    assert used(method="wga", gamma=1.0) != used(method="wga", gamma=2.0)
    assert used(method="wga") == used(method="wga", gamma=1.0)  # its default, written or not
    assert used(method="rmu")["rmu_update_layers"] == [] and used(method="rmu")["rmu_layer"] == 2
    assert used(method="ga", weighting="hard", reduction="sample") == used(method="ga", weighting="hard")
    assert used(method="ga", weighting="hard", reduction="token") != used(method="ga", weighting="hard")
    assert used(method="ga", retain_weight=0.1) != used(method="ga", retain_weight=0.2)
    assert used(method="ga", retain_loss="none", retain_split="x") == used(method="ga", retain_loss="none")


def test_tokens_per_second_counts_only_the_tokens_the_loss_reads():
    """A micro-batch of 5 forget tokens (2 + 3), 4 alternative-answer tokens and 7 retain tokens: GA without a retain
    term reads the forget answers alone; with one, the retain batch too; IdkNLL reads only the alternatives."""
    from pipeline.training.unlearn import tokens_read

    def mask(*lengths):
        return {"attention_mask": torch.tensor([[1] * n + [0] * (4 - n) for n in lengths])}

    batch = {"forget": {**mask(2, 3), "alternative": mask(4, 0)}, "retain": mask(4, 3)}
    counts = {(method, retain): tokens_read(UnlearnConfig(method=method, retain_loss=retain))(batch)
              for method, retain in [("ga", "none"), ("ga", "kl"), ("idknll", "none"), ("idkdpo", "nll")]}
    assert counts == {("ga", "none"): 5, ("ga", "kl"): 12, ("idknll", "none"): 4, ("idkdpo", "nll"): 16}
