"""Inspecting attribution shards: token scores as a DataFrame with their text, the weights as stage two computes
them with the params' (or a run's) r, τ and α, and one clear error for a directory that is not attribution shards."""

import json
import logging
import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from click.testing import CliRunner

from pipeline.attribution.inspect import token_scores, weight_settings
from pipeline.attribution.shards import ShardWriter, write_manifest
from pipeline.common.errors import DataError
from pipeline.common.modeling import load_tokenizer, tokenizer_hash
from stages.cli import cli, run

NAN = float("nan")
TEXTS = ["Ann Lee won the Amber Leaf Prize.", "Ben wrote poems."]
# Per sample: (scored positions, Δ there, H there). H is constant in sample 0, so φ = α·minmax(Δ) there.
SCORES = [([2, 3, 4, 5], [0.0, 1.0, 2.0, 4.0], [1.0, 1.0, 1.0, 1.0]),
          ([1, 2], [3.0, 1.0], [0.0, 2.0])]


def _row(sample_id, tokenizer, text, scored_at, delta, entropy) -> dict:
    enc = tokenizer(text, return_offsets_mapping=True)
    n = len(enc["input_ids"])

    def full(values):  # the scored positions' values, NaN elsewhere
        return [values[scored_at.index(i)] if i in scored_at else NAN for i in range(n)]

    return {"sample_id": sample_id, "split": "forget", "text": text, "input_ids": enc["input_ids"],
            "positions": list(range(n)), "token_start": [s for s, _ in enc["offset_mapping"]],
            "token_end": [e for _, e in enc["offset_mapping"]], "scored": [i in scored_at for i in range(n)],
            "masked": [False] * n, "logp_orig": full([-1.0] * len(delta)), "logp_mask": full([-2.0] * len(delta)),
            "delta": full(delta), "entropy": full(entropy), "phi": full([0.0] * len(delta)), "fact": None}


@pytest.fixture
def shards(tmp_path, micro_tokenizer, micro_tokenizer_dir):
    """Two hand-made samples in the real shard format, made (the manifest says) with the micro tokenizer's model;
    beside them, files no reader should take for shards."""
    out = tmp_path / "attribution"
    out.mkdir()
    # the hash of the tokenizer as `inspect` loads it: the session's object may carry another test's padding or
    # truncation settings, which tokenizer_hash counts (a test order under pytest-xdist failed on it)
    metadata = {"model": str(micro_tokenizer_dir),
                "tokenizer_hash": tokenizer_hash(load_tokenizer(str(micro_tokenizer_dir)))}
    writer = ShardWriter(out, "part", 1, metadata)
    for i, (text, (at, delta, entropy)) in enumerate(zip(TEXTS, SCORES)):
        writer.add(_row(i, micro_tokenizer, text, at, delta, entropy))
    write_manifest(out, writer.close(), metadata, {})
    (out / "learned_scorer.safetensors").write_bytes(b"not parquet")
    pq.write_table(pa.table({"other": [1]}), out / "stray.parquet")  # not in the manifest: never read
    return out


def test_token_scores_are_one_row_per_scored_token_with_its_text_and_weights(shards, micro_tokenizer):
    df = token_scores(shards, r=0.5, tau=0.5, alpha=0.7)
    assert list(df.columns) == ["sample_id", "position", "token_id", "token", "delta", "entropy", "phi", "hard",
                                "soft"]
    assert df.sample_id.tolist() == [0, 0, 0, 0, 1, 1] and df.position.tolist() == [2, 3, 4, 5, 1, 2]
    ids = micro_tokenizer(TEXTS[0])["input_ids"]
    assert df.token_id[:4].tolist() == ids[2:6]
    assert df.token[:4].tolist() == [micro_tokenizer.decode([i]) for i in ids[2:6]]
    assert "".join(df.token[:4]).strip() == micro_tokenizer.decode(ids[2:6]).strip()  # the text, not ids
    sample0 = df[df.sample_id == 0]
    assert sample0.phi.tolist() == pytest.approx([0.0, 0.175, 0.35, 0.7])  # 0.7·minmax([0, 1, 2, 4]), H constant
    assert sample0.hard.tolist() == [0, 0, 1, 1]  # the top r = 0.5 of 4 tokens
    e = [math.exp(p / 0.5) for p in (0.0, 0.175, 0.35, 0.7)]
    assert sample0.soft.tolist() == pytest.approx([x / sum(e) for x in e])
    # sample 1: minmax(Δ) = [1, 0], minmax(H) = [0, 1]: φ = [0.7, 0.3]; the top one of two at r = 0.2
    assert df[df.sample_id == 1].phi.tolist() == pytest.approx([0.7, 0.3])
    assert df[df.sample_id == 1].hard.tolist() == [1, 0]
    assert df.groupby("sample_id").soft.sum().tolist() == pytest.approx([1.0, 1.0])
    assert token_scores(shards, r=0.2, alpha=1.0).phi.tolist() == pytest.approx([0, 0.25, 0.5, 1, 1, 0])


def test_the_weights_come_from_the_score_named(shards):
    df = token_scores(shards, r=0.5, score="entropy")  # sample 1: minmax(H) = [0, 1] where φ = [0.7, 0.3]
    assert df[df.sample_id == 1].score.tolist() == [0.0, 1.0] and df[df.sample_id == 1].hard.tolist() == [0, 1]
    assert df[df.sample_id == 1].phi.tolist() == pytest.approx([0.7, 0.3])  # φ beside it, as the paper's


