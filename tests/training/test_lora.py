"""LoRA adapters (`train.lora`): the params, the base as a free reference, every method with adapters, the merged
model and the adapter directory (written and loaded back), ZeRO-3 with adapters, and resume with LoRA dropout."""

import json
import shutil

import pytest
import torch

from pipeline.common.errors import DataError, ParamError
from pipeline.data.config import DataConfig
from pipeline.training.engine import TrainConfig
from pipeline.training.finetune import job_from_params, run_finetune
from pipeline.training.lora import LoraSpec, apply_lora, reference_view
from pipeline.training.unlearn import METHODS, run_configs, run_unlearn

from tests.conftest import TINY_MODEL, killed_at_step, load_weights, micro_params, read_curve, shards_for

LORA = {"r": 4, "alpha": 8}
TRAIN = {"epochs": 2, "lr": 3e-3, "micro_batch_size": 2, "warmup_ratio": 0.0, "seed": 0}


def _tiny(family="llama", seed=0):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    if family == "gpt-neox":
        return GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                num_hidden_layers=2, num_attention_heads=2))
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, **TINY_MODEL))


def _adapted(model, seed=3):
    """The model with LoRA adapters that already change its outputs (B = 0 at first, as PEFT draws it)."""
    torch.manual_seed(seed)
    wrapped = apply_lora(model, LoraSpec(**LORA))
    for name, p in wrapped.named_parameters():
        if "lora_B" in name:
            p.data.normal_(std=0.2)
    return wrapped


def test_lora_params_are_checked_key_by_key():
    assert TrainConfig.from_params({}, "t").lora_spec is None and TrainConfig.from_params({"lora": {}}, "t").lora == {}
    cfg = TrainConfig.from_params({"lora": {"r": 8}}, "t")
    assert cfg.lora_spec == LoraSpec(r=8) and cfg.lora == {"r": 8, "alpha": 32.0, "dropout": 0.0,
                                                          "target_modules": "all-linear", "save": "merged"}
    bad = [({"rank": 8}, r"^t.lora.rank: unknown parameter"),
           ({"r": 0}, r"^t.lora.r=0: must be at least 1 and finite$"),
           ({"r": 4.5}, r"^t.lora.r=4.5: expected int$"),
           ({"alpha": -1}, r"^t.lora.alpha=-1: must be"),
           ({"dropout": 1.0}, r"^t.lora.dropout=1.0: must be in \[0, 1\)$"),
           ({"save": "both"}, r"^t.lora.save='both': must be one of \['merged', 'adapter'\]$"),
           ({"target_modules": []}, r"^t.lora.target_modules=\[\]: expected 'all-linear'"),
           ({"target_modules": 3}, r"^t.lora.target_modules=3: expected str or list$")]
    for lora, message in bad:
        with pytest.raises(ParamError, match=message):
            TrainConfig.from_params({"lora": lora}, "t")
    with pytest.raises(ParamError, match=r"^t.lora='yes': expected dict$"):
        TrainConfig.from_params({"lora": "yes"}, "t")
    # Through the stage's params: the key where the value was set.
    params = {"unlearn": {"train": {**TRAIN, "lora": LORA}, "defaults": {},
                          "runs": {"ga": {"method": "ga", "train": {"lora": {"r": -2}}}, "ok": {"method": "npo"}}}}
    with pytest.raises(ParamError, match=r"^unlearn.runs.ga.train.lora.r=-2: must be at least 1 and finite$"):
        run_configs(params, "ga")
    assert run_configs(params, "ok")[1].lora_spec == LoraSpec(**LORA)
    with pytest.raises(ParamError, match=r"t.lora.target_modules=\['nope'\]: .*not found"):
        apply_lora(_tiny(), LoraSpec.from_params({"target_modules": ["nope"]}, "t.lora"), "t.lora")


