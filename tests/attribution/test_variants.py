"""Attribution variants: the scores on hand-computed cases, the extra signals against direct
computations, the stage with every signal, and stage two reading a variant."""

import json
import re

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from pipeline.attribution.quality import choose_variant, compare_variants, precision_recall
from pipeline.attribution.run import AttributionConfig, run_attribution
from pipeline.attribution.shards import read_table
from pipeline.attribution.signals import AttributionInput, score_batch
from pipeline.attribution.variants import (LearnedScorer, available_scores, copied_tokens, draw, exclude_copied,
                                           gradient_x_input, parse_score, per_noun_deltas, phrase_spans, pool_spans,
                                           score_columns, signals_for, span_ids, tokens_in, variant_score)
from pipeline.common.errors import DataError, ParamError
from pipeline.common.modeling import load_model
from pipeline.data.config import DataConfig
from pipeline.training.forget_stream import ForgetStream, Weighting

from tests.conftest import ATTRIBUTION

ALL_SIGNALS = ["copy", "span", "per_noun", "grad_x_input", "learned", "nouns"]


# --- names ---------------------------------------------------------------------------------------------------

def test_names_parse_into_a_base_and_modifiers_and_bad_ones_are_refused():
    assert parse_score("phi") == ("phi", ())
    assert parse_score("learned+nocopy+span") == ("learned", ("nocopy", "span"))
    assert score_columns("phi+nocopy+span") == ("copied", "span")
    assert score_columns("signed") == ("logp_orig", "logp_mask")
    assert signals_for("noun_min+span") == ["span", "per_noun"]
    for bad, words in (("phii", "unknown base score 'phii'"), ("phi+copy", "unknown modifier 'copy'"),
                       ("phi+span+span", "repeated"), ("phi+span+nocopy", "write 'phi\\+nocopy\\+span'")):
        with pytest.raises(ParamError, match=words):
            parse_score(bad)


def test_available_scores_follow_the_columns():
    assert available_scores({"delta", "entropy", "logp_orig", "logp_mask"}) == ["phi", "delta", "entropy", "signed"]
    names = available_scores({"delta", "entropy", "logp_orig", "logp_mask", "copied", "span", "learned"})
    assert "learned+nocopy+span" in names and "phi+span" in names and "grad_x_input" not in names


# --- scores on hand-computed cases ---------------------------------------------------------------------------

def test_signed_delta_keeps_only_what_the_context_raises():
    # log p − log p_masked = [+2, −3, 0, +1]: Δ⁺ = [2, 0, 0, 1] -> minmax [1, 0, 0, .5]; H = [0, 0, 1, 0]
    cols = {"logp_orig": np.array([-1.0, -4.0, -2.0, -1.0]), "logp_mask": np.array([-3.0, -1.0, -2.0, -2.0]),
            "delta": np.array([2.0, 3.0, 0.0, 1.0]), "entropy": np.array([0.0, 0.0, 1.0, 0.0])}
    np.testing.assert_allclose(variant_score("signed", cols, 0.5), [0.5, 0.0, 0.5, 0.25])
    # φ with |Δ| would put the token the context lowers first: minmax |Δ| = [2/3, 1, 0, 1/3]
    np.testing.assert_allclose(variant_score("phi", cols, 0.5), [1 / 3, 0.5, 0.5, 1 / 6])


def test_copied_tokens_score_zero_and_spans_share_their_maximum():
    score = np.array([0.9, 0.1, 0.6, 0.2, 0.0])
    np.testing.assert_allclose(exclude_copied(score, np.array([1, 0, 0, 0, 1])), [0, 0.1, 0.6, 0.2, 0])
    np.testing.assert_allclose(pool_spans(score, np.array([0, 0, 1, 1, -1])), [0.9, 0.9, 0.6, 0.6, 0.0])
    cols = {"delta": np.array([1.0, 0.0, 0.5, 0.0, 0.0]), "entropy": np.zeros(5),
            "copied": np.array([1.0, 0, 0, 0, 0]), "span": np.array([0.0, 1, 1, 2, -1])}
    # Δ-only φ = [1, 0, .5, 0, 0]; the copied first token drops to 0; the span [1, 2] shares .5
    np.testing.assert_allclose(variant_score("phi+nocopy+span", cols, 1.0), [0, 0.5, 0.5, 0, 0])


