"""The retain terms (pipeline.training.retain_terms), each on a case small enough to compute by hand: a toy causal
LM of two tokens whose hidden state is its token's embedding, and whose head reads that embedding as the logits."""

import math
from types import SimpleNamespace

import pytest
import torch

from pipeline.common.errors import ParamError
from pipeline.training.retain_terms import RETAIN_LOSSES, retain_activation, retain_kl, retain_nll, theta_o
from pipeline.training.run_config import UnlearnConfig, params_used

LN3 = math.log(3)


class ToyDecoder(torch.nn.Module):
    """h0 = E[token]; one layer, h1 = 2·h0: hidden_states = (h0, h1), the last one the head's input."""

    def __init__(self, embeddings):
        super().__init__()
        self.embed = torch.nn.Embedding.from_pretrained(torch.tensor(embeddings), freeze=False)
        self.layers = torch.nn.ModuleList([torch.nn.Identity()])

    def forward(self, input_ids, attention_mask, output_hidden_states=False):
        h0 = self.embed(input_ids)
        h1 = 2 * h0
        return SimpleNamespace(last_hidden_state=h0, hidden_states=(h0, h1) if output_hidden_states else None)


class ToyLM(torch.nn.Module):
    """The logits are the hidden state itself (an identity head): token t's row of E is the next-token logits."""

    def __init__(self, embeddings):
        super().__init__()
        self.decoder = ToyDecoder(embeddings)
        self.head = torch.nn.Linear(2, 2, bias=False)
        with torch.no_grad():
            self.head.weight.copy_(torch.eye(2))
        self.config = SimpleNamespace()

    def get_decoder(self):
        return self.decoder

    def get_output_embeddings(self):
        return self.head


# θ: token 0 predicts (1/2, 1/2), token 1 predicts (3/4, 1/4); θ_o the other way round
THETA = [[0.0, 0.0], [LN3, 0.0]]
THETA_O = [[LN3, 0.0], [0.0, 0.0]]
# one retain sample, tokens 0 1 0, the answer 1 0: positions 0 and 1 predict it
BATCH = {"input_ids": torch.tensor([[0, 1, 0]]), "attention_mask": torch.ones(1, 3, dtype=torch.long),
         "labels": torch.tensor([[-100, 1, 0]])}
CFG = SimpleNamespace(chunk_size=1, hidden_layer=1)  # one position per LM-head chunk: the chunks are joined right


def kl(p, q):
    return sum(a * math.log(a / b) for a, b in zip(p, q))


def test_the_registry_names_each_term_and_what_it_reads():
    assert sorted(RETAIN_LOSSES) == ["activation", "kl", "nll", "none"] and RETAIN_LOSSES["none"] is None
    assert [(name, t.loss, t.needs_reference, t.reads_hidden) for name, t in RETAIN_LOSSES.items() if t] == [
        ("kl", retain_kl, True, False), ("nll", retain_nll, False, False),
        ("activation", retain_activation, True, True)]
    # the layer a term reads is part of the run's record, and only then
    assert params_used(UnlearnConfig(method="ga", retain_loss="activation", rmu_layer=3))["rmu_layer"] == 3
    assert "rmu_layer" not in params_used(UnlearnConfig(method="ga", retain_loss="kl"))


def test_nll_is_the_mean_nll_of_the_answer_tokens():
    # p(1 | 0) = 1/2, p(0 | 1) = 3/4
    got = retain_nll(ToyLM(THETA), None, BATCH, CFG)
    assert got.item() == pytest.approx((math.log(2) + math.log(4 / 3)) / 2)


def test_the_exact_kl_reads_theta_o_and_sums_over_the_answer_positions():
    expected = kl((3 / 4, 1 / 4), (1 / 2, 1 / 2)) + kl((1 / 2, 1 / 2), (3 / 4, 1 / 4))  # one sample
    assert retain_kl(ToyLM(THETA), ToyLM(THETA_O), BATCH, CFG).item() == pytest.approx(expected)
    assert retain_kl(ToyLM(THETA), ToyLM(THETA), BATCH, CFG).item() == pytest.approx(0.0, abs=1e-7)


def test_the_cached_kl_reads_theta_os_top_k_and_tail():
    # θ_o's top 1 at each position and the rest: with two tokens the coarsened KL is the exact one
    ref = {"rows": torch.tensor([0, 0]), "cols": torch.tensor([0, 1]), "topk_ids": torch.tensor([[0], [0]]),
           "topk_logp": torch.log(torch.tensor([[3 / 4], [1 / 2]])),
           "tail_logp": torch.log(torch.tensor([1 / 4, 1 / 2]))}
    got = retain_kl(ToyLM(THETA), None, {**BATCH, "ref": ref}, CFG)
    assert got.item() == pytest.approx(kl((3 / 4, 1 / 4), (1 / 2, 1 / 2)) + kl((1 / 2, 1 / 2), (3 / 4, 1 / 4)))


def test_activation_matching_at_the_hidden_layer_from_the_model_or_the_cache():
    # layer 1 doubles the embedding: h_θ = (0, 0) then (2 ln 3, 0), θ_o's the other way round; each position's
    # squared distance (2 ln 3)², averaged over the 2 dimensions, then over the positions
    expected = (2 * LN3) ** 2 / 2
    assert retain_activation(ToyLM(THETA), ToyLM(THETA_O), BATCH, CFG).item() == pytest.approx(expected)
    ref = {"rows": torch.tensor([0, 0]), "cols": torch.tensor([0, 1]), "act": torch.tensor([[2 * LN3, 0.0], [0, 0]])}
    assert retain_activation(ToyLM(THETA), None, {**BATCH, "ref": ref}, CFG).item() == pytest.approx(expected)
    # at layer 0, the embeddings themselves: half the distance, a quarter of the square
    at_0 = SimpleNamespace(chunk_size=1, hidden_layer=0)
    assert retain_activation(ToyLM(THETA), ToyLM(THETA_O), BATCH, at_0).item() == pytest.approx(expected / 4)


def test_a_term_that_reads_theta_o_without_a_source_says_so():
    with pytest.raises(ParamError, match="needs the reference cache or retain_reference: model"):
        retain_kl(ToyLM(THETA), None, BATCH, CFG)
    with pytest.raises(ParamError, match="needs the reference cache"), theta_o(ToyLM(THETA), None):
        pass
    net = ToyLM(THETA)
    with theta_o(net, net) as ref:  # a loaded reference model is θ_o as it is
        assert ref is net
