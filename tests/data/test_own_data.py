"""A user's own forget/retain/holdout files: every format reads the same records, and every bad input is one line
naming the file, its key, the row or line and the field, with nothing written."""

import csv
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from pipeline.common.errors import DataError, ParamError
from pipeline.data.config import DataConfig
from pipeline.data.own_data import DataFile, check_lengths, read_records, write_splits
from pipeline.data.templates import encode_qa, get_template
from pipeline.data.tofu import load_passages, load_split

FORGET = [{"question": f"Where was the author Ana Lind {i} born?", "answer": f"She was born in Tartu, in year {i}."}
          for i in range(3)]
RETAIN = [{"question": f"What did the poet Jon Berg {i} write?", "answer": f"He wrote the book number {i}."}
          for i in range(3)]
HOLDOUT = [{"question": f"Which city is the painter Eva Moss {i} from?", "answer": f"She is from Riga {i}."}
           for i in range(2)]


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    """Each test in its own directory: the messages name the files as the params do, relative."""
    monkeypatch.chdir(tmp_path)


def jsonl(name: str, rows: list) -> str:
    Path(name).write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return name


def write_csv(name: str, rows: list[dict], rename: dict | None = None) -> str:
    rename = rename or {}
    with open(name, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, [rename.get(k, k) for k in rows[0]])
        writer.writeheader()
        writer.writerows({rename.get(k, k): v for k, v in r.items()} for r in rows)
    return name


def write_parquet(name: str, rows: list[dict]) -> str:
    pq.write_table(pa.Table.from_pylist(rows), name)
    return name


def config(**data) -> DataConfig:
    return DataConfig.from_params({"source": "out", "forget": jsonl("forget.jsonl", FORGET),
                                   "retain": jsonl("retain.jsonl", RETAIN), **data})


def refused(tokenizer, **data) -> str:
    """The one-line error of writing these files, after checking that nothing was written: no output directory,
    and no file (a datasets cache) beside the inputs."""
    cfg = config(**data)
    before = sorted(Path().rglob("*"))
    with pytest.raises(DataError) as e:
        write_splits(cfg, "out", tokenizer)
    assert not Path("out").exists() and sorted(Path().rglob("*")) == before
    assert "\n" not in str(e.value)
    return str(e.value)


# ---- reading ----------------------------------------------------------------------------------------------------

WRITERS = {
    "jsonl": lambda: jsonl("f.jsonl", FORGET),
    "json_array": lambda: Path("f.json").write_text(json.dumps(FORGET, indent=2)) and "f.json",
    "json_lines": lambda: jsonl("f.json", FORGET),
    "csv": lambda: write_csv("f.csv", FORGET),
    "parquet": lambda: write_parquet("f.parquet", FORGET),
}


@pytest.mark.parametrize("fmt", sorted(WRITERS))
def test_every_format_reads_the_same_records(fmt):
    path = WRITERS[fmt]()
    assert read_records(DataFile.from_params(path, "data.forget"), "data.forget") == FORGET
    assert sorted(p.name for p in Path().iterdir()) == [path]  # no cache beside the file


def test_a_field_map_reads_other_columns_and_drops_the_rest():
    rows = [{"id": i, "prompt": r["question"], "completion": r["answer"]} for i, r in enumerate(FORGET)]
    for path in (jsonl("f.jsonl", rows), write_csv("f.csv", rows), write_parquet("f.parquet", rows)):
        spec = DataFile.from_params({"path": path, "fields": {"question": "prompt", "answer": "completion"}}, "k")
        assert spec.kind == "qa" and read_records(spec, "k") == FORGET
    # a partial map: the other field keeps its own name
    partial = jsonl("p.jsonl", [{"prompt": r["question"], "answer": r["answer"]} for r in FORGET])
    assert read_records(DataFile.from_params({"path": partial, "fields": {"question": "prompt"}}, "k"), "k") == FORGET


def test_csv_values_are_read_as_written():
    """pandas would read 1984 as a number and NA as missing: a CSV's values are text."""
    write_csv("f.csv", [{"question": "Which year?", "answer": "1984"}, {"question": "Its code?", "answer": "NA"},
                        {"question": "A comma, here?", "answer": "Yes, \"quoted\".\nTwo lines."}])
    assert [r["answer"] for r in read_records(DataFile("f.csv"), "k")] == ["1984", "NA", "Yes, \"quoted\".\nTwo lines."]


