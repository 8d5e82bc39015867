"""Stage one end to end on the micro world: shards, manifest, metadata, metrics, reruns, several processes."""

import hashlib
import json
import pyarrow.parquet as pq
import pytest
import yaml

from pipeline.attribution.run import AttributionConfig, mask_token_id, run_attribution
from pipeline.attribution.shards import MANIFEST, read_manifest, read_table
from pipeline.common.errors import DataError, ParamError
from pipeline.data.config import DataConfig

from tests.conftest import ATTRIBUTION, run_two_processes

SIGNALS = ["logp_orig", "logp_mask", "delta", "entropy", "phi"]


def same_rows(a, b) -> bool:
    """Equal tables, NaN equal to NaN (unscored positions hold NaN)."""
    return json.dumps(a.to_pylist()) == json.dumps(b.to_pylist())


def _config(model_dir, **kw):
    return AttributionConfig(**{**ATTRIBUTION, "model": str(model_dir), **kw})


def test_shards_manifest_and_metadata(attribution_dir, micro_world_dir):
    out, summary = attribution_dir
    manifest = read_manifest(out / "shards")
    n = len([line for line in (micro_world_dir / "forget10.json").read_text().splitlines() if line])
    assert manifest["rows"] == summary["samples"] == n
    assert len(manifest["shards"]) == (n + 1) // 2  # rows_per_shard: 2
    meta = json.loads(pq.read_schema(out / "shards" / manifest["shards"][0]["name"]).metadata[b"tokenunlearn"])
    for key in ("model_hash", "tokenizer_hash", "template", "tagger", "tagger_version", "mask_token", "alpha",
                "dataset_fingerprint", "code_version", "schema_version", "model"):
        assert key in meta, key
    assert meta["tagger"] == "spacy" and meta["alpha"] == 0.7 and meta["mask_token"] == "<mask>"


def test_rows_hold_aligned_per_token_lists(attribution_dir):
    table = read_table(attribution_dir[0] / "shards")
    for row in table.to_pylist():
        length = len(row["input_ids"])
        for col in ["positions", "token_start", "token_end", "scored", "masked", "fact", *SIGNALS]:
            assert len(row[col]) == length, col
        scored = [i for i, s in enumerate(row["scored"]) if s]
        assert scored and all(row["phi"][i] == row["phi"][i] for i in scored)  # not NaN where scored
        assert all(0 <= row["phi"][i] <= 1 for i in scored)
        assert any(row["masked"]), row["text"]
        assert any(row["fact"])


def test_plain_pyarrow_and_pandas_read_the_shards(attribution_dir):
    import pandas as pd
    import pyarrow.dataset as ds

    shards = attribution_dir[0] / "shards"
    table = ds.dataset(str(shards), format="parquet").to_table()
    df = pd.read_parquet(shards)
    assert len(df) == table.num_rows
    tokens = df.explode(["positions", "delta", "entropy", "phi", "scored"])
    assert tokens[tokens.scored.astype(bool)].phi.astype(float).between(0, 1).all()


def test_metrics_report_counts_and_quality(attribution_dir):
    metrics = json.loads((attribution_dir[0] / "metrics.json").read_text())
    assert metrics["no_noun"] == 0 and metrics["tagger"] == "spacy"
    quality = metrics["quality"]["r=0.2"]
    # without attribution.signals: the variants of the paper's columns alone, and a random choice
    assert set(quality) == {"phi", "delta", "entropy", "signed", "random"}
    assert all(0 <= v["precision"] <= 1 and 0 <= v["recall"] <= 1 for v in quality.values())


def test_rerun_gives_the_same_table_and_uses_the_tag_cache(attribution_dir, micro_world_dir, micro_model_dir,
                                                           tmp_path):
    data = DataConfig(source=str(micro_world_dir))
    run_attribution(_config(micro_model_dir), data, tmp_path / "again", None)
    assert same_rows(read_table(tmp_path / "again"), read_table(attribution_dir[0] / "shards"))
    metrics = json.loads((attribution_dir[0] / "metrics.json").read_text())
    assert metrics["samples"] == read_table(tmp_path / "again").num_rows


