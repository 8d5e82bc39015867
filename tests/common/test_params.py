"""Params files, overlay files (configs/*.yaml: changes to the sections) and -S overrides."""

import textwrap

import click
import pytest
from click.testing import CliRunner

from pipeline.common.errors import ParamError
from pipeline.common.params import apply_overlay, load_params

from tests.conftest import REPO

BASE = {
    "unlearn": {"train": {"epochs": 5, "lr": 2e-4}, "runs": {"ga": {"method": "ga"}}},
    "report": {"table": ["ga", "npo"], "ablations": {"r": ["t_wga"]}},
    "evaluate": {"mia": {"k": 0.4}, "paraphrase": True},
}


def write(path, text: str):
    path.write_text(textwrap.dedent(text))
    return path


def test_an_overlay_merges_mappings_and_replaces_lists_and_nulls(tmp_path):
    overlay = write(tmp_path / "variant.yaml", """\
        unlearn: {train: {epochs: 20}}
        report: {table: [ga], ablations: null}
        evaluate: {mia: null}
        seeds: {models: [0, 1]}
        """)
    out = apply_overlay(BASE, overlay)
    assert out["unlearn"]["train"] == {"epochs": 20, "lr": 2e-4}  # merged: lr kept
    assert out["unlearn"]["runs"] == {"ga": {"method": "ga"}}     # untouched
    assert out["report"] == {"table": ["ga"], "ablations": None}  # replaced whole
    assert out["evaluate"] == {"mia": None, "paraphrase": True}   # null: switched off
    assert out["seeds"] == {"models": [0, 1]}                      # a known section the params lack: added
    assert BASE["unlearn"]["train"]["epochs"] == 5                 # the input is left as it was


def test_an_empty_mapping_meant_as_off_is_an_error_that_names_null(tmp_path):
    overlay = write(tmp_path / "off.yaml", "evaluate: {mia: {}}\n")
    with pytest.raises(ParamError, match=r"^.*off.yaml: evaluate.mia: \{\} merges nothing .* write `mia: null`"):
        apply_overlay(BASE, overlay)
    # over a null or a missing key there is nothing to merge into: {} is a value
    assert apply_overlay({"evaluate": {"mia": None}}, overlay)["evaluate"]["mia"] == {}


def test_overlay_errors_name_the_file(tmp_path, monkeypatch):
    with pytest.raises(ParamError, match=r"^--overlay nope.yaml: no such file \(an overlay is a YAML file"):
        apply_overlay(BASE, "nope.yaml")
    monkeypatch.chdir(REPO)  # an old overlay name: the file it now is
    with pytest.raises(ParamError, match=r"^--overlay corpus: no such file \(did you mean --overlay configs/corpus.yaml"):
        apply_overlay(BASE, "corpus")
    with pytest.raises(ParamError, match=r"typo.yaml: unknown section\(s\) \['unlern'\]"):
        apply_overlay(BASE, write(tmp_path / "typo.yaml", "unlern: {seeds: [0]}\n"))
    with pytest.raises(ParamError, match=r"list.yaml: expected a mapping at the top level"):
        apply_overlay(BASE, write(tmp_path / "list.yaml", "- unlearn\n"))


def test_a_params_file_holds_sections_only(tmp_path):
    file = write(tmp_path / "params.yaml", "world: {seed: 1}\ncorpus: {world: {seed: 2}}\n")
    with pytest.raises(ParamError, match=r"'corpus' looks like an overlay .* configs/corpus.yaml"):
        load_params(file)
    with pytest.raises(ParamError, match=r"unknown section 'wrold' \(did you mean 'world'\?\)"):
        load_params(write(tmp_path / "typo.yaml", "wrold: {seed: 1}\n"))


def test_several_overlays_apply_in_order_then_the_command_line_overrides(tmp_path):
    file = write(tmp_path / "params.yaml", "unlearn: {train: {lr: 1.0e-4, epochs: 5}, runs: {ga: {method: ga}}}\n")
    a = write(tmp_path / "a.yaml", "unlearn: {train: {epochs: 20, lr: 2.0e-4}}\n")
    b = write(tmp_path / "b.yaml", "unlearn: {train: {epochs: 30}}\n")
    params = load_params(file, [a, b], ["unlearn.train.lr=3e-4", "unlearn.runs.t_ga={method: ga, r: 0.4}"])
    assert params["unlearn"]["train"] == {"lr": 3e-4, "epochs": 30}
    assert params["unlearn"]["runs"]["t_ga"] == {"method": "ga", "r": 0.4}  # a new key under an existing section
    assert load_params(file, [b, a])["unlearn"]["train"]["epochs"] == 20
    with pytest.raises(ParamError, match=r"-S 'unlern.train.lr=1': params have no section 'unlern'"):
        load_params(file, overrides=["unlern.train.lr=1"])
    with pytest.raises(ParamError, match=r"-S 'unlearn.train.lr': expected KEY.PATH=VALUE"):
        load_params(file, overrides=["unlearn.train.lr"])


def test_every_command_takes_params_overlays_and_overrides(tmp_path):
    """--params FILE --overlay A --overlay B -S KEY=VALUE, in that order, as `dvc exp run -S` sets keys."""
    from stages.options import params_options

    seen = {}

    @click.command()
    @params_options
    def command(params):
        seen.update(params)

    file = write(tmp_path / "params.yaml", "report: {table: [ga], ablations: {r: [t]}}\n")
    a = write(tmp_path / "a.yaml", "report: {table: [npo]}\n")
    b = write(tmp_path / "b.yaml", "report: {ablations: null}\n")
    result = CliRunner().invoke(command, ["--params", str(file), "--overlay", str(a), "--overlay", str(b),
                                          "-S", "report.table=[ga, npo]"])
    assert result.exit_code == 0, result.output
    assert seen == {"report": {"table": ["ga", "npo"], "ablations": None}}


def test_null_switches_a_mapping_param_off():
    from pipeline.evaluation.config import EvalConfig
    from pipeline.training.engine import TrainConfig

    cfg = EvalConfig.from_params({"mia": None, "quantize": None, "multiple_choice": None}, "evaluate")
    assert cfg.mia_spec is None and cfg.quantize_spec is None and cfg.multiple_choice == {}
    train = TrainConfig.from_params({"lora": None}, "unlearn.train")
    assert train.lora == {}


def test_dvc_exp_run_rewrites_one_line_of_params_yaml(tmp_path):
    """`dvc exp run -S unlearn.weightings.soft.tau=1.0` rewrites params.yaml through ruamel: the file is written in
    the style it keeps (no double quotes, no long flow mappings, empty values for null), so one line changes."""
    from dvc.utils.serialize import modify_yaml

    copy = tmp_path / "params.yaml"
    copy.write_text((REPO / "params.yaml").read_text())
    with modify_yaml(copy) as params:
        params["unlearn"]["weightings"]["soft"]["tau"] = 1.0
    old, new = (REPO / "params.yaml").read_text().splitlines(), copy.read_text().splitlines()
    assert len(old) == len(new) and [(a, b) for a, b in zip(old, new) if a != b] == \
        [("      tau: 0.5", "      tau: 1.0")]
