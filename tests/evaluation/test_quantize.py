"""The quantization attack's RTN fake quantization on hand-computed cases, and its in-place round trip on a tiny
Llama (the weights come back exactly)."""

import sys
import types

import pytest
import torch

from pipeline.common.errors import ParamError
from pipeline.evaluation import quantize
from pipeline.evaluation.quantize import (fake_quantize, load_quantized_bnb, quantizable_modules, resolve_method,
                                          rtn_quantized)


def close(a, b):
    return torch.allclose(a, torch.tensor(b), atol=1e-6)


def test_rounds_to_an_asymmetric_grid_per_row():
    w = torch.tensor([[0.0, 0.1, 0.2, 0.3], [0.0, 0.04, 0.16, 0.3], [-0.2, -0.07, 0.05, 0.4],
                      [-0.15, 0.0, 0.12, 0.45]])
    out = fake_quantize(w, bits=2)  # 4 columns < group 128: one group per row; 2 bits: q in 0..3
    # row 0: scale = 0.3 / 3 = 0.1, zero = 0, q = 0, 1, 2, 3: already on the grid
    assert close(out[0], [0.0, 0.1, 0.2, 0.3])
    # row 1: scale 0.1, zero 0, q = round(0, 0.4, 1.6, 3) = 0, 0, 2, 3
    assert close(out[1], [0.0, 0.0, 0.2, 0.3])
    # row 2: scale = 0.6 / 3 = 0.2, zero = round(0.2 / 0.2) = 1,
    # q = round(-1, -0.35, 0.25, 2) + 1 = 0, 1, 1, 3 -> (q - 1) * 0.2 = -0.2, 0, 0, 0.4
    assert close(out[2], [-0.2, 0.0, 0.0, 0.4])
    # row 3: scale 0.2, zero = round(0.15 / 0.2) = round(0.75) = 1 (an integer, so 0.0 stays exactly 0.0),
    # q = round(-0.75, 0, 0.6, 2.25) + 1 = 0, 1, 2, 3 -> -0.2, 0, 0.2, 0.4: the minimum itself moves
    assert close(out[3], [-0.2, 0.0, 0.2, 0.4])


def test_groups_have_their_own_scales():
    w = torch.tensor([[0.0, 1.0, 2.0, 3.0, 0.0, 10.0, 20.0, 30.0]])
    # groups of 4: scales 1 and 10, both groups on their grids
    assert close(fake_quantize(w, bits=2, group_size=4)[0], w[0].tolist())
    # one group (0 means the whole row): scale 10, so 1, 2, 3 round to 0
    for g in (0, 8, 1000):
        assert close(fake_quantize(w, bits=2, group_size=g)[0], [0.0, 0.0, 0.0, 0.0, 0.0, 10.0, 20.0, 30.0])


def test_a_shorter_last_group_uses_its_own_range():
    # 7 columns in groups of 4: [0, 1, 2, 3] (scale 1) and [5, 6, 8]: scale (8 - 5) / 3 = 1, zero = round(-5) = -5,
    # q = 0, 1, 3: unchanged. Padding it with zeros would widen its range to [0, 8] (scale 8/3) and move 5 and 6.
    w = torch.tensor([[0.0, 1.0, 2.0, 3.0, 5.0, 6.0, 8.0]])
    out = fake_quantize(w, bits=2, group_size=4)
    assert out.shape == w.shape and close(out[0], w[0].tolist())


def test_a_constant_group_is_unchanged():
    w = torch.tensor([[0.7, 0.7, 0.7, 0.7, 0.0, 0.1, 0.24, 0.3], [-2.0] * 8])
    out = fake_quantize(w, bits=2, group_size=4)
    assert torch.equal(out[0, :4], w[0, :4]) and torch.equal(out[1], w[1])  # scale 0: returned as it is
    assert close(out[0, 4:], [0.0, 0.1, 0.2, 0.3])  # the row's other group: scale 0.1, 0.24 -> q = 2


def test_eight_bits_moves_each_weight_by_at_most_half_a_step():
    torch.manual_seed(0)
    w = torch.randn(5, 300)  # 300 = 128 + 128 + 44: the last group is shorter
    out = fake_quantize(w, bits=8, group_size=128)
    for start in (0, 128, 256):
        group, got = w[:, start:start + 128], out[:, start:start + 128]
        step = (group.amax(1, keepdim=True) - group.amin(1, keepdim=True)) / 255
        assert ((got - group).abs() <= step / 2 + 1e-6).all()
        assert (got - group).abs().max() > 0  # it did round
    assert not torch.equal(out, w)


