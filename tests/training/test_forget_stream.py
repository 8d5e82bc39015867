"""Stage two's forget reader: streamed from the shards, bounded memory, a deterministic shuffled order."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.attribution.shards import _sha256, read_table
from pipeline.attribution.signals import attribution_score
from pipeline.attribution.weights import token_weights
from pipeline.common.errors import DataError
from pipeline.data.batching import StepSchedule
from pipeline.training.forget_batches import forget_batch, write_token_weights
from pipeline.training.forget_stream import ForgetStream, Weighting

from tests.synthetic import write_synthetic_shards


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_synthetic_shards(tmp_path_factory.mktemp("s") / "shards", n_samples=40, rows_per_shard=3)


def test_samples_carry_the_weights_of_this_run_computed_from_delta_and_entropy(shards):
    weighting = Weighting("hard", r=0.2, alpha=0.6)
    table = read_table(shards).to_pylist()
    stream = ForgetStream(shards, weighting)
    assert len(stream) == 40 and len(stream.files) == 14
    for row, sample in zip(table, stream.get(range(40))):
        scored = np.array(row["scored"])
        assert sample.sample_id == row["sample_id"] and sample.input_ids.tolist() == row["input_ids"]
        phi = attribution_score(np.array(row["delta"])[scored], np.array(row["entropy"])[scored], 0.6)
        assert sample.phi[scored] == pytest.approx(phi) and np.isnan(sample.phi[~scored]).all()
        assert sample.weights[scored].tolist() == token_weights("hard", phi, r=0.2).tolist()
        assert (sample.weights[~scored] == 0).all() and (sample.ref_logp[~scored] == 0).all()
        assert sample.ref_logp[scored] == pytest.approx(np.array(row["logp_orig"])[scored])


def test_epoch_order_is_a_seeded_permutation_shuffled_within_windows_of_shards(shards):
    stream = ForgetStream(shards, Weighting(), seed=3, window_shards=2)
    e0, e1 = stream.epoch_order(0).tolist(), stream.epoch_order(1).tolist()
    assert sorted(e0) == list(range(40)) and sorted(e1) == list(range(40)) and e0 != e1
    assert ForgetStream(shards, Weighting(), seed=3, window_shards=2).epoch_order(0).tolist() == e0
    # the first window holds exactly two shards' rows
    first = {int(np.searchsorted(stream.starts, i, side="right")) - 1 for i in e0[:6]}
    assert len(first) == 2


def test_an_epoch_decodes_each_shard_about_once_and_the_cache_stays_bounded(shards):
    stream = ForgetStream(shards, Weighting("soft"), seed=0, window_shards=2)
    schedule = StepSchedule(len(stream), 4, 1, 2, 0, order=stream.epoch_order)
    seen = []
    for step in range(schedule.steps_per_epoch):
        for rank in range(2):
            for idx in schedule.micro_batches(step, rank):
                batch = forget_batch(stream.get(idx), pad_id=0)
                assert batch["input_ids"].shape == (4, 48)
                assert len(stream._cache) <= stream.cache_size == 4
                seen += idx
    assert set(seen) == set(range(40))
    assert stream.decoded_shards <= len(stream.files) + 1  # +1: the last batch wraps to the first window


def test_the_weights_file_holds_every_sample_in_shard_order(shards, tmp_path):
    stream = ForgetStream(shards, Weighting("soft", tau=0.5))
    write_token_weights(stream, tmp_path / "w.parquet")
    table = pq.read_table(tmp_path / "w.parquet")
    assert table.column("sample_id").to_pylist() == list(range(40))
    assert all(sum(w) == pytest.approx(1.0) for w in table.column("weight").to_pylist())
    assert json.loads(table.schema.metadata[b"tokenunlearn"]) == {"weighting": "soft", "tau": 0.5, "alpha": 0.7,
                                                               "score": "phi"}
    write_token_weights(ForgetStream(shards, Weighting("uniform", tau=9.0)), tmp_path / "u.parquet")
    uniform = pq.read_table(tmp_path / "u.parquet").schema.metadata[b"tokenunlearn"]
    assert json.loads(uniform) == {"weighting": "uniform"}


def test_mix_spreads_a_share_of_the_weights_and_mix_zero_writes_the_same_weights_file(shards, tmp_path):
    for strategy in ("hard", "soft"):
        write_token_weights(ForgetStream(shards, Weighting(strategy)), tmp_path / f"{strategy}.parquet")
        write_token_weights(ForgetStream(shards, Weighting(strategy, mix=0.0)), tmp_path / f"{strategy}0.parquet")
        assert (tmp_path / f"{strategy}.parquet").read_bytes() == (tmp_path / f"{strategy}0.parquet").read_bytes()
    stream = ForgetStream(shards, Weighting("hard", r=0.2, mix=0.5))
    for sample in stream.get(range(40)):
        scored = sample.scored
        expected = token_weights("hard", sample.phi[scored], r=0.2, mix=0.5)
        assert sample.weights[scored].tolist() == expected.tolist() and (sample.weights[~scored] == 0).all()
        assert sample.weights[scored].sum() == pytest.approx(1.0) and sample.weights[scored].min() > 0
    write_token_weights(stream, tmp_path / "mix.parquet")
    meta = json.loads(pq.read_table(tmp_path / "mix.parquet").schema.metadata[b"tokenunlearn"])
    assert meta == {"weighting": "hard", "r": 0.2, "alpha": 0.7, "score": "phi", "mix": 0.5}


def test_a_sample_without_scored_tokens_names_the_shard(tmp_path):
    shards = write_synthetic_shards(tmp_path / "s", n_samples=2, rows_per_shard=2)
    file = shards / "part-00000.parquet"
    table = pq.read_table(file)
    scored = pa.array([[False] * 48] * 2, type=table.schema.field("scored").type)
    pq.write_table(table.set_column(table.schema.get_field_index("scored"), "scored", scored), file)
    manifest = json.loads((shards / "_manifest.json").read_text())
    manifest["shards"][0]["sha256"] = _sha256(file)  # a consistent directory, with bad content
    (shards / "_manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=r"part-00000.parquet: sample 0 has no scored token"):
        ForgetStream(shards, Weighting()).get([0])


def test_a_stream_for_a_preference_method_carries_each_samples_alternative_answer(alternatives_dir, tmp_path):
    shards = alternatives_dir[0] / "shards"
    table = {r["sample_id"]: r for r in read_table(shards).to_pylist()}
    stream = ForgetStream(shards, Weighting(), alternative="perturbed", method="altpo")
    samples = stream.get([0, 1, 2])
    for s in samples:
        row = table[s.sample_id]
        assert s.alternative.input_ids.tolist() == row["perturbed_ids"]
        assert s.alternative.scored.tolist() == row["perturbed_scored"]
        assert s.alternative.ref_logp == row["perturbed_logp"] < 0
    batch = forget_batch(samples, pad_id=0)
    alt = batch["alternative"]  # padded like the forget answers, θ_o's Σ log p per sample
    width = max(len(s.alternative.input_ids) for s in samples)
    assert alt["input_ids"].shape == alt["scored"].shape == alt["attention_mask"].shape == (3, width)
    assert alt["attention_mask"].sum(-1).tolist() == [len(s.alternative.input_ids) for s in samples]
    assert alt["ref_logp"].tolist() == pytest.approx([s.alternative.ref_logp for s in samples])
    assert "alternative" not in forget_batch(ForgetStream(shards, Weighting()).get([0, 1]), pad_id=0)
    # a corrupted score is refused naming the file, the sample and the column
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(shards, copy)
    first = sorted(copy.glob("*.parquet"))[0]
    t = pq.read_table(first)
    t = t.set_column(t.schema.get_field_index("idk_logp"), t.schema.field("idk_logp"),
                     pa.array([0.5] * t.num_rows, pa.float64()))
    pq.write_table(t, first)
    manifest = json.loads((copy / "_manifest.json").read_text())
    manifest["shards"][0]["sha256"] = _sha256(first)
    (copy / "_manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=rf"{first}: the idk answer of sample \d+: idk_logp is 0.5, not a "
                                        r"log-likelihood; rerun `attribute`"):
        ForgetStream(copy, Weighting(), alternative="idk", method="idkdpo").get([0])


def test_a_stream_for_undial_carries_theta_os_top_k_at_each_scored_token(alternatives_dir, tmp_path):
    import torch

    shards = alternatives_dir[0] / "shards"
    assert json.loads((shards / "_manifest.json").read_text())["metadata"]["teacher_top_k"] == 8
    table = {r["sample_id"]: r for r in read_table(shards).to_pylist()}
    samples = ForgetStream(shards, Weighting(), teacher=True, method="undial").get([0, 1, 2])
    for s in samples:
        row, n = table[s.sample_id], int(s.scored.sum())
        ids, logp, tail = s.teacher
        assert ids.shape == logp.shape == (n, 8) and tail.shape == (n,)
        assert ids.reshape(-1).tolist() == row["teacher_ids"]
        assert (np.diff(logp, axis=1) <= 0).all() and (logp <= 0).all()  # the top 8, most likely first
        # the top 8, the true token (logp_orig) and the tail hold θ_o's whole mass
        true = np.array(row["logp_orig"])[s.scored]
        in_top = (ids == s.input_ids[s.scored][:, None]).any(1)
        mass = np.exp(logp).sum(1) + np.where(in_top, 0, np.exp(true)) + np.exp(tail)
        assert mass == pytest.approx(np.ones(n), abs=1e-4)
    batch = forget_batch(samples, pad_id=0)
    width = batch["input_ids"].shape[1]
    assert batch["teacher_ids"].shape == batch["teacher_logp"].shape == (3, width, 8)
    for b, s in enumerate(samples):  # each scored token's teacher at its position, 0 elsewhere
        at = torch.from_numpy(np.flatnonzero(s.scored))
        assert batch["teacher_ids"][b, at].tolist() == s.teacher[0].tolist()
        assert batch["teacher_tail"][b].count_nonzero() <= len(at)
    assert "teacher_ids" not in forget_batch(ForgetStream(shards, Weighting()).get([0]), pad_id=0)
