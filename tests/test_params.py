"""Params files and overlays (a variant of the params, such as the WMDP-style run's `corpus`)."""

import pytest

from pipeline.common.errors import ParamError
from pipeline.common.params import apply_overlay, load_params

PARAMS = {
    "unlearn": {"train": {"epochs": 5, "lr": 2e-4}, "runs": {"ga": {"method": "ga"}}},
    "report": {"table": ["ga", "npo"], "ablations": {"r": ["t_wga"]}},
    "variant": {"unlearn": {"train": {"epochs": 20}}, "report": {"table": ["ga"], "ablations": None}},
}


def test_an_overlay_merges_mappings_and_replaces_lists_and_nulls():
    out = apply_overlay(PARAMS, "variant")
    assert out["unlearn"]["train"] == {"epochs": 20, "lr": 2e-4}  # merged: lr kept
    assert out["unlearn"]["runs"] == {"ga": {"method": "ga"}}     # untouched
    assert out["report"] == {"table": ["ga"], "ablations": None}  # replaced whole
    assert PARAMS["unlearn"]["train"]["epochs"] == 5               # the input is left as it was


def test_overlay_errors_name_the_overlay(tmp_path):
    with pytest.raises(ParamError, match="no overlay section 'nope'"):
        apply_overlay(PARAMS, "nope")
    with pytest.raises(ParamError, match=r"changes sections \['typo'\]"):
        apply_overlay({**PARAMS, "bad": {"typo": {"x": 1}}}, "bad")
    file = tmp_path / "params.yaml"
    file.write_text("world: {seed: 1}\nv: {world: {seed: 2}}\n")
    assert load_params(file, "v")["world"]["seed"] == 2 and load_params(file)["world"]["seed"] == 1


def test_several_overlays_apply_in_order_then_the_command_line_overrides(tmp_path):
    file = tmp_path / "params.yaml"
    file.write_text("unlearn: {train: {lr: 1.0e-4, epochs: 5}, runs: {ga: {method: ga}}}\n"
                    "a: {unlearn: {train: {epochs: 20, lr: 2.0e-4}}}\n"
                    "b: {unlearn: {train: {epochs: 30}}}\n")
    params = load_params(file, ["a", "b"], ["unlearn.train.lr=3e-4", "unlearn.runs.t_ga={method: ga, r: 0.4}"])
    assert params["unlearn"]["train"] == {"lr": 3e-4, "epochs": 30}
    assert params["unlearn"]["runs"]["t_ga"] == {"method": "ga", "r": 0.4}  # a new key under an existing section
    assert load_params(file, ["b", "a"])["unlearn"]["train"]["epochs"] == 20
    with pytest.raises(ParamError, match=r"-S 'unlern.train.lr=1': params have no section 'unlern'"):
        load_params(file, overrides=["unlern.train.lr=1"])
    with pytest.raises(ParamError, match=r"-S 'unlearn.train.lr': expected KEY.PATH=VALUE"):
        load_params(file, overrides=["unlearn.train.lr"])


def test_the_command_line_takes_overrides_and_several_overlays(tmp_path, monkeypatch):
    """`tokenunlearn report -S ... --overlay a --overlay b` reads the params it was given, as `dvc exp run -S`."""
    from click.testing import CliRunner

    import stages.report as report_stage
    from stages.cli import cli

    seen = {}
    monkeypatch.setattr(report_stage, "load_rows",
                        lambda metrics, runs, defaults, relearn: seen.update(runs=runs) or [])
    monkeypatch.setattr(report_stage, "load_ablations", lambda *a: [])
    monkeypatch.setattr(report_stage, "write_report", lambda *a: None)
    file = tmp_path / "params.yaml"
    file.write_text("unlearn: {defaults: {}, runs: {ga: {method: ga}, npo: {method: npo}}}\n"
                    "report: {table: [ga], ablations: null}\n"
                    "a: {report: {table: [npo]}}\nb: {unlearn: {runs: {ga: {method: wga}}}}\n")
    result = CliRunner().invoke(cli, ["report", "--params", str(file), "--overlay", "a", "--overlay", "b",
                                      "-S", "report.table=[ga, npo]", "--out", str(tmp_path / "r"),
                                      "--plots", str(tmp_path / "p")])
    assert result.exit_code == 0, result.output
    assert seen["runs"] == {"ga": {"method": "wga"}, "npo": {"method": "npo"}}
