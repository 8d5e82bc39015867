"""The command line: --help everywhere, and user errors as one line without a traceback."""

import subprocess

import pytest
import yaml
from click.testing import CliRunner

from stages.cli import cli

from tests.conftest import REPO, cli_env

NO_PARAMS = {"download-tagger", "export-open-unlearning", "compare-attribution", "code-deps", "code-manifests",
             "pipelines", "diagnose", "world-muse", "evaluate-muse", "muse-corpora"}  # no params file


@pytest.mark.parametrize("command", sorted(cli.commands))
def test_every_command_has_help(command):
    result = CliRunner().invoke(cli, [command, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage: " in result.output and ("--params" in result.output) == (command not in NO_PARAMS)


def _run(args, cwd):
    return subprocess.run(["tokenunlearn", *args], cwd=cwd, env=cli_env(), capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize(
    "params, message",
    [
        ({"world": {"n_authors": 1, "questions_per_author": 2}}, "world.n_authors=1: must be between 3 and 2000"),
        ({"world": {"n_author": 5}}, "world.n_author: unknown parameter (known: ['n_authors', "),
        ({"world": {"n_authors": "ten"}}, "world.n_authors='ten': expected int"),
        ({"other": 1}, "params.yaml: unknown section 'other'; sections are ['world', "),
        ({"data": {"source": "x"}}, "params: missing key 'world'"),
    ],
)
def test_bad_params_give_one_line_errors(tmp_path, params, message):
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    proc = _run(["make-world", "--lexicon", str(REPO / "data" / "world"),
                 "--out", str(tmp_path / "world")], tmp_path)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"tokenunlearn: error: {message}"), proc.stderr
    assert not (tmp_path / "world").exists()


@pytest.mark.slow
def test_missing_data_file_is_a_one_line_error(tmp_path, micro_tokenizer_dir):
    from tests.conftest import micro_params

    params = micro_params(tmp_path / "no-world", micro_tokenizer_dir)
    (tmp_path / "no-world").mkdir()
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    proc = _run(["finetune", "m", "--out", str(tmp_path / "model")], tmp_path)
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last == f"tokenunlearn: error: {tmp_path / 'no-world' / 'full.json'}: file not found"
    assert "Traceback" not in proc.stderr and not (tmp_path / "model").exists()


@pytest.mark.slow
@pytest.mark.parametrize("params, message", [
    ({"tokenizer": {"vocab_size": "2048"}}, "tokenizer.vocab_size='2048': expected int"),
    ({"tokenizer": {"min_frequency": 2}}, "tokenizer: "),  # vocab_size is required
])
def test_bad_tokenizer_params_give_one_line_errors(tmp_path, micro_world_dir, params, message):
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    proc = _run(["train-tokenizer", "--world", str(micro_world_dir), "--out", str(tmp_path / "tok")], tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"tokenunlearn: error: {message}")
    assert not (tmp_path / "tok").exists()