def test_json_lines_split_at_newlines_only():
    rows = [{"question": "Line\u2028separator?", "answer": "Next\u0085line, form\x0cfeed."}, FORGET[0]]
    Path("f.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\r\n" for r in rows), encoding="utf-8")
    assert read_records(DataFile("f.jsonl"), "k") == rows


def test_passages_are_inferred_from_a_text_column_or_mapped():
    jsonl("p.jsonl", [{"text": "Ana Lind was born in Tartu."}, {"text": "She wrote two novels."}])
    spec = DataFile.from_params("p.jsonl", "data.forget")
    assert spec.kind == "qa" and spec.settled(["text"]).kind == "text"  # no field map: the file decides
    assert read_records(spec, "data.forget") == [{"text": "Ana Lind was born in Tartu."},
                                                 {"text": "She wrote two novels."}]
    mapped = DataFile.from_params({"path": write_csv("b.csv", [{"body": "A passage."}]), "fields": {"text": "body"}},
                                  "data.retain")
    assert mapped.kind == "text" and read_records(mapped, "data.retain") == [{"text": "A passage."}]


# ---- writing ----------------------------------------------------------------------------------------------------

def test_write_splits_writes_what_the_loaders_read(micro_tokenizer):
    write_csv("holdout.csv", HOLDOUT, rename={"question": "prompt", "answer": "completion"})
    cfg = config(holdout={"path": "holdout.csv", "fields": {"question": "prompt", "answer": "completion"}})
    manifest = write_splits(cfg, "out", micro_tokenizer)
    assert load_split("out", "forget") == FORGET and load_split("out", "retain") == RETAIN
    assert load_split("out", "holdout") == HOLDOUT
    assert sorted(p.name for p in Path("out").iterdir()) == ["forget.json", "holdout.json", "manifest.json",
                                                             "retain.json"]
    assert json.loads(Path("out/manifest.json").read_text()) == manifest
    import hashlib

    holdout = manifest["sets"]["holdout"]
    assert holdout == {"path": "holdout.csv", "sha256": hashlib.sha256(Path("holdout.csv").read_bytes()).hexdigest(),
                       "fields": {"question": "prompt", "answer": "completion"}, "kind": "qa",
                       "file": "holdout.json", "rows": 2, "rows_skipped": 0, "skipped_rows": []}
    # run again: its own output is replaced whole
    write_splits(config(), "out", micro_tokenizer)
    assert not Path("out/holdout.json").exists() and load_split("out", "forget") == FORGET


def test_passages_are_written_as_corpora(micro_tokenizer):
    jsonl("p.jsonl", [{"text": "Ana Lind was born in Tartu."}, {"text": "She wrote two novels."}])
    jsonl("q.jsonl", [{"text": "Jon Berg wrote poems."}])
    manifest = write_splits(config(forget="p.jsonl", retain="q.jsonl", template="passage"), "out", micro_tokenizer)
    assert {s["kind"] for s in manifest["sets"].values()} == {"text"}
    assert [p["text"] for p in load_passages("out/forget_corpus.jsonl")] == ["Ana Lind was born in Tartu.",
                                                                              "She wrote two novels."]
    assert [p["text"] for p in load_passages("out/retain_corpus.jsonl", forget=False)] == ["Jon Berg wrote poems."]
    # and each passage's verbatim probe: its first part prompts its rest (the cut nearest the middle)
    assert manifest["sets"]["forget"]["probes"] == "forget.json"
    assert load_split("out", "forget") == [{"question": "Ana Lind was", "answer": " born in Tartu."},
                                           {"question": "She wrote", "answer": " two novels."}]


@pytest.mark.parametrize("text, question, answer", [
    ("Ana Lind was born in Tartu. She wrote two novels. Both were translated.",  # the sentence end nearest the middle
     "Ana Lind was born in Tartu.", " She wrote two novels. Both were translated."),
    # a sentence end outside the middle third (an abbreviation, a short first sentence): the space nearest the middle
    ("Born 1950. Died 2001, in Tartu, Estonia.", "Born 1950. Died 2001,", " in Tartu, Estonia."),
    ("Dr. Smith went home and slept well tonight", "Dr. Smith went home", " and slept well tonight"),
    ("Ana Lind was born in Tartu.", "Ana Lind was", " born in Tartu."),  # one sentence: the space nearest the middle
    ("Two  words\n", "Two", "  words"),
    ("She wrote poems.\n\nHe wrote plays.", "She wrote poems.\n\n", "He wrote plays."),  # a line break: the prompt's
])
def test_a_passage_probe_is_cut_once_near_its_middle(text, question, answer):
    from pipeline.data.own_data import passage_probe

    assert passage_probe(text, "f") == {"question": question, "answer": answer}


