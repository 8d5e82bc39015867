"""Membership-inference scores, AUC and privleak on hand-computed cases, and the model's side against a direct
computation from the full logits."""

import math
import zlib

import numpy as np
import pytest
import torch

from pipeline.evaluation.mia import (MIA_ATTACKS, SampleTokens, answer_tokens, auc, lowest_fraction,
                                     membership_inference, min_k_pp_score, min_k_score, privleak, vocab_moments,
                                     zlib_score)

LOGP = np.log([0.5, 0.25, 0.125, 1.0, 0.5])  # labelled tokens' log p, the last one EOS's


def sample(logp=LOGP, text="Ann Lee was born in Oslo."):
    n = len(logp)
    return SampleTokens(np.asarray(logp), np.zeros(n), np.ones(n), text)


def test_loss_and_zlib_read_every_labelled_token():
    loss = -(math.log(0.5) * 2 + math.log(0.25) + math.log(0.125)) / 5  # EOS's log 1 = 0 counts in the mean
    assert MIA_ATTACKS["loss"](sample(), 0.4) == pytest.approx(loss)
    text = "Ann Lee was born in Oslo."
    assert zlib_score(LOGP, text) == pytest.approx(loss / len(zlib.compress(text.encode())))
    assert MIA_ATTACKS["zlib"](sample(), 0.4) == pytest.approx(loss / len(zlib.compress(text.encode())))


def test_min_k_keeps_the_lowest_fraction_and_at_least_one_token():
    # k = 0.4 of 5 tokens: the 2 lowest, log 0.125 and log 0.25
    assert min_k_score(LOGP, k=0.4) == pytest.approx(-(math.log(0.125) + math.log(0.25)) / 2)
    # k = 0.1: int(0.5) = 0 tokens, so the single lowest
    assert min_k_score(LOGP, k=0.1) == pytest.approx(-math.log(0.125))
    assert lowest_fraction([3.0, 1.0, 2.0], 1.0).tolist() == [1.0, 2.0, 3.0]
    assert min_k_score(np.array([]), 0.4) == 0.0  # no token: 0, as open-unlearning


def test_min_k_leaves_out_the_eos_prediction():
    # without EOS: 4 tokens, int(1.6) = 1 lowest, log 0.125; with EOS the lowest two would be averaged
    assert MIA_ATTACKS["min_k"](sample(), 0.4) == pytest.approx(-math.log(0.125))
    eos_low = np.log([0.5, 0.5, 0.5, 0.5, 0.01])  # a very unlikely EOS changes nothing
    assert MIA_ATTACKS["min_k"](sample(eos_low), 0.4) == pytest.approx(-math.log(0.5))


def test_min_k_pp_normalizes_by_the_models_own_distribution():
    # two positions over a 2-token vocabulary with p = (0.5, 0.5) and (0.9, 0.1)
    logits = torch.log(torch.tensor([[0.5, 0.5], [0.9, 0.1]]))
    mu, sigma2 = vocab_moments(logits)
    mu1 = 0.9 * math.log(0.9) + 0.1 * math.log(0.1)
    assert mu.tolist() == pytest.approx([math.log(0.5), mu1], rel=1e-5)
    var1 = 0.9 * math.log(0.9) ** 2 + 0.1 * math.log(0.1) ** 2 - mu1 ** 2
    assert sigma2.tolist() == pytest.approx([0.0, var1], abs=1e-6)
    # targets: token 0 at both positions; the first position's σ² = 0 is clamped to 1e-6
    logp = np.array([math.log(0.5), math.log(0.9)])
    z = [(logp[0] - mu[0].item()) / 1e-3, (logp[1] - mu1) / math.sqrt(var1)]
    assert min_k_pp_score(logp, mu.numpy(), sigma2.numpy(), k=1.0) == pytest.approx(-np.mean(z), abs=1e-3)
    # through the registry the last (EOS) position is left out: z of the first position alone
    s = SampleTokens(np.append(logp, 0.0), np.append(mu.numpy(), 0.0), np.append(sigma2.numpy(), 1.0), "x")
    assert MIA_ATTACKS["min_k_plus_plus"](s, 1.0) == pytest.approx(-np.mean(z), abs=1e-3)


