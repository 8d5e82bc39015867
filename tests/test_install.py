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
