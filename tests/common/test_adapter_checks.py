"""Tampered LoRA adapter directories (`pipeline.common.adapters.check_adapter`): a wrong base, a truncated weights file,
a config that disagrees with its weights or the base, unknown config fields. Each is one DataError line naming the
file; nothing reaches peft or torch. A tiny random Llama, so the whole file runs in seconds."""

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.common.errors import DataError
from pipeline.common.adapters import check_adapter, same_base
from pipeline.training.lora import LoraSpec, apply_lora

from tests.conftest import TINY_MODEL

WEIGHTS, CONFIG, NOTE = "adapter_model.safetensors", "adapter_config.json", "base_model.json"


def _tiny(seed=0, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, **{**TINY_MODEL, **overrides}))


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("base")
    _tiny().save_pretrained(directory, safe_serialization=True)
    return directory


@pytest.fixture
def adapter(base_dir, tmp_path):
    """An adapter directory as `lora.save: adapter` writes it (PEFT's files and the project's note of its base)."""
    torch.manual_seed(1)
    wrapped = apply_lora(_tiny(), LoraSpec(r=4, alpha=8, target_modules=["q_proj", "v_proj"]))
    wrapped.peft_config["default"].base_model_name_or_path = str(base_dir)
    directory = tmp_path / "adapter"
    wrapped.save_pretrained(str(directory), safe_serialization=True)
    (directory / NOTE).write_text(json.dumps({"base_model": str(base_dir), "base_model_hash": "x"}))
    return directory


def _edit_config(directory, **changes):
    config = json.loads((directory / CONFIG).read_text())
    config.update(changes)
    (directory / CONFIG).write_text(json.dumps(config))


def _one_line(excinfo):
    assert "\n" not in str(excinfo.value)
    return str(excinfo.value)


def test_a_sound_adapter_passes_and_loads(adapter, base_dir, caplog):
    from peft import PeftModel

    model = _tiny()
    with caplog.at_level(logging.WARNING):
        assert check_adapter(adapter) == str(base_dir)
        assert check_adapter(adapter, model, base_dir) == str(base_dir)
    assert not caplog.records
    PeftModel.from_pretrained(model, str(adapter), is_trainable=False).merge_and_unload()  # what the checks vouch for