def test_auc_counts_holdout_above_forget_with_ties_as_half():
    # forget scores lower (memorized): every pair ordered -> 1
    assert auc([0.1, 0.2], [0.3, 0.4]) == 1.0
    assert auc([0.3, 0.4], [0.1, 0.2]) == 0.0
    # pairs (h, f): (0.2, 0.2) tie, (0.2, 0.3) below, (0.4, 0.2) above, (0.4, 0.3) above -> (2 + 0.5) / 4
    assert auc([0.2, 0.3], [0.2, 0.4]) == pytest.approx(0.625)
    with pytest.raises(ValueError, match="non-empty"):
        auc([], [0.1])
    with pytest.raises(ValueError, match="NaN"):
        auc([float("nan")], [0.1])


def test_privleak_is_zero_for_the_retain_model_against_itself():
    retain_auc = auc([0.3, 0.5, 0.2], [0.4, 0.1, 0.6])
    assert privleak(retain_auc, retain_auc) == 0.0
    # open-unlearning's sign: s = 1 − AUC; a model that still knows the forget set (AUC 0.75 against the retain
    # model's 0.5): (0.25 − 0.5) / 0.5 × 100 = −50; AUC 1 -> −100
    assert privleak(0.75, 0.5) == pytest.approx(-50.0)
    assert privleak(1.0, 0.5) == pytest.approx(-100.0)
    # against a retain AUC of 0.6: s_ref = 0.4, AUC 0.3 -> (0.7 − 0.4) / 0.4 × 100 = 75
    assert privleak(0.3, 0.6) == pytest.approx(75.0)


def test_answer_tokens_equal_the_full_logits(micro_model_dir, micro_tokenizer, micro_world_dir):
    """The labelled tokens' log p and moments equal a direct computation on one sample's full logits, and the
    text is the answer and EOS decoded without special tokens."""
    from pipeline.common.modeling import load_model
    from pipeline.data.templates import encode_qa, get_template
    from pipeline.data.tofu import load_split

    model = load_model(str(micro_model_dir)).eval()
    template = get_template("plain")
    rows = load_split(str(micro_world_dir), "forget10")[:3]
    got = answer_tokens(model, micro_tokenizer, template, [r["question"] for r in rows],
                        [r["answer"] for r in rows], batch_size=2)
    for row, s in zip(rows, got):
        enc = encode_qa(micro_tokenizer, template, row["question"], row["answer"])
        ids = torch.tensor([enc.input_ids])
        with torch.no_grad():
            logp_all = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
        labels = torch.tensor(enc.labels[1:])
        at = (labels != -100).nonzero().flatten()
        expected = logp_all[at, labels[at]]
        assert s.logp == pytest.approx(expected.double().numpy(), abs=1e-5)
        mu = (logp_all[at].exp() * logp_all[at]).sum(-1)
        assert s.mu == pytest.approx(mu.double().numpy(), abs=1e-5)
        assert s.text == micro_tokenizer.decode(labels[at].tolist(), skip_special_tokens=True)
        assert row["answer"].split()[0] in s.text


def test_membership_inference_of_a_set_against_itself_is_chance(micro_model_dir, micro_tokenizer, micro_world_dir):
    from pipeline.common.modeling import load_model
    from pipeline.data.templates import get_template
    from pipeline.data.tofu import load_split

    model = load_model(str(micro_model_dir)).eval()
    rows = load_split(str(micro_world_dir), "forget10")
    result = membership_inference(model, micro_tokenizer, get_template("plain"), rows, rows, list(MIA_ATTACKS), 0.4,
                                  reference_losses="self")
    assert result.auc == pytest.approx({a: 0.5 for a in MIA_ATTACKS})  # every pair of equal scores is a tie
    assert all(len(v) == len(rows) for v in result.forget.values())
