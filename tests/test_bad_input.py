"""Bad input and faults, as a new user meets them: each gives one clear line naming the file, row, key or output
(and what to do), or a correct result; never a traceback, a half-written artifact or a silently wrong result."""

import errno
import json
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from pipeline.common.errors import DataError, ParamError
from pipeline.data.config import DataConfig

from tests.conftest import ATTRIBUTION, TINY_MODEL, killed_at_step, load_weights, micro_params

TRAIN = {"epochs": 1, "lr": 1e-3, "micro_batch_size": 2, "warmup_ratio": 0.0, "seed": 0}


def run_cli(args: list[str], capsys) -> tuple[int, str]:
    """The command line in this process (so a test can plant a fault), as `tokenunlearn ARGS` runs it."""
    from stages.cli import run

    capsys.readouterr()
    status = run(args)
    return status, capsys.readouterr().err


def one_error_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.startswith("tokenunlearn: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def stage_params(tmp_path, world_dir, model_dir, **sections) -> str:
    """A params file for the micro world's attribution and unlearning stages."""
    params = {
        "data": {"source": str(world_dir), "template": "plain", "max_length": 128},
        "attribution": {**ATTRIBUTION, "model": str(model_dir)},
        "unlearn": {"model": str(model_dir), "seeds": [0], "train": TRAIN, "defaults": {"rmu_layer": 2},
                    "runs": {"ga": {"method": "ga", "weighting": "hard"}}},
    }
    for name, value in sections.items():
        params[name] = {**params.get(name, {}), **value}
    file = tmp_path / "params.yaml"
    file.write_text(yaml.safe_dump(params))
    return str(file)


def world_copy(world_dir, tmp_path, edit=None):
    """A copy of the micro world with `edit(rows)` applied to forget10.json."""
    out = tmp_path / "world"
    shutil.copytree(world_dir, out)
    if edit is not None:
        file = out / "forget10.json"
        rows = [json.loads(line) for line in file.read_text().splitlines()]
        file.write_text("".join(json.dumps(r) + "\n" for r in edit(rows)))
    return out


# ---- resume and checkpoints --------------------------------------------------------------------------------

class Planted:
    """Unpickling this runs code: it creates a marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_resume_never_unpickles_a_planted_checkpoint(micro_world_dir, micro_tokenizer_dir, tmp_path):
    import torch

    from pipeline.training.checkpoints import CheckpointRefused
    from pipeline.training.finetune import job_from_params, run_finetune

    job = job_from_params(micro_params(micro_world_dir, micro_tokenizer_dir, checkpoint_every=1), "m")
    with killed_at_step(3):
        run_finetune(job, tmp_path / "model", tmp_path / "ckpt", tmp_path / "loss.csv", resume=True)
    latest = (tmp_path / "ckpt" / "latest").read_text().strip()
    states = tmp_path / "ckpt" / latest / "mp_rank_00_model_states.pt"
    state = torch.load(states, weights_only=False)  # the test's own file
    state["planted"] = Planted(tmp_path / "pwned")
    torch.save(state, states)
    with pytest.raises(CheckpointRefused, match=r"mp_rank_00_model_states.pt: refused to load: it holds objects "
                                                r"other than weights .* Delete the checkpoint directory"):
        run_finetune(job, tmp_path / "model", tmp_path / "ckpt", tmp_path / "loss.csv", resume=True)
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "model").exists()


def test_a_killed_multi_seed_run_is_incomplete_and_a_rerun_finishes_only_what_is_missing(
        attribution_dir, micro_model_dir, micro_world_dir, tmp_path, monkeypatch):
    import pipeline.training.unlearn as unlearn_mod
    from pipeline.common.runs import complete_seeds
    from pipeline.evaluation.config import EvalConfig
    from pipeline.evaluation.evaluate import evaluate_path
    from pipeline.training.engine import TrainConfig
    from pipeline.training.unlearn import UnlearnConfig, run_unlearn_seeds

    cfg = UnlearnConfig.from_params({"method": "ga", "weighting": "hard", "rmu_layer": 2}, "u")
    args = ("ga", cfg, TrainConfig.from_params(TRAIN, "t"), DataConfig(source=str(micro_world_dir)),
            str(micro_model_dir), attribution_dir[0] / "shards", tmp_path / "ga", tmp_path / "ckpt", tmp_path / "plots")
    real, ran = unlearn_mod.run_unlearn, []

    def killed_at_seed_1(name, c, train, *rest):
        if train.seed == 1:
            raise KeyboardInterrupt
        ran.append(train.seed)
        return real(name, c, train, *rest)

    monkeypatch.setattr(unlearn_mod, "run_unlearn", killed_at_seed_1)
    with pytest.raises(KeyboardInterrupt):
        run_unlearn_seeds(*args, seeds=[0, 1], resume=True)
    assert (tmp_path / "ga" / "seed0" / "model").is_dir()  # seed 0 finished, seed 1 did not
    with pytest.raises(DataError, match=r"ga: the unlearning run is incomplete \(no complete.json; seeds finished: "
                                        r"\[0\]\): finish it with `tokenunlearn unlearn ga`"):
        evaluate_path(str(tmp_path / "ga"), EvalConfig(source=str(micro_world_dir)), tmp_path / "eval", None,
                      name="ga")
    assert not (tmp_path / "eval").exists()

    monkeypatch.setattr(unlearn_mod, "run_unlearn", lambda name, c, train, *rest: ran.append(train.seed) or real(
        name, c, train, *rest))
    first = load_weights(tmp_path / "ga" / "seed0" / "model")
    run_unlearn_seeds(*args, seeds=[0, 1], resume=True)
    assert ran == [0, 1]  # the rerun trained seed 1 only
    assert sorted(complete_seeds(tmp_path / "ga")) == [0, 1]
    assert load_weights(tmp_path / "ga" / "seed0" / "model").keys() == first.keys()

    # unlearn.seeds shrunk to [1] (a DVC stage keeps its outputs): seed 1 is kept as it was, seed 0 is removed
    ran.clear()
    run_unlearn_seeds(*args, seeds=[1], resume=True, whole_set=True)
    assert ran == [] and sorted(complete_seeds(tmp_path / "ga")) == [1]
    assert sorted(p.name for p in (tmp_path / "ga").glob("seed*")) == ["seed1"]
    assert sorted(p.name for p in (tmp_path / "plots").glob("seed*")) == ["seed1.csv", "seed1.timing.csv"]


# ---- empty and duplicate data ------------------------------------------------------------------------------

def test_an_empty_split_is_an_error_in_attribute_and_finetune(micro_world_dir, micro_model_dir, micro_tokenizer_dir,
                                                              tmp_path):
    from pipeline.attribution.run import AttributionConfig, run_attribution
    from pipeline.training.finetune import job_from_params, load_samples
    from pipeline.common.modeling import load_tokenizer

    world = world_copy(micro_world_dir, tmp_path)
    (world / "forget10.json").write_text("[]\n")
    cfg = AttributionConfig(**{**ATTRIBUTION, "model": str(micro_model_dir)})
    with pytest.raises(DataError, match=r"world/forget10.json: no records \(an empty list\)"):
        run_attribution(cfg, DataConfig(source=str(world)), tmp_path / "shards", None)
    assert not (tmp_path / "shards").exists()
    params = micro_params(world, micro_tokenizer_dir)
    params["finetune"]["models"]["m"]["splits"] = ["retain90", "forget10"]
    with pytest.raises(DataError, match=r"forget10.json: no records"):
        load_samples(job_from_params(params, "m"), load_tokenizer(micro_tokenizer_dir))


def test_duplicate_rows_are_counted_and_reported(micro_world_dir, micro_model_dir, tmp_path, caplog):
    from pipeline.attribution.run import AttributionConfig, run_attribution

    world = world_copy(micro_world_dir, tmp_path, edit=lambda rows: rows + [rows[0]])
    cfg = AttributionConfig(**{**ATTRIBUTION, "model": str(micro_model_dir)})
    summary = run_attribution(cfg, DataConfig(source=str(world)), tmp_path / "shards", tmp_path / "m.json")
    assert summary["duplicates"] == 1 and json.loads((tmp_path / "m.json").read_text())["duplicates"] == 1
    assert any("forget10.json: 1 duplicate row(s)" in r.message and "repeats row 1" in r.message
               for r in caplog.records)


# ---- models and tokenizers ---------------------------------------------------------------------------------

def test_a_truncated_safetensors_file_is_one_clear_error(micro_model_dir, tmp_path):
    from pipeline.common.modeling import load_model

    model = tmp_path / "model"
    shutil.copytree(micro_model_dir, model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(DataError, match=r"model '.*model': a safetensors file is truncated or corrupt .*rerun the "
                                        r"stage that wrote it"):
        load_model(model)


def test_a_slow_tokenizer_is_refused_before_any_work(micro_world_dir, micro_model_dir, tmp_path):
    from transformers import CTRLTokenizer

    from pipeline.attribution.run import AttributionConfig, run_attribution

    model = tmp_path / "model"
    shutil.copytree(micro_model_dir, model, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens_map.json"))
    (tmp_path / "vocab.json").write_text(json.dumps({"<unk>": 0, "a": 1, "b": 2, "ab": 3}))
    (tmp_path / "merges.txt").write_text("#version: 0.2\na b\n")
    CTRLTokenizer(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt")).save_pretrained(model)
    cfg = AttributionConfig(**{**ATTRIBUTION, "model": str(model)})
    with pytest.raises(DataError, match=r"only a slow \(Python\) CTRLTokenizer exists for it; TokenUnlearn needs a "
                                        r"fast tokenizer"):
        run_attribution(cfg, DataConfig(source=str(micro_world_dir)), tmp_path / "shards", None)
    assert not (tmp_path / "shards").exists()


def test_a_mistyped_local_path_fails_at_once_without_trying_the_hub(tmp_path, monkeypatch):
    import transformers

    import pipeline.data.tofu as tofu
    from pipeline.common.modeling import load_model, load_tokenizer
    from pipeline.common.paths import is_hub_name

    def no_hub(*args, **kwargs):
        raise AssertionError("the hub was tried")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_hub)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_hub)
    monkeypatch.setattr(tofu, "load_hub_records", no_hub)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "artifacts").mkdir()
    for load, what in ((load_model, "model"), (load_tokenizer, "tokenizer")):
        with pytest.raises(DataError, match=f"{what} 'artifacts/taget': no such file or directory"):
            load("artifacts/taget")
    with pytest.raises(DataError, match="data source 'artifacts/wrld': no such directory"):
        tofu.load_split("artifacts/wrld", "forget10")
    assert is_hub_name("microsoft/phi-1_5") and is_hub_name("locuslab/TOFU")
    assert not any(map(is_hub_name, ["artifacts/x", "a/b/c", "./x/y", "data/forget10.json", "~/x"]))


# ---- params ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("edit, message", [
    (lambda p: p["unlearn"].update(modle="x"), r"unlearn: unknown key\(s\) \['modle'\]"),
    (lambda p: p["unlearn"].update(seed=3), r"unlearn: unknown key\(s\) \['seed'\]"),
    (lambda p: p["unlearn"]["defaults"].update(tua=1.0), r"unlearn.defaults.tua: unknown parameter"),
    (lambda p: p["unlearn"]["runs"]["ga"].update(wieghting="hard"), r"unlearn.runs.ga.wieghting: unknown parameter"),
    (lambda p: p["unlearn"]["train"].update(epoch=3), r"unlearn.train.epoch: unknown parameter"),
])
def test_unknown_unlearn_keys_are_errors(edit, message):
    from pipeline.training.unlearn import run_configs

    params = {"unlearn": {"model": "m", "seeds": [0], "train": dict(TRAIN), "defaults": {},
                          "runs": {"ga": {"method": "ga"}}}}
    edit(params)
    with pytest.raises(ParamError, match=message):
        run_configs(params, "ga")


@pytest.mark.parametrize("section, build", [
    ("check", lambda v: __import__("pipeline.evaluation.exact_match", fromlist=["x"]).CheckConfig.from_params(v)),
    ("evaluate", lambda v: __import__("pipeline.evaluation.config", fromlist=["x"]).EvalConfig.from_params(v)),
    ("attribution", lambda v: __import__("pipeline.attribution.run", fromlist=["x"]).AttributionConfig.from_params(v)),
    ("tune", lambda v: __import__("pipeline.studies.tuning", fromlist=["x"]).TuneConfig.from_params(v)),
    ("data", lambda v: DataConfig.from_params(v)),
])
def test_every_section_rejects_unknown_keys(section, build):
    values = {"splits": ["forget10"]} if section == "check" else {}
    with pytest.raises(ParamError, match=rf"{section}.bacth_size: unknown parameter"):
        build({**values, "bacth_size": 4})


def test_unknown_keys_in_finetune_model_report_and_multiple_choice_are_errors(micro_world_dir, micro_tokenizer_dir,
                                                                              tmp_path):
    from pipeline.common.modeling import build_model, load_tokenizer
    from pipeline.common.params import check_sections
    from pipeline.evaluation.config import EvalConfig
    from pipeline.training.finetune import job_from_params

    params = micro_params(micro_world_dir, micro_tokenizer_dir)
    with pytest.raises(ParamError, match=r"finetune: unknown key\(s\) \['modles'\]"):
        job_from_params({**params, "finetune": {**params["finetune"], "modles": {}}}, "m")
    with pytest.raises(ParamError, match=r"model.config: unknown key\(s\) \['hiden_size'\] for LlamaConfig"):
        build_model({**TINY_MODEL, "hiden_size": 64}, load_tokenizer(micro_tokenizer_dir), 0)
    with pytest.raises(ParamError, match=r"evaluate.multiple_choice.w: unknown key\(s\) \['sorce'\]"):
        EvalConfig.from_params({"multiple_choice": {"w": {"format": "world", "source": "x", "sorce": "y"}}})
    with pytest.raises(ParamError, match=r"params.yaml: unknown section 'unlern' \(did you mean 'unlearn'\?\)"):
        check_sections({"unlern": {"model": "x", "seeds": [0]}}, "params.yaml")
    with pytest.raises(ParamError, match=r"'corpus' looks like an overlay .* --overlay configs/corpus.yaml"):
        check_sections({"corpus": {"unlearn": {"train": {"epochs": 20}}}})  # overlays are files now


def test_check_section_is_validated():
    from pipeline.evaluation.exact_match import CheckConfig

    with pytest.raises(ParamError, match=r"check.batch_size=0: must be at least 1"):
        CheckConfig.from_params({"splits": ["forget10"], "batch_size": 0})
    with pytest.raises(ParamError, match=r"check.splits=\[\]: must be a non-empty list of split names"):
        CheckConfig.from_params({"splits": []})


def test_range_errors_name_the_key_where_the_value_was_set_and_the_valid_range(micro_world_dir,
                                                                               micro_tokenizer_dir):
    from pipeline.training.finetune import job_from_params
    from pipeline.training.unlearn import run_configs

    params = {"unlearn": {"train": dict(TRAIN), "defaults": {"r": 1.5},
                          "runs": {"s_wga": {"method": "wga", "weighting": "soft"},
                                   "t_wga": {"method": "wga", "r": 0.0, "train": {"warmup_ratio": 1.2}}}}}
    with pytest.raises(ParamError, match=r"^unlearn.defaults.r=1.5: must be in \(0, 1\]$"):
        run_configs(params, "s_wga")
    params["unlearn"]["defaults"]["r"] = 0.2
    with pytest.raises(ParamError, match=r"^unlearn.runs.t_wga.r=0.0: must be in \(0, 1\]$"):
        run_configs(params, "t_wga")
    params["unlearn"]["runs"]["t_wga"]["r"] = 0.2
    with pytest.raises(ParamError, match=r"^unlearn.runs.t_wga.train.warmup_ratio=1.2: must be in \[0, 1\)$"):
        run_configs(params, "t_wga")
    fine = micro_params(micro_world_dir, micro_tokenizer_dir, epochs=0)
    with pytest.raises(ParamError, match=r"^finetune.train.epochs=0: must be positive and finite$"):
        job_from_params(fine, "m")
    fine = micro_params(micro_world_dir, micro_tokenizer_dir)
    fine["finetune"]["models"]["m"]["train"] = {"micro_batch_size": 0}
    with pytest.raises(ParamError, match=r"^finetune.models.m.train.micro_batch_size=0: must be at least 1 and finite$"):
        job_from_params(fine, "m")


def test_split_names_cannot_leave_the_data_source(micro_world_dir):
    from pipeline.data.tofu import load_split

    for split in ("../forget10", "/etc/passwd", "a/b", ""):
        with pytest.raises(DataError, match=rf"split {split!r}: not a split name"):
            load_split(micro_world_dir, split)


# ---- attribution --------------------------------------------------------------------------------------------

def test_attribute_honours_skip_too_long(micro_world_dir, micro_model_dir, micro_tokenizer, tmp_path):
    from pipeline.attribution.run import AttributionConfig, run_attribution
    from pipeline.attribution.shards import read_table
    from pipeline.data.templates import encode_qa, get_template
    from pipeline.data.tofu import load_split

    rows = load_split(micro_world_dir, "forget10")
    lengths = [len(encode_qa(micro_tokenizer, get_template("plain"), r["question"], r["answer"])) for r in rows]
    limit = sorted(lengths)[len(lengths) // 2]
    too_long = [i for i, n in enumerate(lengths) if n > limit]
    assert too_long
    cfg = AttributionConfig(**{**ATTRIBUTION, "model": str(micro_model_dir)})
    with pytest.raises(DataError, match=rf"forget10: row {too_long[0] + 1}: \d+ tokens exceed data.max_length"):
        run_attribution(cfg, DataConfig(source=str(micro_world_dir), max_length=limit), tmp_path / "a", None)
    assert not (tmp_path / "a").exists()
    data = DataConfig(source=str(micro_world_dir), max_length=limit, skip_too_long=True)
    summary = run_attribution(cfg, data, tmp_path / "b", None)
    assert summary["skipped_too_long"] == len(too_long) and summary["samples"] == len(rows) - len(too_long)
    kept = read_table(tmp_path / "b", columns=["sample_id"]).column("sample_id").to_pylist()
    assert kept == [i for i in range(len(rows)) if i not in too_long]


def test_shards_holding_nan_or_inf_are_refused(attribution_dir, tmp_path):
    from pipeline.attribution.shards import MANIFEST, _sha256
    from pipeline.training.forget_stream import ForgetStream, Weighting

    shards = tmp_path / "shards"
    shutil.copytree(attribution_dir[0] / "shards", shards)
    manifest = json.loads((shards / MANIFEST).read_text())
    first = manifest["shards"][0]
    table = pq.read_table(shards / first["name"])
    entropy = table.column("entropy").to_pylist()
    scored = table.column("scored").to_pylist()
    position = scored[0].index(True)
    entropy[0][position] = float("inf")
    table = table.set_column(table.schema.get_field_index("entropy"), "entropy",
                             pa.array(entropy, type=table.schema.field("entropy").type))
    pq.write_table(table, shards / first["name"])
    first["sha256"] = _sha256(shards / first["name"])  # a consistent manifest: the values themselves are bad
    (shards / MANIFEST).write_text(json.dumps(manifest))
    stream = ForgetStream(shards, Weighting("hard"))
    with pytest.raises(DataError, match=rf"{first['name']}: column 'entropy' holds inf at a scored token \(sample "
                                        rf"{table.column('sample_id')[0].as_py()}, position {position}; 1 such"):
        stream.get([0])
    assert np.isnan(pq.read_table(shards / first["name"]).column("delta").to_pylist()[0][0])  # unscored NaN is fine


# ---- evaluation ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fault, message", [
    ("split", r"real_authors_perturbed.json: file not found"),
    ("mc", r"WMDP source '.*nowhere.json': no such file"),
    ("retain", r"the retain model was evaluated on other forget questions"),
])
def test_evaluate_checks_every_input_before_loading_the_model(micro_world_dir, micro_model_dir, tmp_path,
                                                              monkeypatch, fault, message):
    import pipeline.evaluation.evaluate as evaluate_mod
    from pipeline.evaluation.config import EvalConfig
    from pipeline.evaluation.evaluate import evaluate_path

    world = world_copy(micro_world_dir, tmp_path)
    retain = tmp_path / "retain"
    (retain / "items").mkdir(parents=True)
    meta = {b"tokenunlearn": json.dumps({"questions_hash": "0123"}).encode()}
    pq.write_table(pa.table({"truth_ratio": [1.0]}).replace_schema_metadata(meta), retain / "items" / "forget.parquet")
    mc = {"w": {"format": "wmdp", "source": str(tmp_path / "nowhere.json")}} if fault == "mc" else {}
    if fault == "split":
        (world / "real_authors_perturbed.json").unlink()
    cfg = EvalConfig(source=str(world), multiple_choice=mc)

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the inputs were checked")

    monkeypatch.setattr(evaluate_mod, "load_model", no_model)
    with pytest.raises(DataError, match=message):
        evaluate_path(str(micro_model_dir), cfg, tmp_path / "out", retain if fault == "retain" else None)


def test_evaluation_shows_progress_on_its_long_loops(micro_model_dir, micro_tokenizer, capsys, monkeypatch):
    """On a terminal: a bar per loop (piped, the loops log a line every 30 s instead: tests/common/test_progress.py)."""
    from pipeline.common.modeling import load_model

    monkeypatch.setattr("pipeline.common.progress._is_terminal", lambda stream: True)
    from pipeline.data.templates import get_template
    from pipeline.evaluation.generation import greedy_answers
    from pipeline.evaluation.tofu_metrics import answer_statistics

    model = load_model(micro_model_dir)
    answer_statistics(model, micro_tokenizer, get_template("plain"), ["Who?"] * 3, ["Ana."] * 3, batch_size=1)
    greedy_answers(model, micro_tokenizer, get_template("plain"), ["Who?"] * 2, max_new_tokens=2, batch_size=1)
    err = capsys.readouterr().err
    assert "teacher forcing" in err and "generation" in err


# ---- the machine: a full disk, two runs on one output, a symlinked output -------------------------------------

def test_a_full_disk_stops_attribute_with_one_line_and_leaves_nothing(micro_world_dir, micro_model_dir, tmp_path,
                                                                      monkeypatch, capsys):
    import pipeline.attribution.shards as shards_mod

    def full_disk(table, where, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(where))

    monkeypatch.setattr(shards_mod.pq, "write_table", full_disk)
    out = tmp_path / "out" / "attribution"
    status, err = run_cli(["attribute", "--params", stage_params(tmp_path, micro_world_dir, micro_model_dir),
                           "--out", str(out), "--metrics", str(tmp_path / "out" / "m.json")], capsys)
    line = one_error_line(err)
    assert status == 2 and "no space left on device" in line and "left no half-written output" in line
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == []  # no partial directory keeps the disk full


def test_a_full_disk_stops_unlearn_with_one_line_and_leaves_nothing(attribution_dir, micro_world_dir,
                                                                    micro_model_dir, tmp_path, monkeypatch, capsys):
    import pipeline.training.unlearn as unlearn_mod

    def full_disk(model, tokenizer, directory, state_dict=None):
        raise OSError(errno.ENOSPC, "No space left on device", str(directory / "model.safetensors"))

    monkeypatch.setattr(unlearn_mod, "write_model", full_disk)
    out = tmp_path / "out"
    status, err = run_cli(["unlearn", "ga", "--params", stage_params(tmp_path, micro_world_dir, micro_model_dir),
                           "--shards", str(attribution_dir[0] / "shards"), "--out", str(out / "ga"),
                           "--checkpoints", str(tmp_path / "ckpt"), "--plots", str(tmp_path / "plots")], capsys)
    assert status == 2 and "no space left on device" in one_error_line(err)
    assert not out.exists() or [p for p in out.rglob("*") if p.is_file()] == []  # no model, no complete.json


def test_two_runs_never_write_the_same_output(attribution_dir, micro_world_dir, micro_model_dir, tmp_path, capsys):
    from pipeline.common.atomic import hold_outputs
    from pipeline.common.locks import OutputBusy

    params = stage_params(tmp_path, micro_world_dir, micro_model_dir)
    common = ["unlearn", "ga", "--params", params, "--shards", str(attribution_dir[0] / "shards"),
              "--plots", str(tmp_path / "plots")]
    with hold_outputs(tmp_path / "ga"):  # another run is writing it
        status, err = run_cli(common + ["--out", str(tmp_path / "ga"), "--checkpoints", str(tmp_path / "c1")], capsys)
        assert status == 2 and "ga: another run is writing it (pid " in one_error_line(err)
        with pytest.raises(OutputBusy):
            with hold_outputs(tmp_path / "ga"):
                pass
    with hold_outputs(tmp_path / "shared-ckpt"):  # another run's live checkpoints: never resumed from
        status, err = run_cli(common + ["--out", str(tmp_path / "ga2"), "--checkpoints",
                                        str(tmp_path / "shared-ckpt")], capsys)
        assert status == 2 and "shared-ckpt: another run is writing it" in one_error_line(err)
    assert not (tmp_path / "ga").exists() and not (tmp_path / "ga2").exists()
    assert not list(tmp_path.glob(".*.lock"))  # released with the run


def test_an_output_that_is_a_symlink_is_refused(micro_world_dir, micro_model_dir, tmp_path, capsys):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    status, err = run_cli(["attribute", "--params", stage_params(tmp_path, micro_world_dir, micro_model_dir),
                           "--out", str(tmp_path / "link"), "--metrics", str(tmp_path / "m.json")], capsys)
    assert status == 2 and "link: is a symbolic link (to " in one_error_line(err)
    assert (tmp_path / "link").is_symlink() and not list((tmp_path / "elsewhere").iterdir())



def test_unlearn_and_tune_name_a_missing_tuning_choice_or_a_missing_group(tmp_path, capsys):
    status, err = run_cli(["unlearn", "npo", "--lr-from", str(tmp_path / "choice.json"), "--out", str(tmp_path / "u")],
                          capsys)
    assert status == 2 and "choice.json: no tuning choice to read" in one_error_line(err)
    assert not (tmp_path / "u").exists()
    (tmp_path / "choice.json").write_text(json.dumps({"runs": {"t_npo": {"chosen": {"lr": 1e-4}}}}))
    status, err = run_cli(["unlearn", "npo", "--lr-from", str(tmp_path / "choice.json"), "--out", str(tmp_path / "u")],
                          capsys)
    assert status == 2 and "no tuning of run 'npo' in it" in one_error_line(err)
    status, err = run_cli(["tune", "npo", "--run", "npo"], capsys)
    assert status == 2 and "one of them" in err


@pytest.mark.parametrize("summary, says", [
    (None, "t.json: no evaluation summary of the target to read (no such file); evaluate the target first"),
    ("{not json", "t.json: the evaluation summary of the target is not JSON ("),
    (json.dumps({"forget_es": 0.5}), "t.json: no model_utility in it"),
    (json.dumps({"model_utility": -0.5}), "t.json: model_utility=-0.5: must be in [0, 1]"),
    (json.dumps({"model_utility": "NaN"}), "t.json: model_utility='NaN': must be in [0, 1]"),
])
def test_tune_checks_the_targets_utility_it_reads(tmp_path, capsys, summary, says):
    # the utility floor is a share of it: a bad value would move every tuning's floor without a word
    if summary is not None:
        (tmp_path / "t.json").write_text(summary)
    status, err = run_cli(["tune", "--run", "npo", "--target-results", str(tmp_path / "t.json"),
                           "--out", str(tmp_path / "tuning")], capsys)
    assert status == 2 and says in one_error_line(err)
    assert not (tmp_path / "tuning").exists()