def test_readers_refuse_incomplete_or_altered_directories(attribution_dir, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(attribution_dir[0] / "shards", copy)
    first = sorted(copy.glob("*.parquet"))[0]
    first.write_bytes(first.read_bytes()[:-10] + b"0123456789")
    with pytest.raises(DataError, match="does not match the manifest's sha256"):
        read_table(copy)
    # the same damage with the manifest's sha256 rewritten to match: the footer is read before any reader's use
    manifest = json.loads((copy / MANIFEST).read_text())
    for shard in manifest["shards"]:
        if shard["name"] == first.name:
            shard["sha256"] = hashlib.sha256(first.read_bytes()).hexdigest()
    (copy / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=rf"{first.name}: not a readable Parquet file .*; rerun the stage that wrote"):
        read_table(copy)
    (copy / MANIFEST).unlink()
    with pytest.raises(DataError, match="no _manifest.json"):
        read_table(copy)


def test_alternatives_are_chosen_from_the_seed_and_scored_by_theta_o(alternatives_dir, attribution_dir,
                                                                     micro_world_dir, micro_model_dir):
    import torch

    from pipeline.attribution.alternatives import choose
    from pipeline.common.modeling import load_model
    from pipeline.data.idk import IDK_ANSWERS
    from pipeline.data.tofu import load_split

    shards = alternatives_dir[0] / "shards"
    manifest = read_manifest(shards)
    assert manifest["metadata"]["alternatives"] == ["idk", "perturbed"]
    assert manifest["metadata"]["alternatives_seed"] == 0
    rows, plain = read_table(shards).to_pylist(), read_table(attribution_dir[0] / "shards")
    forget = load_split(micro_world_dir, "forget10")
    perturbed = {r["question"]: r["perturbed_answer"] for r in load_split(micro_world_dir, "forget10_perturbed")}
    # the paper's columns are those of a run without alternatives: only columns are added
    assert same_rows(read_table(shards, plain.column_names), plain)
    model = load_model(str(micro_model_dir)).eval()
    for row in rows:
        question = forget[row["sample_id"]]["question"]
        assert row["idk_answer"] == IDK_ANSWERS[choose(0, "idk", question, len(IDK_ANSWERS))]
        options = perturbed[question]
        assert row["perturbed_answer"] == options[choose(0, "perturbed", question, len(options))]
        for kind in ("idk", "perturbed"):
            ids, scored = row[f"{kind}_ids"], row[f"{kind}_scored"]
            # the same prompt as the forget sample, then the alternative answer, scored from where the answer starts
            prompt = row["scored"].index(True)
            assert ids[:prompt] == row["input_ids"][:prompt] and scored.index(True) == prompt
            assert len(ids) == len(scored) and scored[-1]  # EOS is scored, as for the forget answer
            with torch.no_grad():  # θ_o's Σ log p of the scored tokens, computed here from the model itself
                logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
            expected = sum(logp[i - 1, ids[i]].item() for i in range(len(ids)) if scored[i])
            assert row[f"{kind}_logp"] == pytest.approx(expected, abs=1e-4)
    # another seed chooses other answers (for some question), and stage one's metadata says which
    assert any(choose(0, "idk", q["question"], len(IDK_ANSWERS)) != choose(1, "idk", q["question"], len(IDK_ANSWERS))
               for q in forget)
    # a pipeline without alternatives writes no such column or metadata (its shards as before they existed)
    assert not any(c.startswith(("idk_", "perturbed_")) for c in plain.column_names)
    assert "alternatives" not in read_manifest(attribution_dir[0] / "shards")["metadata"]
    metrics = json.loads((attribution_dir[0] / "metrics.json").read_text())
    assert "alternatives" not in metrics["config"]


def test_the_teacher_is_theta_os_top_k_and_the_rest_at_each_scored_token(alternatives_dir, attribution_dir,
                                                                        micro_model_dir):
    import numpy as np
    import torch

    from pipeline.common.modeling import load_model

    shards = alternatives_dir[0] / "shards"
    assert read_manifest(shards)["metadata"]["teacher_top_k"] == 8
    assert json.loads((alternatives_dir[0] / "metrics.json").read_text())["config"]["teacher_top_k"] == 8
    model = load_model(str(micro_model_dir)).eval()
    for row in read_table(shards).to_pylist()[:4]:
        ids, scored = row["input_ids"], np.array(row["scored"])
        at = np.flatnonzero(scored)
        with torch.no_grad():  # θ_o's next-token distributions, computed here from the model itself
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)[at - 1]
        top = torch.tensor(row["teacher_ids"]).view(len(at), 8)
        torch.testing.assert_close(torch.tensor(row["teacher_logp"]).view(len(at), 8).double(), logp.gather(-1, top),
                                   atol=1e-4, rtol=0)
        assert (logp.gather(-1, top)[:, -1:] >= logp.scatter(-1, top, -1e9).max(-1, keepdim=True).values - 1e-4).all()
        rest = logp.scatter(-1, top, float("-inf")).scatter(-1, torch.tensor(ids)[at][:, None], float("-inf"))
        torch.testing.assert_close(torch.tensor(row["teacher_tail"]).double(), torch.logsumexp(rest, -1).clamp(min=-30),
                                   atol=1e-4, rtol=0)
    # a pipeline without it writes no such column or metadata (its shards as before it existed)
    plain = read_table(attribution_dir[0] / "shards")
    assert not any(c.startswith("teacher_") for c in plain.column_names)
    assert "teacher_top_k" not in read_manifest(attribution_dir[0] / "shards")["metadata"]
    assert "teacher_top_k" not in json.loads((attribution_dir[0] / "metrics.json").read_text())["config"]


