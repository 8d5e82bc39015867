"""The install's pinned, delicate parts."""

import importlib.metadata as md

import pytest

pytestmark = pytest.mark.slow  # builds a wheel and imports the pinned tools


def test_trankit_imports_on_the_pinned_transformers():
    from pipeline.attribution.trankit_compat import import_trankit

    trankit = import_trankit()
    assert hasattr(trankit, "Pipeline")
    assert md.version("trankit") == "1.1.2"
    assert md.version("transformers").startswith("4.57.")


def test_deepspeed_and_dvc_are_the_pinned_tools():
    assert md.version("deepspeed") == "0.19.8"
    assert int(md.version("dvc").split(".")[0]) == 3


@pytest.mark.skipif(__import__("platform").python_implementation() != "CPython", reason="a C extension")
def test_dvc_reads_locks_with_ruamel_yamls_c_loader_to_the_same_data():
    """Since ruamel.yaml 0.19 its C loader is an extra: without it DVC parses a large dvc.lock 3 times slower."""
    from ruamel.yaml import YAML
    from ruamel.yaml.main import CParser

    assert CParser is not None and YAML(typ="safe").Parser is CParser  # the loader DVC's parse_yaml makes
    lock = "schema: '2.0'\nstages:\n" + "".join(
        f"  s@{i}:\n    cmd: echo {i} > o{i}\n    outs:\n    - path: o{i}\n      md5: {i:032x}\n      size: {i}\n"
        f"    params:\n      p.yaml:\n        lr: {i}e-05\n        on: {str(i % 2 == 1).lower()}\n" for i in range(50))
    assert YAML(typ="safe").load(lock) == YAML(typ="safe", pure=True).load(lock)


def test_a_wheel_holds_every_library_package(tmp_path):
    """A non-editable install (a wheel) ships every subpackage of the library, not only the top level."""
    import shutil
    import subprocess
    import sys
    import zipfile

    from tests.conftest import REPO

    source = tmp_path / "src"  # a copy: building in the repository would leave build/ and *.egg-info there
    for name in ("pipeline", "stages"):
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(source)], check=True, capture_output=True)
    names = zipfile.ZipFile(next(tmp_path.glob("tokenunlearn-*.whl"))).namelist()
    packages = sorted(p.parent.name for p in (REPO / "pipeline").glob("*/__init__.py"))
    for package in packages:
        assert f"pipeline/{package}/__init__.py" in names
    assert "stages/cli.py" in names