@pytest.mark.parametrize("family", ["llama", "gpt-neox"])
def test_the_reference_view_is_the_base_model(family):
    from pipeline.common.modeling import decoder, decoder_layers, lm_head_logits

    base = _tiny(family)
    model = _adapted(_tiny(family)).train()
    assert len(decoder_layers(model)) == 2 and decoder(model) is decoder(model.get_base_model())
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = base(ids).logits
        assert not torch.allclose(model(ids).logits, expected, atol=1e-4)  # the adapters change the outputs
        with reference_view(model) as ref:
            assert ref is model and not ref.training
            assert torch.allclose(ref(ids).logits, expected, atol=1e-6)
            # what the trainer reads: the decoder's hidden states and the head, called directly
            hidden = decoder(ref)(input_ids=ids, output_hidden_states=True)
            assert torch.allclose(lm_head_logits(ref, hidden.last_hidden_state), expected, atol=1e-6)
            assert torch.allclose(hidden.hidden_states[1], base.base_model(ids, output_hidden_states=True)
                                  .hidden_states[1], atol=1e-6)
        assert not torch.allclose(model(ids).logits, expected, atol=1e-4)  # adapters back on
    assert model.training
    with reference_view(base) as ref:
        assert ref is None  # no adapters: θ_o must come from elsewhere


def test_the_reference_view_keeps_frozen_adapters_frozen_and_the_step_intact():
    """RMU trains some layers' adapters only; PEFT's own context would mark every adapter trainable again. A view
    taken between the forward pass and the backward pass changes no gradient."""
    model = _adapted(_tiny())
    for name, p in model.named_parameters():
        if "layers.1." in name:
            p.requires_grad_(False)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))

    def grads(with_view: bool) -> dict:
        model.zero_grad()
        loss = model(ids, labels=ids).loss
        if with_view:
            with torch.no_grad(), reference_view(model) as ref:
                ref(ids)
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain, viewed = grads(False), grads(True)
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    assert plain.keys() == viewed.keys() and all("layers.0." in n and "lora_" in n for n in plain)
    assert all(torch.equal(plain[n], viewed[n]) for n in plain)


def _unlearn(tmp_path, model_dir, shards, world_dir, tag, method, lora=LORA, **train):
    weighting = "hard" if METHODS[method].token_weights else "uniform"  # IdkNLL: no token weights
    params = {"unlearn": {"train": {**TRAIN, "lora": lora, **train}, "defaults": {"rmu_layer": 2},
                          "runs": {tag: {"method": method, "weighting": weighting}}}}
    cfg, train_cfg = run_configs(params, tag)
    out = tmp_path / tag
    run_unlearn(tag, cfg, train_cfg, DataConfig(source=str(world_dir)), str(model_dir), shards, out,
                tmp_path / f"ckpt-{tag}", tmp_path / f"{tag}.csv", False)
    return out / "model"


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_trains_with_lora_and_writes_a_merged_model(micro_model_dir, micro_world_dir, tmp_path, method,
                                                                   request):
    from transformers import AutoModelForCausalLM

    model_dir = _unlearn(tmp_path, micro_model_dir, shards_for(method, request), micro_world_dir, method, method)
    AutoModelForCausalLM.from_pretrained(model_dir, use_safetensors=True)  # a plain model, as any stage writes
    assert not (model_dir / "adapter_config.json").exists()
    before, after = load_weights(micro_model_dir), load_weights(model_dir)
    assert before.keys() == after.keys()  # the base's names: no adapter or base_layer keys
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed, "the adapters did not train"
    # Only what the adapters adapt (the linear layers of the decoder) moves; embeddings and norms stay the base's.
    assert all(k.startswith("model.layers.") and k.endswith("_proj.weight") for k in changed), sorted(changed)
    if method == "rmu":  # only the adapters of layers 0 and 1 (below rmu_layer 2) train
        assert all(k.startswith(("model.layers.0.", "model.layers.1.")) for k in changed), sorted(changed)
    curve = (tmp_path / f"{method}.csv").read_text().splitlines()
    assert curve[0].startswith("step,forget_loss") and len(curve) > 2