def test_keeps_the_dtype():
    w = torch.randn(4, 16).to(torch.bfloat16)
    assert fake_quantize(w, bits=4, group_size=8).dtype == torch.bfloat16


@pytest.mark.parametrize("bits", [1, 5, 16, 0])
def test_invalid_bits_is_a_param_error(bits):
    with pytest.raises(ParamError, match="evaluate.quantize.bits"):
        fake_quantize(torch.zeros(2, 4), bits=bits)
    with pytest.raises(ParamError, match="evaluate.quantize.bits"):
        with rtn_quantized(torch.nn.Linear(2, 2), bits):
            pass


@pytest.fixture
def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      vocab_size=64, max_position_embeddings=32, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval()


PROJECTIONS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj"]


def test_quantizable_modules_are_the_decoder_projections(tiny_llama):
    names = [name for name, _ in quantizable_modules(tiny_llama)]
    assert sorted(names) == sorted(f"layers.{i}.{p}" for i in range(2) for p in PROJECTIONS)
    assert tiny_llama.lm_head.weight is tiny_llama.model.embed_tokens.weight  # tied: skipped with the embedding
    # a decoder linear layer that shares the embedding's tensor is skipped too
    tiny_llama.model.shared = torch.nn.Linear(32, 64, bias=False)
    tiny_llama.model.shared.weight = tiny_llama.model.embed_tokens.weight
    assert "shared" not in [name for name, _ in quantizable_modules(tiny_llama)]


def test_rtn_quantized_rounds_in_place_and_restores_exactly(tiny_llama):
    model, bits, group = tiny_llama, 2, 16
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    ids = torch.tensor([[1, 5, 9, 13, 17, 21]])
    with torch.no_grad():
        logits = model(ids).logits
    with rtn_quantized(model, bits, group_size=group) as report:
        for name, module in quantizable_modules(model):
            w = module.weight.detach()
            assert not torch.equal(w, before[f"model.{name}.weight"]), name
            for row in w.reshape(-1, group):  # at most 2**bits distinct values in each group
                assert row.unique().numel() <= 2 ** bits, name
        assert torch.equal(model.model.embed_tokens.weight, before["model.embed_tokens.weight"])
        assert torch.equal(model.lm_head.weight, before["model.embed_tokens.weight"])
        with torch.no_grad():
            assert not torch.allclose(model(ids).logits, logits)
    assert report["method"] == "rtn" and report["bits"] == 2 and report["group_size"] == 16
    assert report["n_tensors"] == 14
    assert report["n_parameters"] == sum(m.weight.numel() for _, m in quantizable_modules(model))
    assert 0 < report["relative_change"] < 1
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    with torch.no_grad():
        assert torch.equal(model(ids).logits, logits)


def test_rtn_quantized_restores_after_an_exception(tiny_llama):
    before = {name: p.detach().clone() for name, p in tiny_llama.named_parameters()}
    with pytest.raises(RuntimeError, match="boom"):
        with rtn_quantized(tiny_llama, 4):
            assert not torch.equal(tiny_llama.model.layers[0].mlp.up_proj.weight,
                                   before["model.layers.0.mlp.up_proj.weight"])
            raise RuntimeError("boom")
    for name, p in tiny_llama.named_parameters():
        assert torch.equal(p, before[name]), name


def test_auto_is_rtn_without_cuda_and_bnb_with_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_method("auto") == "rtn" and resolve_method("bnb") == "bnb"
    with pytest.raises(ParamError, match="evaluate.quantize.method"):
        resolve_method("gptq")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # installed nowhere: the import fails
    assert resolve_method("auto") == "rtn"
    monkeypatch.setitem(sys.modules, "bitsandbytes", types.ModuleType("bitsandbytes"))
    assert quantize.bnb_available() and resolve_method("auto") == "bnb"


def test_bnb_needs_cuda(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ParamError, match="CUDA"):
        load_quantized_bnb(str(tmp_path), 4)
    with pytest.raises(ParamError, match="evaluate.quantize.bits"):
        load_quantized_bnb(str(tmp_path), 2)  # bitsandbytes loads 8 or 4 bits only