def test_a_one_word_passage_or_a_request_of_two_kinds_is_refused(micro_tokenizer):
    jsonl("p.jsonl", [{"text": "Ana Lind was born in Tartu."}, {"text": "Tartu"}])
    assert refused(micro_tokenizer, forget="p.jsonl", retain=jsonl("q.jsonl", [{"text": "Jon Berg wrote."}]),
                   template="passage") == (
        "p.jsonl (data.forget): row 2: a passage of one word ('Tartu'): its first part prompts its rest in the "
        "evaluation, so it needs at least two words; make it longer or remove it")
    jsonl("p.jsonl", [{"text": "Ana Lind was born in Tartu."}])
    assert refused(micro_tokenizer, forget="p.jsonl", template="passage") == (
        "retain.jsonl (data.retain): holds question-answer pairs but data.forget holds passages; a request is of "
        "one kind, since the evaluation probes both sets the same way: give what to keep as passages")
    # passages without the passage overlay would be probed as question-answer pairs
    with pytest.raises(ParamError, match=r"^p.jsonl \(data.forget\): holds passages, and data.template is 'plain'; "
                                         r".*add --overlay configs/own-passages.yaml after configs/own-data.yaml$"):
        write_splits(config(forget="p.jsonl", retain=jsonl("q.jsonl", [{"text": "Jon Berg wrote."}])), "out",
                     micro_tokenizer)
    assert not Path("out").exists()


def test_the_benchmark_config_is_unchanged():
    cfg = DataConfig.from_params({"source": "artifacts/world", "template": "plain", "max_length": 128})
    assert (cfg.forget, cfg.retain, cfg.holdout) == ("", "", "")
    assert DataConfig.from_params({"forget": None, "retain": None, "holdout": None}).forget is None


# ---- bad params -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("data, message", [
    ({"forget": "f.txt", "retain": "r.jsonl"},
     "data.forget: 'f.txt': unsupported file type '.txt' (supported: .jsonl, .json, .csv, .parquet)"),
    ({"forget": {"path": "f.jsonl", "paht": "x"}, "retain": "r.jsonl"},
     "data.forget: unknown key(s) ['paht'] (known: ['fields', 'path'])"),
    ({"forget": {"fields": {"question": "q"}}, "retain": "r.jsonl"},
     "data.forget.path: missing; the mapping is {path: FILE, fields: {question: COLUMN, answer: COLUMN}}"),
    ({"forget": 5, "retain": "r.jsonl"},
     "data.forget=5: expected a file path, or a mapping {path: FILE, fields: {question: COLUMN, answer: COLUMN}}"),
    ({"forget": "f.jsonl", "retain": {"path": "r.csv", "fields": {"prompt": "q"}}},
     "data.retain.fields: unknown field(s) ['prompt']; the fields are question and answer (pairs) or text "
     "(passages), each mapped to a column of the file, e.g. {question: prompt, answer: completion}"),
    ({"forget": {"path": "f.csv", "fields": {"text": "t", "question": "q"}}, "retain": "r.jsonl"},
     "data.forget.fields: maps both text and ['question']; a file holds question-answer pairs (question, answer) "
     "or passages (text), not both"),
    ({"forget": {"path": "f.csv", "fields": {"question": "q", "answer": "q"}}, "retain": "r.jsonl"},
     "data.forget.fields: question and answer both read column 'q'; each field needs a column of its own"),
    ({"forget": "f.jsonl"},
     "data.retain: not set, but data.forget is; your own data is a file of what to forget (data.forget) and one of "
     "what to keep (data.retain), and optionally a holdout file (data.holdout)"),
    ({"retain": "r.jsonl", "holdout": "h.jsonl"},
     "data.forget: not set, but data.retain, data.holdout are; your own data is a file of what to forget "
     "(data.forget) and one of what to keep (data.retain), and optionally a holdout file (data.holdout)"),
])
def test_bad_params_are_one_line_naming_the_key(data, message):
    with pytest.raises(ParamError) as e:
        DataConfig.from_params(data)
    assert str(e.value) == message