def test_an_adapter_directory_is_written_and_loads_as_the_merged_model(attribution_dir, micro_model_dir,
                                                                       micro_world_dir, tmp_path):
    from pipeline.common.modeling import load_model, load_tokenizer, model_hash

    shards = attribution_dir[0] / "shards"
    base = tmp_path / "base"  # a copy of θ_o that this test may change
    shutil.copytree(micro_model_dir, base)
    merged = _unlearn(tmp_path, base, shards, micro_world_dir, "merged", "npo")
    adapter = _unlearn(tmp_path, base, shards, micro_world_dir, "adapter", "npo", lora={**LORA, "save": "adapter"})
    names = {p.name for p in adapter.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "base_model.json", "tokenizer.json"} <= names
    assert "model.safetensors" not in names and "config.json" not in names
    note = json.loads((adapter / "base_model.json").read_text())
    assert note["base_model"] == str(base) and note["lora"]["r"] == LORA["r"]
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base)

    loaded = load_model(adapter)  # what evaluation does with a run's model directory
    load_tokenizer(adapter)
    assert type(loaded).__name__ == "LlamaForCausalLM"
    expected = load_weights(merged)
    state = loaded.state_dict()
    for name, tensor in expected.items():  # the same training, merged by PEFT here and by the writer there
        assert torch.allclose(state[name], tensor, rtol=0, atol=1e-7), name
    assert model_hash(loaded, str(adapter)) != model_hash(loaded, str(merged))

    # The base model changed since: refused, naming it.
    from transformers import AutoModelForCausalLM

    from pipeline.common.modeling import save_model

    save_model(AutoModelForCausalLM.from_pretrained(base).apply(_perturb), load_tokenizer(base), base)
    with pytest.raises(DataError, match="its base model .* is not the one the adapters were trained on"):
        load_model(adapter)
    # Pickle-only adapter weights are never loaded.
    (adapter / "adapter_model.safetensors").rename(adapter / "adapter_model.bin")
    with pytest.raises(DataError, match="without adapter_model.safetensors .*adapter_model.bin"):
        load_model(adapter)


def _perturb(module):
    if isinstance(module, torch.nn.Linear):
        module.weight.data += 0.01


def test_finetuning_from_scratch_cannot_write_only_an_adapter(micro_world_dir, micro_tokenizer_dir):
    params = micro_params(micro_world_dir, micro_tokenizer_dir, lora={**LORA, "save": "adapter"})
    with pytest.raises(ParamError, match=r"^finetune.train.lora.save='adapter': model m starts from scratch"):
        job_from_params(params, "m")


def _finetune(tmp_path, world_dir, tokenizer_dir, model_dir, tag, resume=False, **train):
    params = micro_params(world_dir, tokenizer_dir, **train)
    params["finetune"]["models"]["m"]["init"] = str(model_dir)
    out = tmp_path / tag
    run_finetune(job_from_params(params, "m"), out / "model", out / "ckpt", out / "loss.csv", resume)
    return read_curve(out / "loss.csv"), out / "model"


def test_zero3_trains_lora_as_zero0_does(micro_world_dir, micro_tokenizer_dir, micro_model_dir, tmp_path):
    from pipeline.common.modeling import load_model

    common = dict(max_steps=4, lr=1e-2, lora=LORA)
    runs = {stage: _finetune(tmp_path, micro_world_dir, micro_tokenizer_dir, micro_model_dir, f"z{stage}",
                             zero_stage=stage, **common) for stage in (0, 3)}
    assert runs[3][0] == pytest.approx(runs[0][0], rel=1e-5)
    assert runs[0][0][-1] < runs[0][0][0]  # it learns
    w0, w3 = load_weights(runs[0][1]), load_weights(runs[3][1])
    assert w0.keys() == w3.keys() == load_weights(micro_model_dir).keys()
    for name in w0:
        assert torch.allclose(w3[name], w0[name], rtol=1e-5, atol=1e-7), name
    # ZeRO-3 writing only the adapter: the adapters gathered, the base never; it loads as the merged model.
    _, adapter = _finetune(tmp_path, micro_world_dir, micro_tokenizer_dir, micro_model_dir, "z3a", zero_stage=3,
                           **{**common, "lora": {**LORA, "save": "adapter"}})
    state = load_model(adapter).state_dict()
    for name in w3:
        assert torch.allclose(state[name], w3[name], rtol=0, atol=1e-7), name


