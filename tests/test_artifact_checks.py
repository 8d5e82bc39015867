"""Each artifact a stage reads is validated when it is read, before use: the attribution shards (unlearn's forget
stream, inspect) and the reference cache. A tampered, truncated, foreign or hand-made artifact is one DataError
naming the file and what is wrong, never a traceback or a run that trains on garbage."""

import json
import math
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from pipeline.attribution.inspect import find_sample, iter_samples
from pipeline.attribution.reference import ReferenceCache, ReferenceConfig, run_reference
from pipeline.attribution.shards import MANIFEST, _sha256
from pipeline.common.errors import DataError, ParamError
from pipeline.data.config import DataConfig, retain_samples
from pipeline.training.forget_stream import ForgetStream, Weighting

from tests.synthetic import write_synthetic_shards

ATTRIBUTION_META = {"tagger": "spacy", "alpha": 0.7}  # what an attribution manifest's metadata looks like


@pytest.fixture(scope="module")
def cache_source(micro_world_dir, micro_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("reference") / "cache"
    cfg = ReferenceConfig(model=str(micro_model_dir), top_k=8, layers=[1], batch_size=8, rows_per_shard=16)
    run_reference(cfg, DataConfig(source=str(micro_world_dir)), out, out.parent / "metrics.json")
    return out


@pytest.fixture
def cache(cache_source, tmp_path):
    """A copy of the reference cache to tamper with."""
    return shutil.copytree(cache_source, tmp_path / "cache")


@pytest.fixture
def shards(tmp_path):
    return write_synthetic_shards(tmp_path / "attr", n_samples=6, rows_per_shard=3, metadata=ATTRIBUTION_META)


def manifest_of(directory):
    return json.loads((directory / MANIFEST).read_text())


def write_manifest_of(directory, manifest):
    (directory / MANIFEST).write_text(json.dumps(manifest))


def rehash(directory):
    """What a tamperer does after editing a shard: the manifest's sha256 made to match again."""
    manifest = manifest_of(directory)
    for shard in manifest["shards"]:
        shard["sha256"] = _sha256(directory / shard["name"])
    write_manifest_of(directory, manifest)


def first_shard(directory):
    return directory / manifest_of(directory)["shards"][0]["name"]


def edit_shard(directory, edit, file=None):
    """Rewrite a shard (the first) as edit(table) and rehash the manifest; returns the shard's path."""
    file = file or first_shard(directory)
    pq.write_table(edit(pq.read_table(file)), file)
    rehash(directory)
    return file


def set_list(table, name, row, values):
    """`table` with row `row` of list column `name` replaced by `values`."""
    column = table.column(name).to_pylist()
    column[row] = values
    return table.set_column(table.schema.get_field_index(name), name,
                            pa.array(column, type=table.schema.field(name).type))


# Manifests are data: shard names stay inside the manifest's directory.

@pytest.mark.parametrize("name", ["../other/part-00000.parquet", "ABSOLUTE"])
def test_a_manifest_naming_a_shard_outside_its_directory_is_refused(shards, tmp_path, name):
    other = write_synthetic_shards(tmp_path / "other", n_samples=3, rows_per_shard=3, seed=1)
    name = str(other / "part-00000.parquet") if name == "ABSOLUTE" else name
    manifest = manifest_of(shards)
    manifest["shards"][0].update(name=name, sha256=_sha256(other / "part-00000.parquet"))
    write_manifest_of(shards, manifest)
    with pytest.raises(DataError, match=rf"{shards / MANIFEST}: shard name '{name}' is not a plain file name"):
        ForgetStream(shards, Weighting())


def test_a_shard_that_is_a_symlink_out_of_its_directory_is_refused(shards, cache, tmp_path):
    other = write_synthetic_shards(tmp_path / "other", n_samples=3, rows_per_shard=3, seed=1)
    for directory in (shards, cache):
        (directory / "link.parquet").symlink_to(other / "part-00000.parquet")
        manifest = manifest_of(directory)
        manifest["shards"][0]["name"] = "link.parquet"
        write_manifest_of(directory, manifest)
        rehash(directory)
    with pytest.raises(DataError, match=r"shard link.parquet is a link to .*other/part-00000.parquet, outside"):
        ForgetStream(shards, Weighting())
    with pytest.raises(DataError, match=r"shard link.parquet is a link to .*other/part-00000.parquet, outside"):
        ReferenceCache.load(cache)


def test_a_reference_manifest_naming_another_directory_is_refused(cache):
    manifest = manifest_of(cache)
    manifest["shards"][0]["name"] = "../elsewhere/" + manifest["shards"][0]["name"]
    write_manifest_of(cache, manifest)
    with pytest.raises(DataError, match=r"_manifest.json: shard name '\.\./elsewhere/.*' is not a plain file name"):
        ReferenceCache.load(cache)


@pytest.mark.parametrize("value, message", [(None, r"'shards' is null, not a list of shards"),
                                            ([{"name": "x.parquet"}], r"shards\[0\] is .*, not \{name, rows")])
def test_a_malformed_manifest_is_one_line(cache, shards, value, message):
    for directory in (cache, shards):
        manifest = manifest_of(directory)
        manifest["shards"] = value
        write_manifest_of(directory, manifest)
    with pytest.raises(DataError, match=rf"{cache / MANIFEST}: {message}"):
        ReferenceCache.load(cache)
    with pytest.raises(DataError, match=rf"{shards / MANIFEST}: {message}"):
        ForgetStream(shards, Weighting())


# Attribution shards: columns and their types, row counts, per-token lists.

def test_a_shard_without_a_column_names_the_file_and_the_columns(shards):
    file = edit_shard(shards, lambda t: t.drop_columns(["delta", "logp_orig"]))
    with pytest.raises(DataError, match=rf"^{file}: no column delta, logp_orig; rerun `attribute`$"):
        ForgetStream(shards, Weighting())
    with pytest.raises(DataError, match=rf"^{file}: no column delta; rerun `attribute`$"):
        find_sample(shards, 0)


def test_a_column_of_the_wrong_type_names_the_file_and_the_column(shards):
    second = shards / "part-00001.parquet"
    file = edit_shard(shards, lambda t: t.set_column(t.schema.get_field_index("entropy"), "entropy",
                                                     t.column("entropy").cast(pa.list_(pa.string()))), second)
    with pytest.raises(DataError, match=rf"^{file}: entropy is list<string>, not list<float>; rerun `attribute`$"):
        ForgetStream(shards, Weighting())
    with pytest.raises(DataError, match=rf"^{file}: entropy is list<string>, not list<float>"):
        list(iter_samples(shards))


def test_a_shard_with_fewer_rows_than_its_manifest_says_is_refused(shards):
    file = edit_shard(shards, lambda t: t.slice(0, 2))
    with pytest.raises(DataError, match=rf"^{file}: 2 rows, the manifest says 3"):
        ForgetStream(shards, Weighting())


def test_per_token_lists_of_another_length_or_bad_values_name_the_sample(shards):
    file = edit_shard(shards, lambda t: set_list(t, "delta", 1, [0.5] * 10))
    with pytest.raises(DataError, match=rf"^{file}: column 'delta' of sample 1 has 10 values for 48 tokens"):
        ForgetStream(shards, Weighting()).get([1])
    with pytest.raises(DataError, match=rf"^{file}: sample 1: column delta has 10 values for 48 tokens"):
        find_sample(shards, 1)


def test_forget_token_ids_outside_the_vocabulary_and_impossible_log_probs_are_refused(tmp_path):
    shards = write_synthetic_shards(tmp_path / "a", n_samples=3, rows_per_shard=3)
    file = edit_shard(shards, lambda t: set_list(t, "input_ids", 2, [-1] + t.column("input_ids")[2].as_py()[1:]))
    with pytest.raises(DataError, match=rf"^{file}: token id -1 is not in 0 or more \(sample 2, position 0"):
        ForgetStream(shards, Weighting()).get([2])
    shards = write_synthetic_shards(tmp_path / "b", n_samples=3, rows_per_shard=3, vocab=400)
    stream = ForgetStream(shards, Weighting())
    stream.vocab_size = 100  # what check_source records of a model with a smaller vocabulary
    with pytest.raises(DataError, match=r"token id \d+ is not in the model's vocabulary \(0\.\.99\)"):
        stream.get([0])
    shards = write_synthetic_shards(tmp_path / "c", n_samples=3, rows_per_shard=3)
    file = edit_shard(shards, lambda t: set_list(t, "logp_orig", 0, [5.0] * 48))
    with pytest.raises(DataError, match=rf"^{file}: column 'logp_orig' holds 5, a log-probability above 0 "
                                        r"\(sample 0, position 19"):
        ForgetStream(shards, Weighting()).get([0])


def test_unlearn_and_inspect_given_the_reference_cache_say_so(cache):
    with pytest.raises(DataError, match=rf"{cache}: not attribution shards \(a retain_reference directory: no "
                                        r"scored, delta, entropy columns\)"):
        list(iter_samples(cache))
    with pytest.raises(DataError, match=rf"no column scored, delta, entropy, logp_orig \({cache} is a reference "
                                        r"cache, not attribution shards: pass `tokenunlearn attribute`'s output"):
        ForgetStream(cache, Weighting())


# The reference cache.

def test_the_reference_stage_given_the_attribution_directory_says_so(shards):
    with pytest.raises(DataError, match=rf"^{shards}: not a reference cache \(attribution shards\); point it at "
                                        r"`tokenunlearn reference`'s output"):
        ReferenceCache.load(shards)


def test_a_truncated_cache_is_refused_even_with_a_rehashed_manifest(cache):
    rows = manifest_of(cache)["shards"][0]["rows"]
    file = edit_shard(cache, lambda t: t.slice(0, t.num_rows - 1))
    with pytest.raises(DataError, match=rf"^{file}: {rows - 1} rows, the manifest says {rows}; rerun `tokenunlearn "
                                        r"reference`$"):
        ReferenceCache.load(cache)
    manifest = manifest_of(cache)  # the row counts rewritten too: the summary still says how many samples
    manifest["shards"][0]["rows"] -= 1
    manifest["rows"] -= 1
    write_manifest_of(cache, manifest)
    with pytest.raises(DataError, match=r"_manifest.json: its shards hold \d+ samples, its summary says \d+: the cache "
                                        r"is incomplete"):
        ReferenceCache.load(cache)


def test_a_cut_file_is_not_readable_parquet_even_with_a_rehashed_manifest(cache, shards):
    for directory in (cache, shards):
        file = first_shard(directory)
        file.write_bytes(file.read_bytes()[:200])
        rehash(directory)
    with pytest.raises(DataError, match=rf"^{first_shard(cache)}: not a readable Parquet file \(.*\); rerun "
                                        r"`tokenunlearn reference`$"):
        ReferenceCache.load(cache)
    with pytest.raises(DataError, match=rf"^{first_shard(shards)}: not a readable Parquet file"):
        ForgetStream(shards, Weighting("hard"))  # the score's columns are looked up after the file is found readable
    with pytest.raises(DataError, match=rf"^{first_shard(shards)}: not a readable Parquet file"):
        find_sample(shards, 0)


def test_a_cut_list_names_the_shard_and_sample(cache):
    table = pq.read_table(first_shard(cache))
    ids = table.column("topk_ids")[3].as_py()
    sample, positions = table.column("sample_id")[3].as_py(), len(table.column("positions")[3].as_py())
    file = edit_shard(cache, lambda t: set_list(t, "topk_ids", 3, ids[:-5]))
    with pytest.raises(DataError, match=rf"^{file}: sample {sample}: topk_ids has {len(ids) - 5} values for "
                                        rf"{positions} positions × 8 \(truncated or edited\)"):
        ReferenceCache.load(cache)


@pytest.mark.parametrize("column, value, message", [
    ("topk_ids", 10**6, r"topk_ids holds token id 1000000, outside the vocabulary \(0\.\.\d+\)"),
    ("topk_ids", -3, r"topk_ids holds token id -3, outside the vocabulary \(0\.\.\d+\)"),
    ("positions", 500, r"position 500 is outside its \d+ tokens \(0\.\.\d+\)"),
    ("topk_logp", 2.5, r"topk_logp holds 2.5, not a log-probability \(finite, at most 0\)"),
    ("topk_logp", math.nan, r"topk_logp holds nan, not a log-probability \(finite, at most 0\)"),
    ("tail_logp", -math.inf, r"tail_logp holds -inf, not a log-probability \(finite, at most 0\)"),
])
def test_values_out_of_range_name_the_shard_sample_and_value(cache, column, value, message):
    table = pq.read_table(first_shard(cache))
    values, sample = table.column(column)[0].as_py(), table.column("sample_id")[0].as_py()
    file = edit_shard(cache, lambda t: set_list(t, column, 0, [value] + values[1:]))
    with pytest.raises(DataError, match=rf"^{file}: sample {sample}: {message}; rerun `tokenunlearn reference`$"):
        ReferenceCache.load(cache)


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.pop("top_k"), r"metadata top_k is null, not a positive integer"),
    (lambda m: m.update(layers="1"), r"metadata layers is \"1\", not a list of layer indices"),
    (lambda m: m.update(vocab_size=4), r"metadata vocab_size is 4, not an integer of at least top_k 8"),
])
def test_metadata_a_cache_is_read_with_is_checked(cache, edit, message):
    manifest = manifest_of(cache)
    edit(manifest["metadata"])
    write_manifest_of(cache, manifest)
    with pytest.raises(DataError, match=rf"^{cache / MANIFEST}: {message}; rerun `tokenunlearn reference`$"):
        ReferenceCache.load(cache)