def _input(text: str, offsets, prompt=None, region=None) -> AttributionInput:
    n = len(offsets)
    return AttributionInput(0, text, list(range(n)), offsets, [True] * n, [False] * n, 0, prompt=prompt,
                            region=region)


def test_copied_tokens_are_words_of_the_question_or_of_earlier_text():
    text = "Q: Where was Ann Lee born? A: Ann Lee was born in Oslo."
    words = [(m.start(), m.end()) for m in re.finditer(r"\w+|[^\w\s]", text)]
    x = _input(text, words, prompt=(3, text.index("?") + 1))
    copied = dict(zip([text[s:e] for s, e in words[-7:]], copied_tokens(x)[-7:]))
    assert copied == {"Ann": True, "Lee": True, "was": True, "born": True, "in": False, "Oslo": False, ".": False}
    passage = "Ann Lee wrote. Ann Lee won."
    spans = [(m.start(), m.end()) for m in re.finditer(r"\w+|\.", passage)]
    assert copied_tokens(_input(passage, spans)) == [False, False, False, False, True, True, False, False]


def test_phrases_join_adjacent_content_words_and_tokens_take_their_span():
    text = "She won the Amber Leaf Prize in 1990, Oslo."
    content = [(text.index(w), text.index(w) + len(w)) for w in ("Amber", "Leaf", "Prize", "1990", "Oslo")]
    phrases = phrase_spans(content, text)
    assert [text[s:e] for s, e in phrases] == ["Amber Leaf Prize", "1990", "Oslo"]
    # tokens: "She", " won", " the", " Am", "ber", " Leaf", " Prize", ...: " Am" and "ber" are one word
    pieces = ["She", " won", " the", " Am", "ber", " Leaf", " Prize", " in", " 1990", ",", " Oslo", "."]
    offsets, pos = [], 0
    for p in pieces:
        start = pos + (1 if p.startswith(" ") else 0)
        offsets.append((start, pos + len(p)))
        pos += len(p)
    ids = span_ids(_input(text, offsets + [(len(text), len(text))]), phrases)
    assert ids[3:7] == [0, 0, 0, 0] and ids[8] == 1 and ids[10] == 2
    assert ids[0] != ids[1] and min(ids[:3]) >= 3  # words outside phrases: ids after the phrases'
    assert ids[-1] == -1  # an empty-offset (special) token
    # a special token mid-text whose offsets point past later words leaves them their spans
    mid = offsets[:3] + [(len(text), len(text))] + offsets[3:]
    assert span_ids(_input(text, mid), phrases)[4:8] == [0, 0, 0, 0]


def test_learned_scorer_ranks_a_separable_signal_first():
    rng = np.random.default_rng(0)
    labels = rng.random(400) < 0.25
    hidden = rng.normal(size=(400, 4)) + labels[:, None] * 3.0
    feats = LearnedScorer.features(hidden, rng.normal(size=(400, 4)), rng.random(400), rng.random(400),
                                   rng.random(400))
    scorer = LearnedScorer.fit(feats, labels)
    p = scorer.predict(feats)
    assert p[labels].mean() > 0.8 > 0.2 > p[~labels].mean()
    with pytest.raises(DataError, match="both fact and non-fact"):
        LearnedScorer.fit(feats, np.zeros(400, dtype=bool))


# --- extra passes against direct computations ----------------------------------------------------------------

def _model_inputs(micro_model_dir):
    model = load_model(str(micro_model_dir)).eval()
    # one sample, two nouns: tokens 1-2 and 4; tokens 6.. scored
    ids = [1, 20, 21, 30, 22, 31, 40, 41, 42, 43]
    x = AttributionInput(0, "", ids, [(0, 0)] * len(ids), [i >= 6 for i in range(len(ids))],
                         [i in (1, 2, 4) for i in range(len(ids))], mask_id=3, noun_tokens=[[1, 2], [4]])
    return model, x