def test_a_killed_lora_run_with_dropout_resumes_to_the_same_weights(micro_world_dir, micro_tokenizer_dir,
                                                                    micro_model_dir, tmp_path):
    """LoRA dropout draws random masks: the checkpoint keeps the random state, so a resumed run draws the same."""
    args = (tmp_path, micro_world_dir, micro_tokenizer_dir, micro_model_dir)
    train = dict(max_steps=5, checkpoint_every=2, lr=1e-2, lora={**LORA, "dropout": 0.3})
    full_curve, full = _finetune(*args, "full", **train)
    with killed_at_step(4):  # after the checkpoint at step 2, and one more step
        _finetune(*args, "resumed", **train)
    curve, resumed = _finetune(*args, "resumed", resume=True, **train)
    assert curve == full_curve
    full, resumed = load_weights(full), load_weights(resumed)
    for name in full:
        assert torch.equal(full[name], resumed[name]), name


def test_unlearning_with_lora_under_zero3_ends_where_zero0_does(attribution_dir, micro_model_dir, micro_world_dir,
                                                                 tmp_path):
    """The trainer calls the decoder and the head of the PEFT model directly, partitioned under ZeRO-3 (and with
    activation checkpointing, whose recomputed layers hold frozen base weights)."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    shards = attribution_dir[0] / "shards"
    try:
        runs = {(method, stage): _unlearn(tmp_path, micro_model_dir, shards, micro_world_dir, f"{method}-z{stage}",
                                          method, zero_stage=stage, max_steps=3, gradient_checkpointing=stage == 3)
                for stage in (0, 3) for method in ("npo", "rmu")}
    finally:  # a run that failed midway leaves its ZeRO-3 loading config alive in the traceback pytest keeps
        unset_hf_deepspeed_config()
    for method in ("npo", "rmu"):
        z0, z3 = read_curve(tmp_path / f"{method}-z0.csv"), read_curve(tmp_path / f"{method}-z3.csv")
        assert z3 == pytest.approx(z0, rel=1e-5)
        w0, w3 = load_weights(runs[method, 0]), load_weights(runs[method, 3])
        for name in w0:
            assert torch.allclose(w3[name], w0[name], rtol=1e-5, atol=1e-7), name


def test_the_lora_overlay_adds_adapters_to_a_familys():
    from pipeline.common.params import load_params

    from tests.conftest import REPO

    params = load_params(REPO / "configs" / "tofu.yaml", [REPO / "configs" / "models" / "llama3.1-8b-instruct.yaml",
                                                         REPO / "configs" / "lora.yaml"])
    _, train = run_configs(params, "t_npo")
    assert train.lora_spec == LoraSpec(r=16, alpha=32, save="merged") and train.gradient_checkpointing
    assert train.zero_stage == 3 and train.lr == 1.0e-5  # the family's own keys stay
    assert job_from_params(params, "target").train.lora_spec.r == 16


def test_unlearning_with_activation_checkpointing_ends_where_it_does_without(attribution_dir, micro_model_dir,
                                                                             micro_world_dir, tmp_path):
    """The trainer calls the decoder directly: its layers recompute in the backward pass all the same."""
    shards = attribution_dir[0] / "shards"
    runs = {ckpt: _unlearn(tmp_path, micro_model_dir, shards, micro_world_dir, f"npo-{ckpt}", "npo", max_steps=3,
                           gradient_checkpointing=ckpt) for ckpt in (False, True)}
    assert read_curve(tmp_path / "npo-True.csv") == pytest.approx(read_curve(tmp_path / "npo-False.csv"), rel=1e-6)
    plain, recomputed = load_weights(runs[False]), load_weights(runs[True])
    for name in plain:
        assert torch.allclose(recomputed[name], plain[name], rtol=1e-5, atol=1e-7), name


def test_peft_that_cannot_be_imported_is_one_line_when_the_params_ask_for_lora(monkeypatch):
    import builtins

    from pipeline.common.errors import TokenUnlearnError

    real_import = builtins.__import__

    def guarded(name, *args, **kwargs):  # PEFT's own guard: it raises at import in an environment it refuses
        if name == "peft" or name.startswith("peft."):
            raise RuntimeError("peft requires transformers>=9.0\nmore lines")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", guarded)
    with pytest.raises(TokenUnlearnError, match=r"^train.lora needs PEFT, and `import peft` failed \(RuntimeError: "
                                                r"peft requires transformers>=9.0\); install"):
        TrainConfig.from_params({"lora": {"r": 4}}, "t")
    assert TrainConfig.from_params({}, "t").lora_spec is None  # no LoRA asked for: PEFT is never imported
