"""Multiple-choice sources: WMDP's subject (never guessed from a file name) and MMLU as it is redistributed (the
hub's Parquet, the original per-subject CSVs, CSVs with a header row), each bad input one error naming where."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.common.errors import DataError, ParamError
from pipeline.data.mc_items import MCItem
from pipeline.data.mmlu import load_mmlu
from pipeline.data.wmdp import load_wmdp

ROWS = [{"question": "Which agent?", "choices": ["a", "b", "c", "d"], "answer": 2},
        {"question": "Which port?", "choices": ["22", "80", "443", "8080"], "answer": 0}]


def _jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ------------------------------------------------------------------------------------------------------ WMDP

def test_a_wmdp_file_of_unknown_set_is_an_error_not_a_guessed_subject(tmp_path):
    path = _jsonl(tmp_path / "bio_questions.json", ROWS)  # once asked about "bio questions", silently
    with pytest.raises(DataError, match=r"bio_questions\.json: row 1: the prompt's subject is unknown .*"
                                        r"evaluate\.multiple_choice\.bio sets neither `subject:` nor `config:`\): "
                                        r"set `config:` \(one of wmdp-bio, wmdp-cyber, wmdp-chem\) or `subject:`"):
        load_wmdp(path, key="evaluate.multiple_choice.bio")
    assert {it.subject for it in load_wmdp(path, config="wmdp-bio")} == {"biology"}
    assert {it.subject for it in load_wmdp(path, subject="virology")} == {"virology"}
    assert {it.subject for it in load_wmdp(path, config="wmdp-chem", subject="organic chemistry")} == {
        "organic chemistry"}  # `subject:` is the prompt's phrase, whatever the config


@pytest.mark.parametrize("name, subject", [
    ("wmdp-bio.json", "biology"), ("wmdp_cyber.jsonl", "cybersecurity"),   # the config's or the harness task's name
    ("wmdp-chem/test-00000-of-00001.parquet", "chemistry"),               # the hub's layout: the folder names it
])
def test_a_file_named_like_a_wmdp_set_gets_the_harness_subject(tmp_path, name, subject):
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(ROWS), path)
    else:
        _jsonl(path, ROWS)
    assert [it.subject for it in load_wmdp(path)] == [subject, subject]


def test_record_subjects_and_a_row_without_one(tmp_path):
    path = _jsonl(tmp_path / "mine.jsonl", [{**ROWS[0], "subject": "genetics"}, {**ROWS[1], "subject": "networks"}])
    assert [it.subject for it in load_wmdp(path)] == ["genetics", "networks"]
    assert [it.subject for it in load_wmdp(path, config="wmdp-cyber")] == ["cybersecurity"] * 2  # the spec wins
    _jsonl(path, [{**ROWS[0], "subject": "genetics"}, ROWS[1]])
    with pytest.raises(DataError, match=r"mine\.jsonl: row 2: the prompt's subject is unknown"):
        load_wmdp(path)


def test_wmdp_configs_are_checked(tmp_path):
    path = _jsonl(tmp_path / "q.jsonl", ROWS)
    with pytest.raises(ParamError, match=r"evaluate\.multiple_choice\.w\.config: 'wmdp-physics' is not a WMDP set "
                                         r"\(choose from \['wmdp-bio', 'wmdp-chem', 'wmdp-cyber'\]\)"):
        load_wmdp(path, config="wmdp-physics", key="evaluate.multiple_choice.w")
    with pytest.raises(ParamError, match=r"'cais/wmdp' from the hub needs `config:`"):
        load_wmdp("cais/wmdp")


# ------------------------------------------------------------------------------------------------------ MMLU

def test_mmlu_as_the_hub_ships_it_parquet_with_integer_answers(tmp_path):
    path = tmp_path / "all" / "test-00000-of-00001.parquet"
    path.parent.mkdir()
    pq.write_table(pa.table({"question": ["Which bone?", "Is Z a field?"], "subject": ["anatomy", "abstract_algebra"],
                             "choices": [["femur", "tibia", "ulna", "rib"], ["yes", "no", "maybe", "never"]],
                             "answer": [3, 1]}), path)
    assert load_mmlu(path) == [MCItem("Which bone?", ["femur", "tibia", "ulna", "rib"], 3, "anatomy", index=0),
                               MCItem("Is Z a field?", ["yes", "no", "maybe", "never"], 1, "abstract algebra", index=1)]


def test_mmlu_original_release_data_folder_uses_its_test_folder(tmp_path):
    (tmp_path / "data" / "test").mkdir(parents=True)
    (tmp_path / "data" / "dev").mkdir()
    (tmp_path / "data" / "test" / "virology_test.csv").write_text("Which virus?,flu,cold,HIV,none,C\n")
    (tmp_path / "data" / "dev" / "virology_dev.csv").write_text("Dev question,a,b,c,d,A\n")
    assert load_mmlu(tmp_path / "data") == [MCItem("Which virus?", ["flu", "cold", "HIV", "none"], 2, "virology")]


@pytest.mark.parametrize("text", [
    # as exported from the hub with pandas (an index column), integer answers
    ",question,A,B,C,D,answer\n0,Which bone?,femur,tibia,ulna,rib,3\n1,\"Which, of these?\",w,x,y,z,0\n",
    # letters, any case of the header, any column order
    "Answer,Question,a,b,c,d\nD,Which bone?,femur,tibia,ulna,rib\nA,\"Which, of these?\",w,x,y,z\n",
])
def test_mmlu_csv_with_a_header_row(tmp_path, text):
    path = tmp_path / "anatomy_test.csv"  # no subject column: the file's name gives it
    path.write_text(text)
    assert load_mmlu(path) == [MCItem("Which bone?", ["femur", "tibia", "ulna", "rib"], 3, "anatomy", index=0),
                               MCItem("Which, of these?", ["w", "x", "y", "z"], 0, "anatomy", index=1)]


def test_mmlu_one_csv_of_every_subject_with_a_subject_column(tmp_path):
    # openai/simple-evals' mmlu.csv (and MMMLU's): an unnamed index column, capitalised names, a Subject column.
    path = tmp_path / "mmlu.csv"
    path.write_text("\ufeff,Question,A,B,C,D,Answer,Subject\n0,Which bone?,femur,tibia,ulna,rib,A,anatomy\n"
                    "1,Which virus?,flu,cold,HIV,none,C,virology\n"
                    "2,Is Z a field?,yes,no,maybe,never,B,abstract_algebra\n")
    items = load_mmlu(path)
    assert [(it.subject, it.answer, it.index) for it in items] == [("anatomy", 0, 0), ("virology", 2, 1),
                                                                   ("abstract algebra", 1, 2)]
    assert [it.index for it in load_mmlu(path, subjects=["virology", "abstract_algebra"])] == [1, 2]


@pytest.mark.parametrize("name, text, message", [
    ("anatomy_test.csv", "question,A,B,C,D,answer\nq,a,b,c,d,1\nq,a,b,c,d\n",
     r"anatomy_test\.csv: row 3: expected 6 columns, as its header, got 5"),
    ("anatomy_test.csv", "question,A,B,C,D,answer\nq,a,b,c,d,4\n",
     r"anatomy_test\.csv: row 2: field 'answer' must be a letter A-D or an index 0-3, got '4'"),
    ("anatomy_test.csv", "Question,Option A,Option B,Option C,Option D,Answer\nq,a,b,c,d,A\n",
     r"anatomy_test\.csv: row 1: field 'answer' must be .*, got 'Answer' \(or is this a header\? It must name "
     r"question, A, B, C, D, answer\)"),
    ("mmlu.csv", "q,a,b,c,d,A\n",
     r"mmlu\.csv: the prompt's subject is unknown: 'mmlu' is not one of MMLU's 57 subjects .*name it "
     r"<subject>_test\.csv"),
    ("all.csv", "question,A,B,C,D,answer,subject\nq,a,b,c,d,0, \n", r"all\.csv: row 2: field 'subject' is empty"),
    ("anatomy_test.csv", "", r"anatomy_test\.csv: an empty file"),
])
def test_bad_mmlu_csvs_name_the_file_and_row(tmp_path, name, text, message):
    (tmp_path / name).write_text(text)
    with pytest.raises(DataError, match=message):
        load_mmlu(tmp_path / name)


def test_mmlu_subjects_that_match_nothing_are_errors(tmp_path):
    (tmp_path / "anatomy_test.csv").write_text("Which bone?,femur,tibia,ulna,rib,A\n")
    (tmp_path / "virology_test.csv").write_text("Which virus?,flu,cold,HIV,none,C\n")
    assert [it.subject for it in load_mmlu(tmp_path, subjects=["virology"])] == ["virology"]
    with pytest.raises(ParamError, match=r"evaluate\.multiple_choice\.m\.subjects: \['astrology'\] match no question "
                                         r"of .* \(its subjects: anatomy, virology\)"):
        load_mmlu(tmp_path, subjects=["anatomy", "astrology"], key="evaluate.multiple_choice.m.subjects")