# ---- bad files: one line each, nothing written --------------------------------------------------------------------

def test_missing_file(micro_tokenizer):
    assert refused(micro_tokenizer, forget="facts.jsonl") == \
        "facts.jsonl (data.forget): file not found; check the path (relative paths start where the command runs)"


def test_not_utf8(micro_tokenizer):
    Path("f.jsonl").write_bytes(b'{"question": "a", "answer": "b"}\n{"question": "caf\xe9", "answer": "d"}\n')
    assert refused(micro_tokenizer, forget="f.jsonl") == \
        ("f.jsonl (data.forget): not UTF-8 text: line 2, byte 18 of the line (offset 50 in the file) is 0xe9; "
         "save the file as UTF-8")


@pytest.mark.parametrize("name, text, message", [
    ("f.jsonl", '{"question": "a", "answer": "b"}\n{"question": "c", answer: "d"}\n',
     "line 2: malformed JSON (Expecting property name enclosed in double quotes, column 19)"),
    ("f.jsonl", '{"question": "a", "answer": "b"}\n["c", "d"]\n',
     "line 2: expected a JSON object with the fields, got list"),
    ("f.json", '[{"question": "a", "answer": "b"},\n {"question": "c" "answer": "d"}]',
     "line 2: malformed JSON (Expecting ',' delimiter, column 19)"),
    ("f.jsonl", '[\n {"question": "a", "answer": "b"}\n]\n',
     "one JSON array, not JSON Lines; name the file .json, or write one record a line"),
    ("f.json", '{"data": [\n {"question": "a", "answer": "b"}\n]}\n',
     "one JSON object, not records; write an array of records ([{...}, ...]) in a .json file, or JSON Lines "
     "(one record a line)"),
    ("f.csv", 'question,answer\na,b\nc,d,e\n',
     "line 3: malformed CSV (3 fields where the header has 2; quote a value that holds a comma)"),
    ("f.csv", 'question,answer\na,b\n"c,d\n', "line 3: malformed CSV (unexpected end of data)"),
    ("f.csv", 'question,question\na,b\n', "line 1: column 'question' appears twice in the header; give each column "
                                          "its own name"),
])
def test_malformed_json_or_csv_names_the_line(micro_tokenizer, name, text, message):
    Path(name).write_text(text, encoding="utf-8")
    assert refused(micro_tokenizer, forget=name) == f"{name} (data.forget): {message}"


@pytest.mark.parametrize("name, text, message", [
    ("f.jsonl", "", "empty file (no records); write one record a line (or a .json array)"),
    ("f.json", "[]", "no records (an empty array)"),
    ("f.csv", "question,answer\n", "no records (only a header)"),
])
def test_empty_file(micro_tokenizer, name, text, message):
    Path(name).write_text(text)
    assert refused(micro_tokenizer, forget=name) == f"{name} (data.forget): {message}"


def test_empty_or_broken_parquet(micro_tokenizer):
    write_parquet("e.parquet", [])
    assert refused(micro_tokenizer, forget="e.parquet") == "e.parquet (data.forget): no records (a Parquet file of 0 rows)"
    Path("b.parquet").write_text("question,answer\n")
    assert refused(micro_tokenizer, forget="b.parquet").startswith("b.parquet (data.forget): not a readable Parquet "
                                                                   "file (ArrowInvalid: ")


def test_a_field_map_naming_a_missing_column_lists_the_columns(micro_tokenizer):
    write_csv("keep.csv", RETAIN, rename={"question": "prompt", "answer": "completion"})
    assert refused(micro_tokenizer, retain={"path": "keep.csv", "fields": {"question": "prompt", "answer": "reply"}}) \
        == ("keep.csv (data.retain): no column 'reply' (field 'answer'); the file's columns: ['prompt', "
            "'completion']; correct data.retain.fields.answer")
    assert refused(micro_tokenizer, retain="keep.csv") == (
        "keep.csv (data.retain): no column 'question' (field 'question'); the file's columns: ['prompt', "
        "'completion']; map them: data.retain: {path: keep.csv, fields: {question: COLUMN, answer: COLUMN}} "
        "(passages: {text: COLUMN})")