def test_a_cache_must_hold_the_very_retain_data_and_vocabulary_it_is_used_with(cache, micro_world_dir,
                                                                              micro_tokenizer):
    retain = retain_samples(DataConfig(source=str(micro_world_dir)), micro_tokenizer, "retain90")
    loaded = ReferenceCache.load(cache)
    loaded.check(retain, "retain90", None, 1, vocab_size=len(micro_tokenizer))
    with pytest.raises(DataError, match=rf"^{cache}: the reference cache holds token id \d+, outside the model's "
                                        r"vocabulary of 5: it was made with another model"):
        loaded.check(retain, "retain90", None, 1, vocab_size=5)
    table = pq.read_table(first_shard(cache))
    ids, sample = table.column("input_ids")[0].as_py(), table.column("sample_id")[0].as_py()
    edit_shard(cache, lambda t: set_list(t, "input_ids", 0, [ids[0], ids[2], ids[1], *ids[3:]]))
    edited = ReferenceCache.load(cache)  # the metadata's fingerprint unchanged: the rows are what differ
    with pytest.raises(DataError, match=rf"holds other retain data than retain90 .*first difference at sample "
                                        rf"{sample}\)"):
        edited.check(retain, "retain90", None, None)


def test_reference_top_k_above_the_vocabulary_is_one_line_when_the_stage_starts(micro_world_dir, micro_model_dir,
                                                                                 tmp_path, capsys):
    from stages.cli import run

    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"data": {"source": str(micro_world_dir)},
                                      "reference": {"model": str(micro_model_dir)}}))
    out = tmp_path / "ref"
    code = run(["reference", "--params", str(params), "-S", "reference.top_k=100000", "--out", str(out),
                "--metrics", str(tmp_path / "m.json")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and not out.exists() and not any("Traceback" in line for line in err)
    vocab = json.loads((micro_model_dir / "config.json").read_text())["vocab_size"]
    assert err[-1:] == [f"tokenunlearn: error: reference.top_k=100000: more than the {vocab} tokens of "
                        f"{micro_model_dir}'s vocabulary; at most {vocab}"]
    with pytest.raises(ParamError, match=r"^reference.top_k=100000: more than the \d+ tokens"):
        run_reference(ReferenceConfig(model=str(micro_model_dir), top_k=100000),
                      DataConfig(source=str(micro_world_dir)), tmp_path / "ref2", None)