def test_bases_compare_as_the_same_model(base_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(base_dir.parent)
    assert same_base(base_dir, f"./{base_dir.name}") and same_base(f"{base_dir}/", base_dir)
    assert same_base("owner/model", "owner/model") and not same_base("owner/model", "owner/other")
    assert not same_base(base_dir, "owner/model") and not same_base(base_dir, tmp_path)
    snapshot = tmp_path / "hub" / "models--owner--model" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    assert same_base(snapshot, "owner/model") and not same_base(snapshot, "owner/other")


def test_an_adapter_recording_another_base_is_refused(adapter, base_dir, tmp_path, caplog):
    other = tmp_path / "other"
    other.mkdir()
    # merged onto a base other than the one it records
    with pytest.raises(DataError, match=rf"{CONFIG}: the adapter was trained on '{base_dir}', not on '{other}'"):
        check_adapter(adapter, _tiny(), other)
    # its config edited to name another base, the project's note left as it was
    _edit_config(adapter, base_model_name_or_path=str(other))
    with pytest.raises(DataError) as e:
        check_adapter(adapter)
    assert f"base_model_name_or_path '{other}' disagrees with {NOTE}'s base_model '{base_dir}'" in _one_line(e)
    # ... and the note removed: only the shapes can be checked, and a warning says so
    (adapter / NOTE).unlink()
    with caplog.at_level(logging.WARNING, logger="pipeline.training.lora"):
        assert check_adapter(adapter, _tiny()) == str(other)
    assert any("could not be verified" in r.getMessage() for r in caplog.records)
    # where the shapes do not fit that base either, refused
    with pytest.raises(DataError, match=r"q_proj': lora_A \[4, 32\] and lora_B \[32, 4\], but r=4 .* need lora_A "
                                        r"\[4, 48\] and lora_B \[48, 4\]"):
        check_adapter(adapter, _tiny(hidden_size=48, num_attention_heads=2, num_key_value_heads=2))


@pytest.mark.parametrize("keep", [0, 5, 100, -8])
def test_a_truncated_weights_file_is_one_line(adapter, keep):
    path = adapter / WEIGHTS
    data = path.read_bytes()
    path.write_bytes(data[:keep] if keep >= 0 else data[:len(data) + keep])
    with pytest.raises(DataError) as e:
        check_adapter(adapter, _tiny())
    assert _one_line(e).startswith(f"{path}: truncated or corrupt (")


def _rewrite_weights(directory, change):
    tensors = load_file(directory / WEIGHTS)
    change(tensors)
    save_file(tensors, directory / WEIGHTS)


def test_a_config_that_disagrees_with_its_weights_names_the_module(adapter):
    path = adapter / WEIGHTS
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    cases = [  # (config changes, weight change, expected message)
        ({"r": 8}, None, r"module 'model.layers.0.self_attn.q_proj': lora_A \[4, 32\] and lora_B \[32, 4\], but r=8"),
        ({"target_modules": ["q_proj"]}, None,
         r"module 'model.layers.0.self_attn.v_proj' has weights but adapter_config.json's target_modules"),
        ({"target_modules": ["q_proj", "v_proj", "k_proj"]}, None,
         r"target_modules .* selects \['model.layers.0.self_attn.k_proj', 'model.layers.1.self_attn.k_proj'\], "
         r"for which the file holds no weights"),
        ({"rank_pattern": {"q_proj": 2}}, None, r"'model.layers.0.self_attn.q_proj': .* but r=2"),
        ({}, lambda t: t.__setitem__(f"{q}.lora_A.weight", torch.zeros(4, 31)),
         r"q_proj': lora_A \[4, 31\] .* the base's layer \(32 in, 32 out\)"),
        ({}, lambda t: t.pop(f"{q}.lora_B.weight"),
         r"module 'model.layers.0.self_attn.q_proj' has lora_A but no lora_B"),
        ({}, lambda t: t.__setitem__("base_model.model.model.layers.9.mlp.up_proj.lora_A.weight", torch.zeros(4, 32)),
         r"module 'model.layers.9.mlp.up_proj' has lora_A but no lora_B"),
        ({}, lambda t: t.update({"base_model.model.model.layers.9.mlp.up_proj.lora_A.weight": torch.zeros(4, 32),
                                 "base_model.model.model.layers.9.mlp.up_proj.lora_B.weight": torch.zeros(64, 4)}),
         r"module 'model.layers.9.mlp.up_proj' does not exist in the base model \(LlamaForCausalLM\)"),
        ({}, lambda t: t.update({"base_model.model.model.norm.lora_A.weight": torch.zeros(4, 32),
                                 "base_model.model.model.norm.lora_B.weight": torch.zeros(32, 4)}),
         r"module 'model.norm' is a LlamaRMSNorm in the base model, not a linear layer"),
        ({}, lambda t: t.__setitem__(f"{q}.lora_magnitude_vector", torch.zeros(32)),
         r"tensor '.*q_proj.lora_magnitude_vector' is not a LoRA A or B weight"),
    ]
    config, weights = (adapter / CONFIG).read_text(), path.read_bytes()
    for changes, change, message in cases:
        (adapter / CONFIG).write_text(config)
        path.write_bytes(weights)
        _edit_config(adapter, **changes)
        if change:
            _rewrite_weights(adapter, change)
        with pytest.raises(DataError, match=message) as e:
            check_adapter(adapter, _tiny())
        assert _one_line(e).startswith(f"{path}: ")


def test_all_linear_targets_every_linear_layer_but_the_head(base_dir, tmp_path):
    torch.manual_seed(1)
    wrapped = apply_lora(_tiny(), LoraSpec(r=2, alpha=4))  # all-linear
    wrapped.peft_config["default"].base_model_name_or_path = str(base_dir)
    wrapped.save_pretrained(str(tmp_path / "a"), safe_serialization=True)
    check_adapter(tmp_path / "a", _tiny())
    _rewrite_weights(tmp_path / "a", lambda t: [t.pop(k) for k in list(t) if "layers.1.mlp.down_proj" in k])
    with pytest.raises(DataError, match=r"selects \['model.layers.1.mlp.down_proj'\], for which the file holds"):
        check_adapter(tmp_path / "a", _tiny())


def test_config_fields_unknown_to_peft(adapter, caplog):
    path = adapter / CONFIG
    # a newer peft's fields, switched off: ignored, with a warning naming them (peft adds fields every release)
    _edit_config(adapter, future_option=None, future_flag=False)
    with caplog.at_level(logging.WARNING, logger="pipeline.training.lora"):
        check_adapter(adapter, _tiny())
    assert any("['future_flag', 'future_option']" in r.getMessage() for r in caplog.records)
    # switched on: they may change what the adapter computes, so refused
    _edit_config(adapter, future_option={"on": 1}, rank="8")
    with pytest.raises(DataError) as e:
        check_adapter(adapter)
    assert _one_line(e).startswith(f"{path}: unknown field(s) ['future_option', 'rank'] for this peft")


@pytest.mark.parametrize("text, message", [
    ("{not json", r"not readable JSON"),
    ("[1, 2]", r"expected a JSON object, found list"),
    (json.dumps({"peft_type": "IA3", "base_model_name_or_path": "b"}), r"peft_type 'IA3': only LoRA"),
    (json.dumps({"peft_type": "LORA", "r": 4}), r"does not name its base model"),
    (json.dumps({"peft_type": "LORA", "base_model_name_or_path": "b", "r": "four"}), r"r='four': expected an integer"),
    (json.dumps({"peft_type": "LORA", "base_model_name_or_path": "b", "use_dora": True, "lora_bias": True}),
     r"not a valid LoRA config"),
])
def test_a_malformed_config_is_one_line(adapter, text, message):
    (adapter / CONFIG).write_text(text)
    with pytest.raises(DataError, match=message) as e:
        check_adapter(adapter)
    assert _one_line(e).startswith(f"{adapter / CONFIG}: ")


def test_a_malformed_note_is_one_line(adapter):
    (adapter / NOTE).write_text("{")
    with pytest.raises(DataError, match=rf"^{adapter / NOTE}: not readable JSON"):
        check_adapter(adapter)


def test_load_model_refuses_a_tampered_adapter(adapter, base_dir, tmp_path):
    """Through `load_model`, as evaluation loads a run's model directory (needs check_adapter called there)."""
    from pipeline.common.modeling import load_model

    (adapter / NOTE).unlink()  # no hash to catch it: the checks must
    _edit_config(adapter, r=8)
    with pytest.raises(DataError, match=r"but r=8"):
        load_model(adapter)
    _edit_config(adapter, r=4)
    (adapter / WEIGHTS).write_bytes((adapter / WEIGHTS).read_bytes()[:-8])
    with pytest.raises(DataError, match=r"truncated or corrupt"):
        load_model(adapter)
