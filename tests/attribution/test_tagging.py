"""Noun taggers: spaCy on real TOFU questions, the real trankit package on an offline model cache, the tag cache."""

import json

import pytest

from pipeline.attribution.tagging import CachedTagger, SpacyTagger, TrankitTagger, make_tagger, tag_cache_file
from pipeline.common.errors import ParamError

from tests.conftest import TOFU_DIR, requires_tofu


@pytest.fixture(scope="module")
def spacy_tagger():
    return SpacyTagger()


def test_spacy_model_is_the_official_release(spacy_tagger):
    meta = spacy_tagger.nlp.meta
    assert meta["version"] == "3.8.0"
    assert meta["spacy_git_version"] == "5010fcbd3"
    assert "parser" not in spacy_tagger.nlp.pipe_names and "ner" not in spacy_tagger.nlp.pipe_names


def test_spacy_finds_the_nouns_of_a_question(spacy_tagger):
    text = "What genre does Ana Bell write in?"
    (spans,) = spacy_tagger.noun_spans([text])
    assert [text[s:e] for s, e in spans] == ["genre", "Ana", "Bell"]


@requires_tofu
def test_spacy_on_real_tofu_questions(spacy_tagger):
    from pipeline.data.tofu import load_split

    questions = [r["question"] for r in load_split(TOFU_DIR, "forget10")]
    spans = spacy_tagger.noun_spans(questions)
    assert len(spans) == len(questions)
    for q, s in zip(questions, spans):
        assert all(0 <= a < b <= len(q) and q[a:b].strip() == q[a:b] for a, b in s)
    assert sum(bool(s) for s in spans) >= 0.95 * len(questions)
    first = questions[0]  # "What is the full name of the author born in Taipei, Taiwan on 05/11/1991 ..."
    nouns = {first[a:b] for a, b in spans[0]}
    assert {"name", "author", "Taipei", "Taiwan"} <= nouns


@pytest.fixture(scope="module")
def fake_trankit_cache(tmp_path_factory):
    from tests.trankit_fake import build_fake_trankit_cache

    return build_fake_trankit_cache(tmp_path_factory.mktemp("trankit"))


def test_trankit_wrapper_on_the_real_package(fake_trankit_cache, capsys):
    from tests.trankit_fake import FAKE_UPOS

    text = "Where was Ana Bell born? She lives in Varo."
    everything = TrankitTagger(upos=FAKE_UPOS, cache_dir=fake_trankit_cache).noun_spans([text])[0]
    assert [text[s:e] for s, e in everything] == ["Where", "was", "Ana", "Bell", "born", "?", "She", "lives", "in",
                                                  "Varo", "."]
    tagger = TrankitTagger(cache_dir=fake_trankit_cache)
    doc = tagger.pipeline.posdep(text)
    expected = [tuple(t["dspan"]) for s in doc["sentences"] for t in s["tokens"] if t["upos"] in ("NOUN", "PROPN")]
    assert tagger.noun_spans([text])[0] == expected
    assert capsys.readouterr().out == ""  # trankit's printing stays out of the terminal


def test_auto_prefers_a_cached_trankit_and_falls_back_to_spacy(fake_trankit_cache, tmp_path):
    assert make_tagger("auto", trankit_cache=fake_trankit_cache).name == "trankit"
    assert make_tagger("auto", trankit_cache=tmp_path).name == "spacy"
    with pytest.raises(ParamError, match="no English model in .*tokenunlearn download-tagger"):
        TrankitTagger(cache_dir=tmp_path)
    with pytest.raises(ParamError, match="attribution.tagger='nltk'"):
        make_tagger("nltk")


class CountingTagger:
    name, version = "count", "1"

    def __init__(self):
        self.seen = []

    def noun_spans(self, texts):
        self.seen += texts
        return [[(0, len(t.split()[0]))] for t in texts]


def test_tags_are_cached_per_unique_text(tmp_path):
    inner = CountingTagger()
    file = tag_cache_file(inner, ["NOUN"], tmp_path)
    tagger = CachedTagger(inner, file)
    assert tagger.noun_spans(["Ana sings", "Bo runs", "Ana sings"]) == [[(0, 3)], [(0, 2)], [(0, 3)]]
    assert inner.seen == ["Ana sings", "Bo runs"]
    again = CachedTagger(CountingTagger(), file)  # a rerun reads the cache
    assert again.noun_spans(["Bo runs"]) == [[(0, 2)]] and again.tagger.seen == [] and again.hits == 1
    with open(file, "a") as f:
        f.write('{"key": "cut by a kill')
    assert CachedTagger(CountingTagger(), file).noun_spans(["Ana sings"]) == [[(0, 3)]]
    other_rank = tag_cache_file(inner, ["NOUN"], tmp_path, rank=1)
    other_rank.write_text(json.dumps({"key": CachedTagger.key("Cy hops"), "spans": [[0, 2]]}) + "\n")
    assert CachedTagger(CountingTagger(), file).noun_spans(["Cy hops"]) == [[(0, 2)]]