def test_per_noun_delta_is_the_min_and_max_over_single_noun_masks(micro_model_dir):
    model, x = _model_inputs(micro_model_dir)
    whole = score_batch(model, [x], pad_id=0)[0]
    lo, hi = per_noun_deltas(model, [x], [whole.logp_orig], pad_id=0, batch_size=1)[0]
    singles = []
    for noun in x.noun_tokens:
        masked = [x.mask_id if i in noun else t for i, t in enumerate(x.input_ids)]
        one = AttributionInput(0, "", x.input_ids, x.offsets, x.scored,
                               [i in noun for i in range(len(masked))], x.mask_id)
        singles.append(score_batch(model, [one], pad_id=0)[0].delta)
    np.testing.assert_allclose(lo[6:], np.minimum(*singles)[6:], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(hi[6:], np.maximum(*singles)[6:], rtol=1e-5, atol=1e-6)
    assert np.isnan(lo[:6]).all()


def test_gradient_x_input_matches_autograd_on_the_full_logits(micro_model_dir):
    model, x = _model_inputs(micro_model_dir)
    gx = gradient_x_input(model, [x], pad_id=0)[0]
    ids = torch.tensor([x.input_ids])
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    logp = torch.log_softmax(model(inputs_embeds=embeds).logits.float(), -1)
    total = sum(logp[0, i - 1, x.input_ids[i]] for i in range(6, len(x.input_ids)))
    (grad,) = torch.autograd.grad(total, embeds)
    expected = (grad * embeds).sum(-1).abs()[0].detach().numpy()
    np.testing.assert_allclose(gx[6:], expected[6:], rtol=1e-4, atol=1e-6)
    assert gx[-1] == pytest.approx(0.0, abs=1e-7)  # the last token feeds no later prediction


# --- the stage and stage two ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def variant_shards(micro_world_dir, micro_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("variants")
    cfg = AttributionConfig(**{**ATTRIBUTION, "model": str(micro_model_dir), "signals": ALL_SIGNALS,
                               "learned_split": "retain90", "quality_r": [0.2]})
    run_attribution(cfg, DataConfig(source=str(micro_world_dir)), out / "shards", out / "metrics.json")
    return out


def test_every_signal_writes_its_columns_and_every_variant_is_measured(variant_shards):
    table = read_table(variant_shards / "shards")
    for column in ("copied", "span", "delta_noun_min", "delta_noun_max", "grad_x_input", "learned", "answer_noun"):
        assert column in table.column_names
    for row in table.to_pylist():
        scored = np.array(row["scored"])
        assert np.isnan(np.array(row["learned"], dtype=float)[~scored]).all()  # only scored tokens are scored
        assert not np.isnan(np.array(row["learned"], dtype=float)[scored]).any()
        assert any(c for c, s in zip(row["copied"], scored) if s)  # every answer repeats the author's name
    metrics = json.loads((variant_shards / "metrics.json").read_text())
    # every base with every set of modifiers: 8 bases x 4
    assert len(metrics["quality"]["variants"]) == 32 and "learned+nocopy+span" in metrics["quality"]["variants"]
    assert {"learned+nocopy+span", "noun_min", "grad_x_input", "random"} <= set(metrics["quality"]["r=0.2"])
    meta = json.loads(pq.read_schema(next((variant_shards / "shards").glob("*.parquet"))).metadata[b"tokenunlearn"])
    assert meta["signals"] == sorted(ALL_SIGNALS) and meta["learned"]["samples"] > 0
    assert (variant_shards / "shards" / "learned_scorer.safetensors").is_file()


def test_the_learned_scorer_never_trains_on_the_authors_it_scores(micro_world_dir, micro_model_dir, tmp_path):
    cfg = AttributionConfig(**{**ATTRIBUTION, "model": str(micro_model_dir), "signals": ["learned"],
                               "learned_split": "full"})
    with pytest.raises(ParamError, match="learned_split='full' shares .* author"):
        run_attribution(cfg, DataConfig(source=str(micro_world_dir)), tmp_path / "s", None)
    assert not (tmp_path / "s").exists()


def test_the_corpus_scorer_needs_to_know_whose_passages_it_trains_on(micro_world_dir, micro_model_dir, tmp_path):
    rows = [json.loads(line) for line in (micro_world_dir / "biographies.json").read_text().splitlines() if line]
    anonymous = tmp_path / "passages.json"
    anonymous.write_text("".join(json.dumps({"text": r["text"], "fact_spans": r["fact_spans"]}) + "\n" for r in rows))
    cfg = AttributionConfig(**{**ATTRIBUTION, "model": str(micro_model_dir), "mode": "corpus",
                               "corpus": str(anonymous), "signals": ["learned"]})
    with pytest.raises(ParamError, match="do not say whose they are"):
        run_attribution(cfg, DataConfig(source=str(micro_world_dir)), tmp_path / "s", None)
    assert not (tmp_path / "s").exists()


def test_uniform_weights_read_no_score(variant_shards):
    # a defaults.score inherited by a sequence-level run: its weights are 1, its recorded φ the paper's
    for sample in ForgetStream(variant_shards / "shards", Weighting("uniform", score="learned+span")):
        assert (sample.weights[sample.scored] == 1).all()
        assert np.isfinite(sample.phi[sample.scored]).all()
    assert Weighting("uniform", score="learned+span").used() == {"weighting": "uniform"}


def test_bad_signal_and_score_params_name_the_param():
    from pipeline.training.unlearn import UnlearnConfig

    for signals in (["copy", "copy"], ["copies"]):
        with pytest.raises(ParamError, match=r"attribution.signals=.*distinct signals"):
            AttributionConfig.from_params({"signals": signals})
    with pytest.raises(ParamError, match=r"unlearn.runs.t_ga.score='phi\+copy': unknown modifier 'copy'"):
        UnlearnConfig.from_params({"method": "ga", "weighting": "hard", "score": "phi+copy"}, "unlearn.runs.t_ga")


def test_stage_two_weights_by_the_chosen_variant(variant_shards, attribution_dir):
    stream = ForgetStream(variant_shards / "shards", Weighting("hard", r=0.2, score="learned+span"))
    table = {r["sample_id"]: r for r in read_table(variant_shards / "shards").to_pylist()}
    for sample in stream:
        row = table[sample.sample_id]
        scored = np.array(row["scored"])
        cols = {c: np.array(row[c], dtype=np.float64)[scored] for c in ("delta", "entropy", "learned", "span")}
        np.testing.assert_allclose(sample.phi[scored], variant_score("learned+span", cols, 0.7))
        assert sample.weights[scored].sum() == np.ceil(0.2 * scored.sum())
    # shards made without the signal: the error names what to compute
    with pytest.raises(DataError, match=r"score 'learned\+span' reads \['learned', 'span'\].*signals including "
                                        r"\['span', 'learned'\]"):
        ForgetStream(attribution_dir[0] / "shards", Weighting("hard", score="learned+span"))



def test_the_oracle_weights_the_annotated_facts_and_is_never_a_candidate(variant_shards):
    # a diagnostic: ω from the world's own fact tokens (what pushing only the facts does), never measured or chosen
    assert "oracle" not in available_scores({"delta", "entropy", "fact", "copied", "span"})
    assert signals_for("oracle") == [] and score_columns("oracle") == ("fact",)
    table = {r["sample_id"]: r for r in read_table(variant_shards / "shards").to_pylist()}
    mixed = 0
    for sample in ForgetStream(variant_shards / "shards", Weighting("soft", tau=0.5, score="oracle")):
        scored = np.array(table[sample.sample_id]["scored"])
        fact = np.array(table[sample.sample_id]["fact"])[scored]
        np.testing.assert_array_equal(sample.phi[scored], fact.astype(float))
        w = sample.weights[scored]
        if fact.any() and not fact.all():  # softmax(fact / 0.5): a fact token weighs e² times any other
            np.testing.assert_allclose(w[fact].min() / w[~fact].max(), np.exp(2.0))
            mixed += 1
    assert mixed > 0

# --- choosing and comparing ------------------------------------------------------------------------------------

def test_precision_recall_are_micro_averages_with_a_bootstrap_interval():
    counts = np.array([[2, 1, 2], [2, 2, 3]], dtype=float)  # selected, hits, facts per sample
    pr = precision_recall(counts, n_boot=200)
    assert pr["precision"] == pytest.approx(3 / 4) and pr["recall"] == pytest.approx(3 / 5)
    assert pr["precision_ci"][0] <= 0.75 <= pr["precision_ci"][1]
    assert 0.5 <= pr["precision_ci"][0] and pr["precision_ci"][1] <= 1.0


def test_the_choice_is_the_best_f1_on_the_choice_world_and_reported_on_the_other():
    def q(values):
        return {"fact_token_share": 0.2, "variants": list(values),
                "r=0.2": {n: {"precision": p, "recall": r, "precision_ci": [p, p], "recall_ci": [r, r]}
                          for n, (p, r) in values.items()}}

    choose = q({"phi": (0.5, 0.5), "learned": (0.9, 0.6), "entropy": (0.7, 0.7), "random": (0.2, 0.2)})
    assert choose_variant(choose)[0] == "learned"  # F1 .72 against .70
    held = q({"phi": (0.4, 0.4), "learned": (0.6, 0.6), "entropy": (0.8, 0.8), "random": (0.2, 0.2)})
    markdown, metrics = compare_variants({"qa": choose}, {"qa": held})
    assert metrics["qa"]["chosen"] == "learned" and metrics["qa"]["heldout"]["r=0.2"]["learned"]["precision"] == 0.6
    assert "**learned** (chosen)" in markdown and markdown.index("entropy") < markdown.index("**learned**")
    with pytest.raises(DataError, match=r"qa mode, choice world: no figures at r=0.3"):
        compare_variants({"qa": choose}, {"qa": held}, r_choice=0.3)
    without = q({"phi": (0.4, 0.4), "entropy": (0.8, 0.8)})
    with pytest.raises(DataError, match="'learned' was not measured on the held-out world"):
        compare_variants({"qa": choose}, {"qa": without})


def test_compare_attribution_names_a_metrics_file_without_quality(tmp_path):
    from stages.cli import run

    (tmp_path / "tofu.json").write_text(json.dumps({"samples": 3, "quality": None}))
    args = ["compare-attribution", "--choose", f"qa={tmp_path / 'tofu.json'}", "--report",
            f"qa={tmp_path / 'tofu.json'}", "--out", str(tmp_path / "v.md"), "--metrics", str(tmp_path / "v.json")]
    assert run(args) == 2
    assert not (tmp_path / "v.md").exists() and not (tmp_path / "v.json").exists()
    assert run([*args[:2], f"qa={tmp_path / 'none.json'}", *args[3:]]) == 2


def test_the_held_out_world_has_other_phrasings_and_authors():
    from pipeline.data.world import WorldConfig, WorldSpec, generate_world

    from tests.conftest import REPO

    default = generate_world(WorldSpec.load(REPO / "data/world"), WorldConfig(n_authors=10, seed=1234))
    held = generate_world(WorldSpec.load(REPO / "data/world", REPO / "data/world_heldout/templates.json"),
                          WorldConfig(n_authors=10, seed=4321))
    names = lambda w: {a["name"] for a in w.authors}  # noqa: E731
    assert not names(default) & names(held)
    templates = lambda path: {t for a in json.loads(path.read_text())["attributes"][:10]  # noqa: E731
                              for t in a["questions"] + a["answers"]}
    assert not templates(REPO / "data/world/templates.json") & templates(REPO / "data/world_heldout/templates.json")
    # every held-out answer still marks its fact: the ground truth the variants are measured on
    assert all(a["answer_fact_spans"] for a in held.annotations)


def test_the_random_control_draws_per_unlearning_seed_and_sample_at_the_same_budget(variant_shards):
    """Its tokens are i.i.d. uniform scores from (unlearning seed, sample): the same on a rerun, others for another
    seed, never read from the shards; hard weights select ceil(r·n) of them as for any score."""
    assert "random" not in available_scores({"delta", "entropy", "copied", "span"})
    assert score_columns("random") == () and score_columns("random+span") == ("span",)
    a, b = draw("random", 0, 7, 5)["random"], draw("random", 0, 7, 5)["random"]
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, draw("random", 1, 7, 5)["random"]) and not np.array_equal(a, draw("random", 0, 8, 5)
                                                                                             ["random"])
    assert draw("phi", 0, 7, 5) == {} and ((0 <= a) & (a < 1)).all()

    def weights(seed):
        return {s.sample_id: s.weights[s.scored] for s in ForgetStream(variant_shards / "shards",
                                                                       Weighting("hard", r=0.2, score="random"),
                                                                       seed=seed)}
    first, again, other = weights(0), weights(0), weights(1)
    assert all(np.array_equal(first[k], again[k]) for k in first)
    assert any(not np.array_equal(first[k], other[k]) for k in first)
    for w in first.values():  # the budget: ceil(0.2 n) tokens, as φ's
        assert w.sum() == max(1, int(np.ceil(0.2 * len(w))))