def test_alternatives_need_a_question_and_the_splits_perturbed_answers(micro_world_dir, micro_model_dir, tmp_path):
    with pytest.raises(ParamError, match=r"^attribution.alternatives=\['idk', 'nope'\]: must be a list of distinct "):
        AttributionConfig.from_params({"alternatives": ["idk", "nope"]})
    with pytest.raises(ParamError, match=r"^attribution.alternatives=\['idk'\]: alternative answers are answers to "
                                         r"a question; corpus mode has passages"):
        AttributionConfig.from_params({"mode": "corpus", "corpus": "c.json", "alternatives": ["idk"]})
    import shutil

    source = tmp_path / "world"  # a source without forget10_perturbed.json
    shutil.copytree(micro_world_dir, source)
    (source / "forget10_perturbed.json").unlink()
    with pytest.raises(DataError, match=r"forget10_perturbed.json: file not found"):
        run_attribution(_config(micro_model_dir, alternatives=["perturbed"]), DataConfig(source=str(source)),
                        tmp_path / "x", None)
    assert not (tmp_path / "x").exists()


def test_corpus_mode_on_biographies(micro_world_dir, micro_model_dir, tmp_path):
    cfg = _config(micro_model_dir, mode="corpus", corpus=str(micro_world_dir / "biographies.json"))
    summary = run_attribution(cfg, DataConfig(source=str(micro_world_dir), max_length=128), tmp_path / "c", None)
    rows = read_table(tmp_path / "c").to_pylist()
    assert summary["samples"] == len(rows) == 1  # one forget10 author in the micro world
    assert rows[0]["scored"][0] is False and all(rows[0]["scored"][1:])
    assert any(rows[0]["fact"]) and any(rows[0]["masked"])


def test_bad_inputs_are_clear_errors(micro_world_dir, micro_model_dir, micro_tokenizer, tmp_path):
    data = DataConfig(source=str(micro_world_dir))
    with pytest.raises(ParamError, match="attribution.mask_token='<nope>'"):
        mask_token_id(micro_tokenizer, "<nope>")
    with pytest.raises(ParamError, match="attribution.mode='words'"):
        AttributionConfig.from_params({"mode": "words"})
    bad_corpus = tmp_path / "corpus.json"
    bad_corpus.write_text('{"text": "A passage."}\n{"title": "no text"}\n')
    with pytest.raises(DataError, match=r"corpus.json: row 2: field 'text'"):
        run_attribution(_config(micro_model_dir, mode="corpus", corpus=str(bad_corpus)), data, tmp_path / "x", None)
    assert not (tmp_path / "x").exists()


def test_vocabulary_mismatch_is_refused(micro_world_dir, micro_tokenizer, tmp_path):
    from pipeline.common.modeling import build_model, save_model

    from tests.conftest import TINY_MODEL

    model = build_model(TINY_MODEL, micro_tokenizer, seed=0)
    model.resize_token_embeddings(100)
    save_model(model, micro_tokenizer, tmp_path / "small")
    with pytest.raises(DataError, match="the tokenizer has .* tokens but the model's embedding has 100 rows"):
        run_attribution(_config(tmp_path / "small"), DataConfig(source=str(micro_world_dir)), tmp_path / "o", None)


@pytest.mark.slow
def test_two_processes_equal_one(attribution_dir, micro_world_dir, micro_model_dir, tmp_path):
    params = {"data": {"source": str(micro_world_dir)},
              "attribution": {"model": str(micro_model_dir), "split": "forget10", "tagger": "spacy",
                              "batch_size": 2, "rows_per_shard": 2}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    proc = run_two_processes(["attribute", "--params", str(tmp_path / "params.yaml"), "--out", str(tmp_path / "two"),
                              "--metrics", str(tmp_path / "m.json")], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = [s["name"] for s in read_manifest(tmp_path / "two")["shards"]]
    assert any(n.startswith("part-r000") for n in names) and any(n.startswith("part-r001") for n in names)
    assert same_rows(read_table(tmp_path / "two"), read_table(attribution_dir[0] / "shards"))


def test_inspect_prints_weights_and_writes_a_heatmap(attribution_dir, tmp_path):
    from click.testing import CliRunner

    from pipeline.attribution.inspect import token_table
    from stages.cli import cli

    shards = str(attribution_dir[0] / "shards")
    result = CliRunner().invoke(cli, ["inspect", shards, "--sample", "1", "--r", "0.5", "--tau", "0.5",
                                      "--no-color"])
    assert result.exit_code == 0, result.output
    assert "[MASK]" in result.output and "phi" in result.output and "soft" in result.output
    row = read_table(attribution_dir[0] / "shards").to_pylist()[1]
    table = token_table(row, alpha=0.7, r=0.5, tau=0.5)
    assert sum(t["hard"] for t in table) == -(-len(table) // 2)  # ceil(r * n)
    assert sum(t["soft"] for t in table) == pytest.approx(1.0)
    page = tmp_path / "heat.html"
    result = CliRunner().invoke(cli, ["inspect", shards, "--html", str(page)])
    assert result.exit_code == 0, result.output
    assert page.read_text().count("<div class='s'>") == read_table(attribution_dir[0] / "shards").num_rows