def test_the_tokenizer_must_be_the_one_the_shards_were_made_with(shards, micro_tokenizer):
    manifest = json.loads((shards / "_manifest.json").read_text())
    manifest["metadata"]["tokenizer_hash"] = "0123456789abcdef"
    (shards / "_manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match="the shards were made with tokenizer_hash 0123456789abcdef"):
        token_scores(shards)
    manifest["metadata"]["model"] = "artifacts/models/elsewhere"  # relative to where `attribute` ran
    (shards / "_manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match="elsewhere': no such file or directory; it is the model the shards' manifest "
                                        "names: pass tokenizer= its directory"):
        token_scores(shards)
    del manifest["metadata"]["tokenizer_hash"], manifest["metadata"]["model"]
    (shards / "_manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match="names no model to read their tokenizer from; pass tokenizer="):
        token_scores(shards)
    assert len(token_scores(shards, tokenizer=micro_tokenizer)) == 6


PARAMS = {"unlearn": {
    "defaults": {"retain_split": "retain90"},
    "weightings": {"uniform": {}, "hard": {"r": 0.5, "alpha": 0.7, "score": "phi"},
                   "soft": {"tau": 0.25, "alpha": 0.7, "score": "phi"}},
    "methods": {"npo": {"beta": 0.1}},
    "runs": {"npo": {"method": "npo", "weighting": "uniform"}, "t_npo": {"method": "npo", "weighting": "hard"},
             "t_npo_r25": {"method": "npo", "weighting": "hard", "r": 0.25, "alpha": 1.0, "train": {"lr": 1e-4}}}}}


def test_weights_come_from_the_weightings_a_run_or_the_flags():
    from pipeline.training.unlearn import run_spec

    shown = weight_settings(PARAMS)
    assert (shown.r, shown.tau, shown.alpha, shown.score) == (0.5, 0.25, 0.7, "phi")
    run = weight_settings(PARAMS, "t_npo_r25", run_spec(PARAMS, "t_npo_r25"))
    assert (run.r, run.tau, run.alpha) == (0.25, 0.25, 1.0)
    assert run.title == "run t_npo_r25: hard weights, the top r = 0.25 of phi (α = 1.0): column hard"
    flags = weight_settings(PARAMS, "t_npo_r25", run_spec(PARAMS, "t_npo_r25"), r=0.75, tau=2.0, alpha=0.0)
    assert (flags.r, flags.tau, flags.alpha) == (0.75, 2.0, 0.0)
    assert flags.title.endswith("the top r = 0.75 of phi (α = 0.0): column hard (--r, --tau, --alpha given over "
                                "the run's)")
    assert "uniform weights, ω = 1" in weight_settings(PARAMS, "npo", run_spec(PARAMS, "npo")).title


def test_one_alpha_for_both_columns_is_said_where_the_soft_weighting_reads_another(caplog):
    params = {"unlearn": {**PARAMS["unlearn"], "weightings": {"hard": {"r": 0.2, "alpha": 0.7},
                                                              "soft": {"tau": 0.5, "alpha": 0.5}}}}
    with caplog.at_level(logging.WARNING, logger="pipeline.attribution.inspect"):
        assert weight_settings(params).alpha == 0.7
    assert "unlearn.weightings.soft.alpha=0.5 differs from unlearn.weightings.hard.alpha=0.7" in caplog.text


def test_inspect_shows_a_runs_weights_from_the_params(shards, tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump(PARAMS))
    args = ["inspect", str(shards), "--params", str(params), "--sample", "0", "--no-color"]
    result = CliRunner().invoke(cli, [*args, "--run", "t_npo_r25"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[1] == "run t_npo_r25: hard weights, the top r = 0.25 of phi (α = 1.0): column hard"
    table = [line.split() for line in lines[lines.index("") + 2:]]
    assert [t[0] for t in table] == ["2", "3", "4", "5"]
    assert [t[-3] for t in table] == ["0.000", "0.250", "0.500", "1.000"]  # φ with α = 1
    assert [t[-2] for t in table] == ["0", "0", "0", "1"]                 # the top r = 0.25 of 4: one token
    default = CliRunner().invoke(cli, args)
    assert default.output.splitlines()[1] == "weights: hard top r = 0.5, soft τ = 0.25, of phi (α = 0.7)"
    assert [line.split()[-2] for line in default.output.splitlines()[-4:]] == ["0", "0", "1", "1"]
    assert "unlearn.weightings.hard" in CliRunner().invoke(cli, ["inspect", "--help"]).output


def test_inspect_of_a_directory_that_is_not_attribution_shards_is_one_line(tmp_path, capsys):
    ref = tmp_path / "reference"
    ref.mkdir()
    writer = ShardWriter(ref, "part", 8, {"kind": "retain_reference"},
                         pa.schema([("sample_id", pa.int64()), ("topk_ids", pa.list_(pa.int32()))]))
    writer.add({"sample_id": 0, "topk_ids": [1, 2]})
    write_manifest(ref, writer.close(), {"kind": "retain_reference"}, {})
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump(PARAMS))
    assert run(["inspect", str(ref), "--params", str(params), "--r", "0.2", "--tau", "1", "--alpha", "0.5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"tokenunlearn: error: {ref}: not attribution shards (a retain_reference directory: no "
                   "input_ids, scored, delta, entropy columns); point it at `tokenunlearn attribute`'s output, "
                   "e.g. artifacts/attribution"]
