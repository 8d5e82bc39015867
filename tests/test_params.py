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
    file.write_text("a: {x: 1}\nv: {a: {x: 2}}\n")
    assert load_params(file, "v")["a"]["x"] == 2 and load_params(file)["a"]["x"] == 1
