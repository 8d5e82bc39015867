import json

import pytest

from pipeline.common.errors import DataError
from pipeline.data.tofu import load_split

from tests.conftest import TOFU_DIR, requires_tofu

REAL_COUNTS = {
    "full": 4000, "forget01": 40, "forget05": 200, "forget10": 400, "retain90": 3600, "retain95": 3800,
    "retain99": 3960, "forget10_perturbed": 400, "retain_perturbed": 400, "real_authors_perturbed": 100,
    "world_facts_perturbed": 117, "world_facts": 117, "real_authors": 100, "holdout10": 400,
}


@requires_tofu
@pytest.mark.parametrize("split", sorted(REAL_COUNTS))
def test_loads_every_real_tofu_split(split):
    rows = load_split(TOFU_DIR, split)
    assert len(rows) == REAL_COUNTS[split]
    assert all(r["question"].strip() and r["answer"].strip() for r in rows)


@requires_tofu
def test_real_loader_reads_what_datasets_reads():
    import datasets

    ours = load_split(TOFU_DIR, "forget10_perturbed")
    theirs = datasets.load_dataset("json", data_files=str(TOFU_DIR / "forget10_perturbed.json"), split="train")
    assert ours == [dict(r) for r in theirs]


def test_generated_world_reads_like_the_hub_files(micro_world_dir):
    """`datasets` reads the generated files with the same features as real TOFU's."""
    import datasets

    ds = datasets.load_dataset("json", data_files=str(micro_world_dir / "forget10_perturbed.json"), split="train",
                               cache_dir=str(micro_world_dir.parent / "hf"))
    assert ds.features["perturbed_answer"].feature.dtype == "string"
    assert [dict(r) for r in ds] == load_split(micro_world_dir, "forget10_perturbed")


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path.parent


@pytest.mark.parametrize(
    "lines, message",
    [
        (['{"question": "q", "answer": "a"}', '{"question": "q2"'], r"forget10.json: row 2: malformed JSON"),
        (['{"question": "q", "answer": "a"}', '{"question": "q2"}'], r"forget10.json: row 2: missing field 'answer'"),
        (['{"question": 3, "answer": "a"}'], r"forget10.json: row 1: field 'question' must be a string"),
        (['{"question": "q", "answer": "  "}'], r"forget10.json: row 1: field 'answer' is empty"),
        (['["q", "a"]'], r"forget10.json: row 1: expected an object"),
        ([""], r"forget10.json: no records"),
    ],
)
def test_bad_rows_name_file_row_and_field(tmp_path, lines, message):
    source = _write(tmp_path / "forget10.json", lines)
    with pytest.raises(DataError, match=message):
        load_split(source, "forget10")


def test_perturbed_split_needs_a_list_of_strings(tmp_path):
    row = {"question": "q", "answer": "a", "paraphrased_answer": "p", "paraphrased_question": "pq",
           "perturbed_answer": "not a list"}
    source = _write(tmp_path / "forget10_perturbed.json", [json.dumps(row)])
    with pytest.raises(DataError, match="row 1: field 'perturbed_answer' must be a non-empty list of strings"):
        load_split(source, "forget10_perturbed")


def test_missing_file_and_unknown_source(tmp_path):
    with pytest.raises(DataError, match="forget05.json: file not found"):
        load_split(tmp_path, "forget05")
    with pytest.raises(DataError, match="no such directory"):
        load_split(tmp_path / "nope", "forget05")


def test_hub_failure_is_a_clear_error(monkeypatch):
    import datasets
    import huggingface_hub

    # Offline, as on a machine without the hub: fail at once instead of retrying the network.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataError, match="could not load split 'forget10' of 'nobody/no-such-dataset'"):
        load_split("nobody/no-such-dataset", "forget10")
