"""Masking, alignment and the attribution signals, checked against a plain full-logits computation."""

import numpy as np
import pytest
import torch

from pipeline.attribution.quality import topr_counts
from pipeline.attribution.signals import AttributionInput, add_phi, corpus_input, overlapping, qa_input, score_batch
from pipeline.common.modeling import load_model
from pipeline.data.templates import TEMPLATES, encode_qa

Q, A = "Where was Ana Bell born?", "Ana Bell was born in Varo, Eldmark."


def test_overlap_masks_partly_covered_tokens_and_never_special_ones():
    offsets = [(0, 0), (0, 5), (5, 9), (10, 14), (14, 14)]
    assert overlapping(offsets, [(3, 7)]) == [False, True, True, False, False]
    assert overlapping(offsets, [(0, 14)], region=(10, 14)) == [False, False, False, True, False]
    assert overlapping(offsets, []) == [False] * 5


def test_qa_masks_question_nouns_and_scores_answer_tokens(micro_tokenizer):
    s = encode_qa(micro_tokenizer, TEMPLATES["plain"], Q, A)
    nouns = [(10, 18)]  # "Ana Bell" in the question
    x = qa_input(0, s, nouns, micro_tokenizer.mask_token_id, fact_spans_in_answer=[(21, 34)])
    masked_text = "".join(s.text[a:b] for (a, b), m in zip(s.offsets, x.masked) if m)
    assert masked_text.replace(" ", "") == "AnaBell"
    assert all(s.offsets[i][1] <= s.answer_span[0] for i, m in enumerate(x.masked) if m)  # never the answer
    assert x.scored == [label != -100 for label in s.labels]
    facts = "".join(s.text[a:b] for (a, b), f in zip(s.offsets, x.fact) if f)
    assert facts.replace(" ", "") == "Varo,Eldmark"
    assert len(x.masked_ids) == len(x.input_ids)  # aligned token for token
    assert [t for t, m in zip(x.masked_ids, x.masked) if m] == [micro_tokenizer.mask_token_id] * x.n_masked


def test_corpus_mode_masks_passage_nouns_and_scores_every_token(micro_tokenizer):
    text = "Ana Bell was born in Varo. She writes poems."
    x = corpus_input(0, micro_tokenizer, text, [(0, 8), (21, 25)], micro_tokenizer.mask_token_id)
    assert x.scored == [False] + [True] * (len(x.input_ids) - 1)
    assert x.n_masked >= 3


def _reference(model, x: AttributionInput):
    """Full logits of each sequence alone: the textbook computation."""
    with torch.no_grad():
        lo = torch.log_softmax(model(torch.tensor([x.input_ids])).logits[0].double(), -1)
        lm = torch.log_softmax(model(torch.tensor([x.masked_ids])).logits[0].double(), -1)
    pos = [i for i, s in enumerate(x.scored) if s]
    tgt = [x.input_ids[i] for i in pos]
    ref_o = lo[[p - 1 for p in pos], tgt].numpy()
    ref_m = lm[[p - 1 for p in pos], tgt].numpy()
    ref_h = -(lo.exp() * lo).sum(-1)[[p - 1 for p in pos]].numpy()
    return pos, ref_o, ref_m, ref_h


@pytest.mark.parametrize("chunk_size", [1, 3, 1024])
def test_signals_equal_the_full_logits_computation(micro_model_dir, micro_tokenizer, chunk_size):
    model = load_model(micro_model_dir).eval()
    tok = micro_tokenizer
    short = qa_input(0, encode_qa(tok, TEMPLATES["plain"], "Who?", "Ana."), [(0, 3)], tok.mask_token_id)
    long = qa_input(1, encode_qa(tok, TEMPLATES["plain"], Q, A), [(10, 18)], tok.mask_token_id)
    signals = score_batch(model, [short, long], tok.pad_token_id, chunk_size=chunk_size)  # padded batch
    for x, s in zip([short, long], signals):
        pos, ref_o, ref_m, ref_h = _reference(model, x)
        assert np.isnan(np.delete(s.logp_orig, pos)).all()
        assert s.logp_orig[pos] == pytest.approx(ref_o, abs=1e-4)
        assert s.logp_mask[pos] == pytest.approx(ref_m, abs=1e-4)
        assert s.delta[pos] == pytest.approx(np.abs(ref_o - ref_m), abs=1e-4)
        assert s.entropy[pos] == pytest.approx(ref_h, abs=1e-4)


def test_no_noun_means_zero_delta_and_phi_from_entropy(micro_model_dir, micro_tokenizer):
    model = load_model(micro_model_dir).eval()
    x = qa_input(0, encode_qa(micro_tokenizer, TEMPLATES["plain"], Q, A), [], micro_tokenizer.mask_token_id)
    s = add_phi(score_batch(model, [x], micro_tokenizer.pad_token_id)[0], alpha=0.7)
    scored = np.array(x.scored)
    assert (s.delta[scored] == 0).all()
    h = s.entropy[scored]
    assert s.phi[scored] == pytest.approx(0.3 * (h - h.min()) / (h.max() - h.min()))


def test_topr_counts_hand_case():
    score = np.array([0.9, 0.1, 0.8, 0.2, 0.3])
    fact = np.array([True, False, False, False, True])
    # top 40% = 2 tokens: positions 0 and 2; one of them is a fact; 2 facts in all
    assert topr_counts(score, fact, 0.4).tolist() == [2, 1, 2]


def test_logp_and_entropy_equal_the_log_softmax_formulas():
    from pipeline.attribution.signals import logp_and_entropy

    logits = torch.tensor([[2.0, 0.0, -1.0, 30.0], [0.0, 0.0, 0.0, 0.0]])
    targets = torch.tensor([1, 2])
    logp, entropy = logp_and_entropy(logits, targets)
    lsm = torch.log_softmax(logits, -1)
    torch.testing.assert_close(logp, lsm.gather(-1, targets[:, None])[:, 0])
    torch.testing.assert_close(entropy, -(lsm.exp() * lsm).sum(-1))
    assert abs(entropy[1].item() - np.log(4)) < 1e-6  # uniform over 4: log 4


def test_the_headline_metrics_are_the_counts_and_phis_precision_at_the_papers_r():
    from pipeline.attribution.quality import headline_metrics

    metrics = {"samples": 5, "scored_tokens": 40, "no_noun": 1, "tagger": "spacy", "config": {"alpha": 0.7},
               "quality": {"r=0.1": {"phi": {"precision": 0.9, "recall": 0.1}},
                           "r=0.2": {"phi": {"precision": 0.5, "recall": 0.4, "precision_ci": [0.1, 0.9]},
                                     "random": {"precision": 0.2, "recall": 0.1}}}}
    assert headline_metrics(metrics) == {"samples": 5, "scored_tokens": 40, "phi_precision": 0.5, "phi_recall": 0.4}
    assert headline_metrics({"samples": 5, "quality": {}}) == {"samples": 5}  # no annotations: counts only
