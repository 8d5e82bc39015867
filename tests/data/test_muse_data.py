"""MUSE's layout: the hand-made copy in tests/fixtures/muse_mini (the hub's configs, splits, fields and file names), bad
files named by file, row and field, the hub's code path through `datasets`, and the embedded world in MUSE's shape."""

import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.common.errors import DataError, ParamError
from pipeline.data import muse
from pipeline.data.muse import QAPair, VerbmemItem, load_eval_sets, load_qa, load_rows, load_texts, load_verbmem

from tests.conftest import REPO

MINI = REPO / "tests" / "fixtures" / "muse_mini"


def test_the_hand_made_copy_reads_as_the_hub_lays_it_out():
    sets = load_eval_sets(MINI)
    assert sets.verbmem == [VerbmemItem("The council approved the new harbour bridge",
                                        "on Tuesday after a two-year dispute over its cost."),
                            VerbmemItem("Residents of Kelham said the flooding in March",
                                        "had destroyed the village's only bakery.")]
    # knowmem's columns are answer, question on the hub: read by name, not position
    assert sets.knowmem_forget[0] == QAPair("On which day was the harbour bridge approved?", "Tuesday")
    assert sets.knowmem_forget_icl == [QAPair("When will the bronze statue be returned?", "next spring")]
    assert [p.answer for p in sets.knowmem_retain] == ["a shortage of drivers", "forty years"]
    assert len(sets.knowmem_retain_icl) == 1 and len(sets.privleak_forget) == len(sets.privleak_holdout) == 2
    assert load_texts(MINI, "privleak", "retain") == load_texts(MINI, "raw", "retain2")
    # a split in two shards reads in shard order; the stale forget-qa.json beside the shards is never read
    holdout = load_texts(MINI, "raw", "holdout")
    assert len(holdout) == 3 and holdout[2].startswith("Scientists tagged")
    assert [p.question for p in load_qa(MINI, "forget_qa")][1] == "What did the flooding in Kelham destroy?"


def _copy(tmp_path):
    out = tmp_path / "muse"
    shutil.copytree(MINI, out)
    return out


def _rewrite(file, columns):
    pq.write_table(pa.table(columns), file)


def test_a_missing_field_names_the_file_row_and_field(tmp_path):
    root = _copy(tmp_path)
    file = root / "verbmem" / "forget-00000-of-00001.parquet"
    _rewrite(file, {"prompt": ["a", "b"], "ground_truth": ["c", "d"]})
    with pytest.raises(DataError, match=rf"{file}: row 1: missing field 'gt' \(the file's columns are "
                                        r"\['prompt', 'ground_truth'\]; MUSE's verbmem rows have prompt, gt\)"):
        load_verbmem(root)


@pytest.mark.parametrize("answers, message", [
    (pa.array([3, 4]), "row 1: field 'answer' must be a string, got int"),
    (pa.array(["Tuesday", None]), "row 2: field 'answer' is null"),
    (pa.array(["Tuesday", "  "]), "row 2: field 'answer' is empty"),
])
def test_a_bad_value_names_the_file_row_and_field(tmp_path, answers, message):
    root = _copy(tmp_path)
    file = root / "knowmem" / "forget_qa-00000-of-00001.parquet"
    _rewrite(file, {"answer": answers, "question": ["q1", "q2"]})
    with pytest.raises(DataError, match=f"{file}: {message}"):
        load_qa(root, "forget_qa")


