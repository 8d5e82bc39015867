"""The reference cache (stage `reference`) and the reference-free trainer: θ_o's top-k on the retain data, read back
for the KL and activation terms; the chunked LM head gives the full logits' values; no θ_o is loaded."""

import numpy as np
import pytest
import torch

from pipeline.attribution.reference import ReferenceCache, ReferenceConfig, run_reference
from pipeline.common.errors import DataError, ParamError
from pipeline.common.modeling import load_model
from pipeline.data.batching import pad_batch
from pipeline.data.config import DataConfig, retain_samples
from pipeline.training.losses import forward_kl_loss, nll_loss, token_logp
from pipeline.training.unlearn import UnlearnConfig, make_loss_fn


@pytest.fixture(scope="module")
def cache_dir(micro_world_dir, micro_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("reference") / "cache"
    cfg = ReferenceConfig(model=str(micro_model_dir), top_k=8, layers=[1, 2], batch_size=3, rows_per_shard=4)
    run_reference(cfg, DataConfig(source=str(micro_world_dir)), out, out.parent / "metrics.json")
    return out


@pytest.fixture(scope="module")
def retain(micro_world_dir, micro_tokenizer):
    return retain_samples(DataConfig(source=str(micro_world_dir)), micro_tokenizer, "retain90")


def test_the_cache_holds_theta_os_top_k_tail_and_activations(cache_dir, retain, micro_model_dir):
    cache = ReferenceCache.load(cache_dir)
    assert len(cache) == len(retain) and cache.k == 8 and cache.layers == [1, 2]
    model = load_model(micro_model_dir).eval()
    ids = [0, 5, 7]
    batch = pad_batch([retain[i] for i in ids], 0)
    got = cache.batch(ids, layer=2)
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True)
    rows, cols = (batch["labels"][:, 1:] != -100).nonzero(as_tuple=True)  # p: the next token is labelled
    assert got["rows"].tolist() == rows.tolist() and got["cols"].tolist() == cols.tolist()
    logp = torch.log_softmax(out.logits[rows, cols].float(), -1)
    top = logp.topk(8, -1)
    assert torch.equal(got["topk_ids"], top.indices)
    torch.testing.assert_close(got["topk_logp"], top.values, atol=1e-5, rtol=0)
    tail = torch.log1p(-top.values.double().exp().sum(-1)).float()
    torch.testing.assert_close(got["tail_logp"], tail, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got["act"], out.hidden_states[2][rows, cols], atol=2e-3, rtol=2e-3)  # float16


def test_a_cache_of_other_data_another_model_or_without_the_layer_is_refused(cache_dir, retain):
    cache = ReferenceCache.load(cache_dir)
    cache.check(retain, "retain90", cache.meta["model_hash"], 2)
    with pytest.raises(DataError, match=r"the reference cache was made with another model"):
        cache.check(retain, "retain90", "0123", None)
    with pytest.raises(DataError, match=r"holds other retain data than retain95 .*rerun `tokenunlearn reference`"):
        cache.check(retain[1:], "retain95", None, None)  # other rows
    with pytest.raises(DataError, match=r"rmu_layer=3 needs reference.layers to hold it \(the cache has \[1, 2\]\)"):
        cache.check(retain, "retain90", None, 3)
    with pytest.raises(ParamError, match=r"reference.top_k=0: must be at least 1"):
        ReferenceConfig.from_params({"top_k": 0})


def _retain_batch(retain, ids, cache=None, layer=None):
    batch = pad_batch([retain[i] for i in ids], 0)
    if cache is not None:
        batch["ref"] = cache.batch(ids, layer)
    return batch


def _forget_batch(micro_model_dir, retain):
    """A forget-like batch: the retain samples' answer tokens scored, with weights 1."""
    batch = pad_batch(retain[10:13], 0)
    scored = (batch["labels"] != -100).float()
    scored[:, 0] = 0
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "scored": scored,
            "weights": scored.clone(), "ref_logp": torch.zeros_like(scored)}


def test_the_chunked_trainer_gives_the_full_logits_losses(micro_model_dir, retain):
    """Every term, computed from hidden states a chunk of positions at a time, equals the full-logits formula."""
    model = load_model(micro_model_dir).eval()
    reference = load_model(micro_model_dir).eval()
    with torch.no_grad():  # a θ that differs from θ_o, so that the KL is not 0
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    forget, rbatch = _forget_batch(micro_model_dir, retain), _retain_batch(retain, [0, 1, 2])
    kw = {"input_ids": rbatch["input_ids"], "attention_mask": rbatch["attention_mask"]}
    with torch.no_grad():
        logits, ref_logits = model(**kw).logits, reference(**kw).logits
        positions = (rbatch["labels"] != -100).float()[:, 1:]
        exact_kl = forward_kl_loss(ref_logits[:, :-1], logits[:, :-1], positions).item()
        nll = nll_loss(*(t.float() if i else t for i, t in enumerate(token_logp(logits, rbatch["labels"])))).item()
        flogits = model(input_ids=forget["input_ids"], attention_mask=forget["attention_mask"]).logits
        labels = torch.where(forget["scored"] > 0, forget["input_ids"], -100)
        ga = ((token_logp(flogits, labels)[0] * forget["weights"]).sum(-1) / forget["weights"].sum(-1)).mean().item()
    for retain_loss, expected in (("kl", exact_kl), ("nll", nll)):
        cfg = UnlearnConfig(method="ga", retain_loss=retain_loss, retain_weight=1.0, retain_reference="model",
                            chunk_size=5)
        with torch.no_grad():
            _, metrics = make_loss_fn(cfg, reference)(model, {"forget": forget, "retain": rbatch})
        assert metrics["forget_loss"] == pytest.approx(ga, rel=1e-5)
        assert metrics["retain_loss"] == pytest.approx(expected, rel=1e-5), retain_loss