@pytest.mark.parametrize("row, message", [
    ({"question": "q"}, "field 'answer' is missing or null; give it a value or remove the row"),
    ({"question": "q", "answer": None}, "field 'answer' is missing or null; give it a value or remove the row"),
    ({"question": "q", "answer": 42}, "field 'answer' must be a string, got int (42); write it as text"),
    ({"question": "q", "answer": ["a", "b"]}, "field 'answer' must be a string, got list ([\"a\", \"b\"]); write it "
                                              "as text"),
    ({"question": " \t", "answer": "a"}, "field 'question' is empty (or whitespace only); fill it in or remove the "
                                         "row"),
])
def test_a_bad_row_names_its_row_and_field(micro_tokenizer, row, message):
    jsonl("f.jsonl", [FORGET[0], row])
    assert refused(micro_tokenizer, forget="f.jsonl") == f"f.jsonl (data.forget): row 2: {message}"


def test_a_bad_row_in_a_mapped_csv_or_parquet(micro_tokenizer):
    write_csv("keep.csv", [*RETAIN, {"question": "Why?", "answer": ""}], rename={"answer": "completion"})
    assert refused(micro_tokenizer, retain={"path": "keep.csv", "fields": {"answer": "completion"}}) == \
        ("keep.csv (data.retain): row 4: field 'answer' (column 'completion') is empty (or whitespace only); fill it "
         "in or remove the row")
    write_parquet("h.parquet", [{"question": "Q?", "answer": 1}, {"question": "R?", "answer": 2}])
    assert refused(micro_tokenizer, holdout="h.parquet") == \
        "h.parquet (data.holdout): row 1: field 'answer' must be a string, got int (1); write it as text"


def test_a_datasets_failure_is_one_line_and_names_the_row_it_can(micro_tokenizer, monkeypatch):
    """An older datasets refuses a column of mixed types outright: the row is found from the parsed JSON."""
    import pipeline.data.own_files as own_files

    def refuse(*args):
        raise ValueError("Failed to convert\nsecond line")

    monkeypatch.setattr(own_files, "_load_dataset", refuse)
    jsonl("f.jsonl", [FORGET[0], {"question": "q", "answer": 5}])
    assert refused(micro_tokenizer, forget="f.jsonl") == \
        "f.jsonl (data.forget): row 2: field 'answer' must be a string, got int (5); write it as text"
    assert refused(micro_tokenizer, forget=write_csv("f.csv", FORGET)) == \
        "f.csv (data.forget): the datasets library could not read it (ValueError: Failed to convert)"


def test_a_duplicate_question_in_forget_or_holdout(micro_tokenizer):
    jsonl("f.jsonl", [*FORGET, {"question": FORGET[1]["question"].upper() + "  ", "answer": "Elsewhere."}])
    assert refused(micro_tokenizer, forget="f.jsonl") == \
        ("f.jsonl (data.forget): row 4 repeats the question of row 2 ('WHERE WAS THE AUTHOR ANA LIND 1 BORN?  '); "
         "remove one of them")
    jsonl("h.jsonl", [HOLDOUT[0], HOLDOUT[0]])
    assert refused(micro_tokenizer, holdout="h.jsonl") == \
        ("h.jsonl (data.holdout): row 2 repeats the question of row 1 ('Which city is the painter Eva Moss 0 from?'); "
         "remove one of them")


def test_a_question_in_two_sets_names_both_files(micro_tokenizer):
    write_csv("keep.csv", [*RETAIN, FORGET[2]])
    assert refused(micro_tokenizer, retain="keep.csv") == \
        ("forget.jsonl (data.forget) row 3 and keep.csv (data.retain) row 4: the same question ('Where was the "
         "author Ana Lind 2 born?'); remove it from one of them: what is forgotten cannot also be kept")
    jsonl("h.jsonl", [FORGET[0]])
    assert refused(micro_tokenizer, holdout="h.jsonl") == \
        ("forget.jsonl (data.forget) row 1 and h.jsonl (data.holdout) row 1: the same question ('Where was the author "
         "Ana Lind 0 born?'); remove it from one of them: the holdout set is never unlearned")