def test_a_missing_split_config_or_source_is_named(tmp_path):
    root = _copy(tmp_path)
    with pytest.raises(DataError, match=r"knowmem: no retain2_qa-NNNNN-of-NNNNN.parquet, so no split 'retain2_qa' "
                                        r"of config 'knowmem' \(splits found: \['forget_qa', 'forget_qa_icl', "
                                        r"'retain_qa', 'retain_qa_icl'\]\)"):
        load_qa(root, "retain2_qa")
    shutil.rmtree(root / "privleak")
    with pytest.raises(DataError, match=r"no 'privleak' folder, so no MUSE config 'privleak' \(found \['knowmem', "
                                        r"'raw', 'verbmem'\]\)"):
        load_eval_sets(root)
    with pytest.raises(ParamError, match="MUSE config 'news': unknown"):
        load_rows(root, "news", "forget")
    with pytest.raises(ParamError, match="not a name"):
        load_rows(root, "raw", "../forget")
    with pytest.raises(DataError, match="a file, not a directory"):
        load_rows(root / "README.md", "raw", "forget")
    with pytest.raises(DataError, match=r"MUSE source '.*nowhere': no such directory"):
        load_rows(tmp_path / "nowhere", "raw", "forget")
    (root / "raw" / "forget-00000-of-00001.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match="forget-00000-of-00001.parquet: not a readable Parquet file"):
        load_texts(root, "raw", "forget")


def test_the_hub_path_reads_the_hub_layout_through_datasets_and_validates_its_rows(tmp_path, monkeypatch):
    """`muse-bench/MUSE-News` as `datasets` loads it, the hub's name pointed at the hand-made copy (the same
    layout and card); then a bad row from the hub, named by dataset, config, split, row and field."""
    import datasets

    import pipeline.common.paths as paths
    import pipeline.data.tofu as tofu

    real = datasets.load_dataset
    monkeypatch.setitem(paths._HUB, "reachable", True)  # no network probe
    monkeypatch.setattr(datasets, "load_dataset", lambda name, config, split: real(
        str(MINI) if name == "muse-bench/MUSE-News" else name, config, split=split, cache_dir=str(tmp_path)))
    assert load_qa("muse-bench/MUSE-News", "forget_qa") == load_qa(MINI, "forget_qa")
    assert load_texts("muse-bench/MUSE-News", "raw", "holdout") == load_texts(MINI, "raw", "holdout")

    monkeypatch.setattr(tofu, "load_hub_records", lambda *a: [{"prompt": "p", "gt": "g"}, {"prompt": "p"}])
    with pytest.raises(DataError, match=r"muse-bench/MUSE-Books\[verbmem/forget\]: row 2: missing field 'gt'"):
        load_verbmem("muse-bench/MUSE-Books")


def test_the_embedded_world_in_muses_shape_round_trips(micro_world, micro_world_dir, tmp_path):
    from pipeline.data.tofu import load_split

    out = tmp_path / "world_muse"
    summary = muse.write_world_as_muse(micro_world_dir, out, "forget10", n_icl=1)
    bios = {b["author"]: b for b in micro_world.biographies}
    authors = summary["authors"]
    assert authors["forget"] == [b["author"] for b in micro_world.biographies if "forget10" in b["forget_splits"]]
    assert {bios[a]["group"] for a in authors["holdout"]} == {"holdout"}  # no model is trained on them
    assert set(authors["holdout"]).isdisjoint(authors["forget"] + authors["retain1"] + authors["retain2"])
    assert set(authors["retain1"]).isdisjoint(authors["retain2"]) and authors["retain1"] and authors["retain2"]

    sets = load_eval_sets(out)  # the same loader as MUSE's own
    texts = lambda part: [bios[a]["text"] for a in authors[part]]  # noqa: E731
    for part in ("forget", "retain1", "retain2", "holdout"):
        assert load_texts(out, "raw", part) == texts(part)
    assert sets.privleak_forget == texts("forget") and sets.privleak_holdout == texts("holdout")
    assert load_texts(out, "privleak", "retain") == texts("retain2")
    assert [(p.question, p.answer) for p in sets.knowmem_forget] == \
        [(r["question"], r["answer"]) for r in load_split(micro_world_dir, "forget10")]
    retain2_questions = {n["question"] for n in micro_world.annotations if n["author"] in authors["retain2"]}
    assert {p.question for p in sets.knowmem_retain} <= retain2_questions
    assert len(sets.knowmem_retain) == len(sets.knowmem_forget)
    shots = sets.knowmem_forget_icl + sets.knowmem_retain_icl
    assert len(shots) == 2 and len(set(shots)) == 2
    assert {s.question for s in shots}.isdisjoint(p.question for p in sets.knowmem_forget + sets.knowmem_retain)
    for item, text in zip(sets.verbmem, texts("forget")):
        assert f"{item.prompt} {item.gt}" == text and item.prompt.endswith(".")
    assert "- config_name: verbmem" in (out / "README.md").read_text()


def test_a_passage_is_cut_at_the_sentence_boundary_nearest_its_middle(micro_world_dir, tmp_path):
    assert muse.verbmem_item("One. Two! Three? Four.") == VerbmemItem("One. Two!", "Three? Four.")
    assert muse.verbmem_item("One. Two. Three.") == VerbmemItem("One.", "Two. Three.")
    assert muse.verbmem_item("Only one sentence.") is None
    with pytest.raises(ParamError, match=r"forget split 'forget99': no author .* is in it \(its forget splits: "
                                         r"\['forget01', 'forget05', 'forget10'\]\)"):
        muse.world_as_muse(micro_world_dir, "forget99")
    with pytest.raises(ParamError, match=r"n_icl=9: the retain1 authors .* have 6 questions, fewer than the 18"):
        muse.world_as_muse(micro_world_dir, "forget10", n_icl=9)
