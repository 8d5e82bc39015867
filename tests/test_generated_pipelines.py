"""The experiments' pipelines are generated (pipeline/sweep/pipelines.py): each experiments/NAME/dvc.yaml is what
experiments/NAME/pipeline.yaml and the stage kinds of experiments/stages.yaml render, and each kind is defined once,
so that a change to the unlearn stage is one edit."""

import copy
import re

import click
import pytest
import yaml

from pipeline.common.errors import DataError
from pipeline.sweep.pipelines import KINDS, read_yaml, render_pipeline, spec_files, stale_pipelines

from tests.conftest import REPO


@pytest.fixture(scope="module")
def commands():
    """tokenunlearn's commands and their modules, as `tokenunlearn code-deps` sees them."""
    from stages.cli import cli
    from stages.code_deps import _command_modules

    with click.Context(cli):
        return _command_modules()


def _body(stage: dict) -> dict:
    return stage.get("do", stage)


def _params_keys(body: dict) -> list[str]:
    """Every params key a stage lists, of whichever file."""
    keys = []
    for entry in body.get("params", []):
        keys += [entry] if isinstance(entry, str) else [k for listed in entry.values() for k in listed or []]
    return keys


def test_every_experiment_pipeline_is_its_rendering(commands):
    """Every experiments/NAME/dvc.yaml has a spec, and is what it renders (`tokenunlearn pipelines --write`)."""
    pipelines = {p.parent.name for p in (REPO / "experiments").glob("*/dvc.yaml")}
    assert {p.parent.name for p in spec_files(REPO)} == pipelines
    stale = [str(dvc_file.relative_to(REPO)) for dvc_file, _ in stale_pipelines(REPO, commands)]
    assert not stale, f"out of date (run `tokenunlearn pipelines --write`): {stale}"


def test_the_unlearn_stage_is_defined_once(commands):
    """A change to the unlearn kind (an option, a params key, an output) reaches every unlearning stage of every
    experiment, and no other stage; no experiment writes an unlearning stage of its own."""
    kinds = read_yaml(REPO / KINDS)
    changed = copy.deepcopy(kinds)
    unlearn = changed["kinds"]["unlearn"]
    unlearn["cmd"].append("--new-option <root>/new/<id>")
    unlearn["params"].append("unlearn.new_key")
    unlearn["outs"].append("<root>/new/<id>")
    pipelines, manifests = set(), {}
    for spec_file in spec_files(REPO):
        specs = read_yaml(spec_file)["stages"]
        before = yaml.safe_load(render_pipeline(REPO, spec_file, kinds, commands, manifests))["stages"]
        after = yaml.safe_load(render_pipeline(REPO, spec_file, changed, commands, manifests))["stages"]
        for name, stage in before.items():
            old, new = _body(stage), _body(after[name])
            if not old["cmd"].startswith("tokenunlearn unlearn "):
                assert new == old, f"{spec_file}: {name} changed with the unlearn kind"
                continue
            assert specs[name].get("kind") == "unlearn", f"{spec_file}: {name} unlearns without the unlearn kind"
            assert new["cmd"].startswith(old["cmd"]) and " --new-option " in new["cmd"]
            assert "unlearn.new_key" in _params_keys(new) and "unlearn.new_key" not in _params_keys(old)
            assert len(new["outs"]) == len(old["outs"]) + 1
            pipelines.add(spec_file.parent.name)
    unlearning = {f.parent.name for f in spec_files(REPO)
                  if any(st.get("kind") == "unlearn" for st in read_yaml(f)["stages"].values())}
    assert pipelines == unlearning and len(pipelines) >= 11, sorted(pipelines)  # controls the 11th


def _render(tmp_path, spec: str, kinds: dict) -> dict:
    (tmp_path / "stages").mkdir(exist_ok=True)
    (tmp_path / "stages" / "x.py").write_text("import os\n")
    (tmp_path / "experiments" / "demo").mkdir(parents=True, exist_ok=True)
    (tmp_path / "experiments" / "demo" / "pipeline.yaml").write_text(spec)
    text = render_pipeline(tmp_path, tmp_path / "experiments" / "demo" / "pipeline.yaml", kinds,
                           {"x": tmp_path / "stages" / "x.py"})
    return yaml.safe_load(text)["stages"]