def test_the_cached_kl_is_exact_with_the_whole_vocabulary_and_a_lower_bound_with_less(micro_model_dir, retain,
                                                                                     tmp_path):
    from pipeline.attribution.reference import reference_rows
    from pipeline.attribution.reference import ReferenceCache as Cache

    model, reference = load_model(micro_model_dir).eval(), load_model(micro_model_dir).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ids = [0, 1, 2]
    rbatch = _retain_batch(retain, ids)
    values = {}
    cfg = UnlearnConfig(method="ga", retain_loss="kl", retain_weight=1.0, retain_reference="model")
    forget = _forget_batch(micro_model_dir, retain)
    with torch.no_grad():
        values["exact"] = make_loss_fn(cfg, reference)(model, {"forget": forget, "retain": rbatch})[1]["retain_loss"]
    vocab = reference.config.vocab_size
    for k in (8, vocab):
        cache = Cache.build(reference, retain, ids, 0, k, [])
        cached = {"forget": forget, "retain": {**rbatch, "ref": cache.batch(ids)}}
        with torch.no_grad():
            values[k] = make_loss_fn(UnlearnConfig(retain_loss="kl", retain_weight=1.0), None)(model, cached)[1][
                "retain_loss"]
    assert values[vocab] == pytest.approx(values["exact"], rel=1e-4)
    assert 0 < values[8] <= values["exact"] + 1e-6
    rows = reference_rows(reference, [retain[i] for i in ids], ids, 0, 8, [])
    assert all(np.isfinite(r["tail_logp"]).all() for r in rows)


@pytest.mark.slow
def test_a_run_reads_the_stages_cache_or_builds_its_own_and_loads_no_reference(
        cache_dir, attribution_dir, micro_model_dir, micro_world_dir, tmp_path, monkeypatch):
    from pipeline.training import unlearn as unlearn_module
    from pipeline.training.engine import TrainConfig
    from pipeline.training.unlearn import run_unlearn

    from tests.conftest import load_weights

    loads = []
    real_load = unlearn_module.load_model
    monkeypatch.setattr(unlearn_module, "load_model", lambda *a, **k: loads.append(a) or real_load(*a, **k))
    train = TrainConfig.from_params({"max_steps": 2, "lr": 1e-3, "micro_batch_size": 2, "warmup_ratio": 0.0}, "t")
    outs = {}
    for tag, reference_dir in (("stage", cache_dir), ("own", None)):
        cfg = UnlearnConfig.from_params({"method": "npo", "weighting": "hard", "rmu_layer": 2, "reference_top_k": 8},
                                        "u")
        run_unlearn(tag, cfg, train, DataConfig(source=str(micro_world_dir)), str(micro_model_dir),
                    attribution_dir[0] / "shards", tmp_path / tag, tmp_path / f"ckpt-{tag}", tmp_path / f"{tag}.csv",
                    False, reference_dir)
        outs[tag] = load_weights(tmp_path / tag / "model")
    assert len(loads) == 2  # the trained model, once per run: no second copy as the reference
    assert not any(torch.equal(outs["stage"][k], v) for k, v in load_weights(micro_model_dir).items()
                   if "layers.0.self_attn.q_proj" in k)
    for name, value in outs["stage"].items():  # the same top-8, batched otherwise: the same weights but rounding
        torch.testing.assert_close(outs["own"][name], value, atol=1e-6, rtol=1e-5)


def test_with_lora_the_exact_term_reads_the_base_under_the_adapters(attribution_dir, micro_model_dir,
                                                                    micro_world_dir, tmp_path, monkeypatch):
    """retain_reference: model with LoRA loads no second model: θ_o is the model with its adapters off. The KL of
    the first step is 0 (LoRA starts as the identity: θ = θ_o)."""
    import csv

    from pipeline.training import unlearn as unlearn_module
    from pipeline.training.engine import TrainConfig
    from pipeline.training.unlearn import run_unlearn

    loads = []
    real_load = unlearn_module.load_model
    monkeypatch.setattr(unlearn_module, "load_model", lambda *a, **k: loads.append(a) or real_load(*a, **k))
    train = TrainConfig.from_params({"max_steps": 2, "lr": 1e-2, "micro_batch_size": 2, "warmup_ratio": 0.0,
                                     "lora": {"r": 4, "alpha": 8}}, "t")
    cfg = UnlearnConfig.from_params({"method": "ga", "retain_reference": "model", "retain_weight": 1.0}, "u")
    run_unlearn("lora", cfg, train, DataConfig(source=str(micro_world_dir)), str(micro_model_dir),
                attribution_dir[0] / "shards", tmp_path / "out", tmp_path / "ckpt", tmp_path / "curve.csv", False)
    assert len(loads) == 1
    with open(tmp_path / "curve.csv") as f:
        curve = list(csv.DictReader(f))
    assert float(curve[0]["retain_loss"]) == pytest.approx(0.0, abs=1e-6)
    assert float(curve[1]["retain_loss"]) > 1e-6  # the adapters moved θ away from θ_o
