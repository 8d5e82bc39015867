"""Names that become parts of paths are refused where they are parsed: the CLI's arguments, the params' keys and
lists (from the file, an overlay or -S), so none can point outside the directory it names a thing in."""

import pytest
from click.testing import CliRunner

from pipeline.common.errors import ParamError
from pipeline.common.names import check_name, check_param_names
from pipeline.common.params import load_params
from stages.cli import cli

HOSTILE = ["../x", "../../../../elsewhere/x", "/tmp/x", "a/b", "..", ".", ".hidden", "", "a\\b", "x" * 101, 3]


@pytest.mark.parametrize("name", ["npo", "t_npo", "S-NPO.v2", "m0", "npo_n3", "x" * 100])
def test_plain_names_pass(name):
    assert check_name(name, "run") == name


@pytest.mark.parametrize("name", HOSTILE)
def test_names_that_are_not_one_plain_path_component_are_refused(name):
    with pytest.raises(ParamError, match="not a name"):
        check_name(name, "run")


def test_params_names_are_checked_from_the_file_an_overlay_and_an_override(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text("unlearn:\n  runs:\n    npo: {method: npo}\ntune:\n  groups: {}\n")
    overlay = tmp_path / "overlay.yaml"
    overlay.write_text("unlearn:\n  runs:\n    ../../x: {method: npo}\n")
    assert "npo" in load_params(params)["unlearn"]["runs"]
    with pytest.raises(ParamError, match=r"unlearn\.runs key='\.\./\.\./x': not a name"):
        load_params(params, [overlay])
    with pytest.raises(ParamError, match=r"tune\.groups\.npo entry='/tmp/y'"):
        load_params(params, overrides=["tune.groups.npo=[npo, /tmp/y]"])
    with pytest.raises(ParamError, match=r"seeds\.runs entry='a/b'"):
        check_param_names({"seeds": {"runs": ["npo", "a/b"]}})


@pytest.mark.parametrize("argv", [
    ["evaluate", "../../../../elsewhere/x", "--model", "m"],
    ["unlearn", "../x"],
    ["relearn", "/tmp/x", "--model", "m"],
    ["finetune", "a/b"],
    ["tune", "--run", ".."],
])
def test_cli_names_are_refused_before_anything_is_read_or_written(argv, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli, argv)
    assert result.exit_code == 2 and "not a name" in result.output
    assert list(tmp_path.iterdir()) == []  # nothing written, not even a params read