KIND = {"slots": {"extra": None}, "kinds": {"make": {
    "cmd": ["tokenunlearn x <name> <config>", "--extra <extra>", "--in <input>", "--out <root>/<name>"],
    "deps": ["<input>", "<extra>", "<root>/a"],
    "params": ["data", "x.<name>"],
    "outs": ["<root>/<name>"]}}}


def test_slots_drop_order_and_a_stage_s_own_output(tmp_path):
    """A null slot leaves its option and dep out; `order` reorders options; a bare params key is the --params
    file's; a stage never depends on its own output; every stage gets `wdir: ..` and its code manifest."""
    stages = _render(tmp_path, """
with: {config: --params ../p.yaml --overlay ../o.yaml, root: artifacts/demo, input: artifacts/in}
stages:
  a: {kind: make, with: {name: a}}
  b:
    kind: make
    with: {name: b, extra: e}
    order: [--out, --in]
    params: [o.key, ../o.yaml: [x]]
""", KIND)
    code = "../artifacts/code/stages/x.md5"
    assert stages["a"] == {
        "wdir": "..", "cmd": "tokenunlearn x a --params ../p.yaml --overlay ../o.yaml --in artifacts/in "
        "--out artifacts/demo/a", "deps": ["artifacts/in", code], "params": [{"../p.yaml": ["data", "x.a"]}],
        "outs": ["artifacts/demo/a"]}
    assert stages["b"]["cmd"] == ("tokenunlearn x b --params ../p.yaml --overlay ../o.yaml --extra e "
                                  "--out artifacts/demo/b --in artifacts/in")
    assert stages["b"]["deps"] == ["artifacts/in", "e", "artifacts/demo/a", code]
    assert stages["b"]["params"] == [{"../p.yaml": ["data", "x.b", "o.key"]}, {"../o.yaml": ["x"]}]


@pytest.mark.parametrize("stage, message", [
    ("{kind: make, with: {name: a}, drop: [--missing]}", "drop names what its kind 'make' lacks: ['--missing']"),
    ("{kind: make, with: {name: a}, order: [--missing]}", "order names options its kind lacks: ['--missing']"),
    ("{kind: make}", "no value for the slot <name>"),
    ("{kind: other}", "no stage kind 'other'"),
    ("{kind: make, with: {name: a}, typo: 1}", "unknown keys ['typo']"),
])
def test_a_mistake_in_a_spec_is_an_error_that_names_it(tmp_path, stage, message):
    spec = f"with: {{config: '', root: artifacts/demo, input: in}}\nstages:\n  a: {stage}\n"
    with pytest.raises(DataError, match=re.escape(message)):
        _render(tmp_path, spec, KIND)


def params_missing(root) -> list[tuple[str, str, str]]:
    """Every (stage, file, key) of a params dependency, as DVC resolves the stages of `root`'s dvc.yaml files
    (foreach and matrix expanded), whose key is not in its file."""
    from pathlib import Path

    from dvc.repo import Repo

    files, missing = {}, []
    for stage in Repo(str(root)).index.stages:
        for dep in stage.deps:
            if type(dep).__name__ != "ParamsDependency":
                continue
            path = (Path(stage.wdir) / dep.def_path).resolve()
            tree = files.setdefault(path, yaml.safe_load(path.read_text()) if path.is_file() else {})
            for key in dep.params or []:
                node = tree
                for part in key.split("."):
                    if not isinstance(node, dict) or part not in node:
                        missing.append((stage.addressing, str(dep.def_path), key))
                        break
                    node = node[part]
    return missing


@pytest.mark.slow  # DVC resolves every stage of every experiment: about 20 s
@pytest.mark.parametrize("root", [".", "experiments"])
def test_every_param_a_stage_names_is_in_its_file(root):
    """DVC runs a stage whose params file lacks a key it names, then refuses to record it ("Parameters ... are
    missing"): a sweep's whole work lost at the end, as when a run's stage named its own run in an overlay that did
    not define it."""
    assert params_missing(REPO / root) == []