def test_a_10000_token_answer_is_one_line_and_tokenized_once(micro_tokenizer, monkeypatch):
    answer = " ".join(f"Tartu {i}" for i in range(2500))
    jsonl("f.jsonl", [FORGET[0], {"question": "Why?", "answer": answer}])
    n = len(encode_qa(micro_tokenizer, get_template("plain"), "Why?", answer))
    assert n >= 10_000
    calls = []
    real = type(micro_tokenizer).__call__

    def counting(self, text, *args, **kwargs):
        calls.append(len(text))
        return real(self, text, *args, **kwargs)

    monkeypatch.setattr(type(micro_tokenizer), "__call__", counting)
    assert refused(micro_tokenizer, forget="f.jsonl") == \
        (f"f.jsonl (data.forget): row 2: {n} tokens (prompt and answer) exceed data.max_length=128; shorten it, "
         "raise data.max_length, or set data.skip_too_long: true to skip and count such rows")
    assert sum(length > len(answer) // 2 for length in calls) == 1
    # skipped and counted with skip_too_long
    manifest = write_splits(config(forget="f.jsonl", skip_too_long=True), "out", micro_tokenizer)
    assert manifest["sets"]["forget"]["rows"] == 1 and manifest["sets"]["forget"]["skipped_rows"] == [2]
    assert load_split("out", "forget") == [FORGET[0]]


def test_check_lengths_of_passages(micro_tokenizer):
    rows = [{"text": "Short."}, {"text": "Tartu " * 400}]
    assert check_lengths(rows, micro_tokenizer, None, 128, "p.jsonl (data.forget)", skip_too_long=True) == \
        ([rows[0]], [2])
    with pytest.raises(DataError, match=r"^p.jsonl \(data.forget\): row 2: \d+ tokens \(the passage\) exceed "):
        check_lengths(rows, micro_tokenizer, None, 128, "p.jsonl (data.forget)")


def test_a_holdout_of_another_kind(micro_tokenizer):
    jsonl("p.jsonl", [{"text": "A passage."}])
    assert refused(micro_tokenizer, holdout="p.jsonl") == \
        ("p.jsonl (data.holdout): holds passages but data.forget holds question-answer pairs; the holdout set is of "
         "the forget set's kind (membership inference compares them)")


def test_a_directory_it_did_not_write_is_never_replaced(micro_tokenizer):
    Path("out").mkdir()
    Path("out/forget10.json").write_text("{}\n")
    with pytest.raises(DataError) as e:
        write_splits(config(), "out", micro_tokenizer)
    assert str(e.value) == ("out: a directory that own-data did not write (no own-data manifest.json in it), which "
                            "writing would replace; write your data to a new directory (data.source, or --out)")
    assert sorted(p.name for p in Path("out").iterdir()) == ["forget10.json"]
    jsonl("out/mine.jsonl", FORGET)
    with pytest.raises(DataError) as e:
        write_splits(config(forget="out/mine.jsonl"), "out", micro_tokenizer)
    assert str(e.value) == ("out/mine.jsonl (data.forget): inside the output directory out, which is replaced whole; "
                            "keep your files elsewhere, or write to another directory (data.source, or --out)")


# ---- the command ------------------------------------------------------------------------------------------------

def test_the_command_end_to_end(micro_tokenizer_dir, capsys):
    from stages.cli import run

    write_csv("keep.csv", RETAIN, rename={"question": "prompt", "answer": "completion"})
    params = {"data": {"source": "own", "forget": jsonl("facts.jsonl", FORGET),
                       "retain": {"path": "keep.csv", "fields": {"question": "prompt", "answer": "completion"}},
                       "holdout": jsonl("holdout.jsonl", HOLDOUT)},
              "attribution": {"model": str(micro_tokenizer_dir)}}
    Path("params.yaml").write_text(yaml.safe_dump(params))
    capsys.readouterr()
    assert run(["own-data"]) == 0
    assert load_split("own", "forget") == FORGET and load_split("own", "retain") == RETAIN
    assert load_split("own", "holdout") == HOLDOUT
    assert "retain: 3 qa row(s) from keep.csv -> own/retain.json" in capsys.readouterr().err
    assert run(["own-data", "--out", "elsewhere"]) == 0 and load_split("elsewhere", "holdout") == HOLDOUT

    jsonl("facts.jsonl", [*FORGET, {"question": "Why?", "answer": 7}])
    capsys.readouterr()
    assert run(["own-data", "--out", "new"]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("tokenunlearn: error:")]
    assert lines == ["tokenunlearn: error: facts.jsonl (data.forget): row 4: field 'answer' must be a string, got int "
                     "(7); write it as text"] and "Traceback" not in err
    assert not Path("new").exists()