def test_etw_weighs_each_token_by_the_entropy_of_its_distribution(variant_shards):
    """ETW (score etw, weighting proportional): ω = H, θ_o's next-token entropy in nats, on every scored token."""
    assert "etw" not in available_scores({"delta", "entropy"}) and score_columns("etw") == ()
    table = {r["sample_id"]: r for r in read_table(variant_shards / "shards").to_pylist()}
    for sample in ForgetStream(variant_shards / "shards", Weighting("proportional", score="etw")):
        scored = np.array(table[sample.sample_id]["scored"])
        entropy = np.array(table[sample.sample_id]["entropy"], dtype=np.float64)[scored]
        np.testing.assert_allclose(sample.weights[scored], entropy)
        np.testing.assert_allclose(sample.phi[scored], entropy)
    assert Weighting("proportional", score="etw").used() == {"weighting": "proportional", "alpha": 0.7,
                                                              "score": "etw"}


def test_answer_nouns_weigh_the_answers_nouns_and_proper_nouns(variant_shards):
    """Tokens overlapping a tagged span (hand-made: "Ann Lee wrote poems." with spans on "Ann Lee" and "poems"),
    then the signal on the micro world: only answer tokens, and hard weights on nouns before any other token."""
    text = "Ann Lee wrote poems."
    x = AttributionInput(0, text, [0, 1, 2, 3, 4, 5], [(0, 3), (3, 7), (7, 13), (13, 17), (17, 19), (19, 20)],
                         [True] * 6, [False] * 6, 0)
    assert tokens_in(x, [(14, 19), (0, 7)]) == [True, True, False, True, True, False]  # " poe" + "ms" = "poems"
    assert tokens_in(x, []) == [False] * 6
    assert signals_for("answer_nouns") == ["nouns"] and "answer_nouns" not in available_scores(
        {"delta", "entropy", "answer_noun"})
    table = {r["sample_id"]: r for r in read_table(variant_shards / "shards").to_pylist()}
    with_nouns = 0
    for sample in ForgetStream(variant_shards / "shards", Weighting("hard", r=0.2, score="answer_nouns")):
        row = table[sample.sample_id]
        scored, noun = np.array(row["scored"]), np.array(row["answer_noun"])
        assert not (noun & ~scored).any()  # the answer's nouns: never a token of the question
        np.testing.assert_array_equal(sample.phi[scored], noun[scored].astype(float))
        selected = sample.weights[scored] > 0
        if noun[scored].sum() >= selected.sum():  # enough nouns for the budget: every selected token is one
            assert noun[scored][selected].all()
            with_nouns += 1
    assert with_nouns > 0
