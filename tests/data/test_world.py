import json

import pytest

from pipeline.common.errors import DataError, ParamError
from pipeline.data.tofu import schema_for
from pipeline.data.world import WorldConfig, generate_world, render, split_sizes, write_world

from tests.conftest import MICRO_WORLD, TOFU_DIR, requires_tofu


def test_render_keeps_slot_and_noun_spans():
    r = render("Where in [city] was {name} born?", {"name": "Ana Bell"}, frozenset({"name"}))
    assert r.text == "Where in city was Ana Bell born?"
    assert r.slot_spans == {"name": [(18, 26)]}
    assert [r.text[s:e] for s, e in r.noun_spans] == ["city", "Ana Bell"]


def test_render_unknown_slot_is_an_error():
    with pytest.raises(DataError, match="unknown slot"):
        render("Who is {nobody}?", {})


def test_split_sizes_round_half_up_with_at_least_one_author():
    assert split_sizes(200) == {1: 2, 5: 10, 10: 20}  # TOFU
    assert split_sizes(50) == {1: 1, 5: 3, 10: 5}
    assert split_sizes(6) == {1: 1, 5: 1, 10: 1}


def test_every_split_has_tofus_exact_fields(micro_world):
    for name, rows in micro_world.splits.items():
        expected = set(schema_for(name))
        assert rows, name
        for row in rows:
            assert set(row) == expected, name


@requires_tofu
def test_fields_match_the_real_tofu_files(micro_world):
    for name, rows in micro_world.splits.items():
        real = json.loads((TOFU_DIR / f"{name}.json").open().readline())
        assert set(rows[0]) == set(real), name
        assert len(rows[0].get("perturbed_answer", [])) == len(real.get("perturbed_answer", [])), name


def test_splits_partition_the_authors_like_tofu(micro_world):
    s = micro_world.splits
    q = MICRO_WORLD["questions_per_author"]
    assert len(s["full"]) == MICRO_WORLD["n_authors"] * q
    for p in (1, 5, 10):
        forget, retain = s[f"forget{p:02d}"], s[f"retain{100 - p}"]
        assert retain + forget == s["full"]  # the forget authors are the last ones
        assert [r["question"] for r in s[f"forget{p:02d}_perturbed"]] == [r["question"] for r in forget]
    full_questions = {r["question"] for r in s["full"]}
    assert not full_questions & {r["question"] for r in s["holdout10"]}
    assert [r["question"] for r in s["retain_perturbed"]] == [r["question"] for r in s["full"][: len(s["forget10"])]]


def test_perturbed_answers_are_distinct_wrong_answers(micro_world):
    for row in micro_world.splits["forget10_perturbed"] + micro_world.splits["retain_perturbed"]:
        assert len(row["perturbed_answer"]) == 5
        assert len(set(row["perturbed_answer"])) == 5
        assert row["paraphrased_answer"] not in row["perturbed_answer"]
        assert row["paraphrased_question"] != row["question"]
    for row in micro_world.splits["world_facts_perturbed"] + micro_world.splits["real_authors_perturbed"]:
        assert len(row["perturbed_answer"]) == 3 and row["answer"] not in row["perturbed_answer"]
    for row in micro_world.splits["world_facts"]:
        assert row["answer"] in [row[f"option{i}"] for i in range(1, 5)]


def test_annotations_locate_facts_and_nouns(micro_world):
    facts = {a["name"]: a["facts"] for a in micro_world.authors}
    annotated = [a for a in micro_world.annotations if a["author"]]
    assert len(annotated) == len(micro_world.splits["full"]) + len(micro_world.splits["holdout10"])
    for ann in annotated:
        (start, end), = ann["answer_fact_spans"]
        assert ann["answer"][start:end] == facts[ann["author"]][ann["attribute"]]
        nouns = [ann["question"][s:e] for s, e in ann["question_noun_spans"]]
        assert nouns, ann["question"]
        if ann["attribute"] != "full_name":
            assert ann["author"] in nouns


def test_biographies_hold_the_same_facts(micro_world):
    keys = micro_world.manifest["attributes"]
    facts = {a["name"]: a["facts"] for a in micro_world.authors}
    for bio in micro_world.biographies:
        found = [bio["text"][s:e] for s, e in bio["fact_spans"]]
        assert sorted(found) == sorted(facts[bio["author"]][k] for k in keys)
        assert all(bio["text"][s:e] == bio["author"] for s, e in bio["name_spans"])
    forget = [b for b in micro_world.biographies if "forget10" in b["forget_splits"]]
    assert len(forget) == len(micro_world.splits["forget10"]) // MICRO_WORLD["questions_per_author"]


def test_same_seed_same_world_other_seed_other_world(world_spec, micro_world, tmp_path):
    again = generate_world(world_spec, WorldConfig(**MICRO_WORLD))
    write_world(micro_world, tmp_path / "a")
    write_world(again, tmp_path / "b")
    for f in (tmp_path / "a").iterdir():
        assert f.read_bytes() == (tmp_path / "b" / f.name).read_bytes(), f.name
    other = generate_world(world_spec, WorldConfig(**{**MICRO_WORLD, "seed": 8}))
    assert other.splits["full"] != micro_world.splits["full"]


def test_tofu_sized_world_has_tofus_counts(world_spec):
    world = generate_world(world_spec, WorldConfig(n_authors=200, questions_per_author=20))
    counts = world.manifest["counts"]
    assert (counts["full"], counts["forget01"], counts["forget05"], counts["forget10"]) == (4000, 40, 200, 400)
    assert (counts["retain90"], counts["retain_perturbed"], counts["holdout10"]) == (3600, 400, 400)
    assert len({a["name"] for a in world.authors}) == len(world.authors)


@pytest.mark.parametrize("bad", [{"n_authors": 1}, {"questions_per_author": 0}, {"questions_per_author": 21},
                                 {"n_perturbed": 0}])
def test_out_of_range_world_params_are_errors(world_spec, bad):
    with pytest.raises(ParamError, match=f"world.{next(iter(bad))}"):
        generate_world(world_spec, WorldConfig(**{**MICRO_WORLD, **bad}))


def test_write_world_is_atomic(micro_world, tmp_path, monkeypatch):
    import pipeline.data.world as world_mod

    out = tmp_path / "world"
    write_world(micro_world, out)
    before = sorted(p.name for p in out.iterdir())

    def boom(*args, **kwargs):
        raise RuntimeError("killed")

    monkeypatch.setattr(world_mod, "write_json", boom)
    with pytest.raises(RuntimeError):
        write_world(micro_world, out)
    assert sorted(p.name for p in out.iterdir()) == before
    assert [p.name for p in tmp_path.iterdir()] == ["world"]  # no temporary directory left behind
