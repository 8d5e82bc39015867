"""The install's pinned, delicate parts."""

import importlib.metadata as md


def test_trankit_imports_on_the_pinned_transformers():
    from pipeline.trankit_compat import import_trankit

    trankit = import_trankit()
    assert hasattr(trankit, "Pipeline")
    assert md.version("trankit") == "1.1.2"
    assert md.version("transformers").startswith("4.57.")


def test_deepspeed_and_dvc_are_the_pinned_tools():
    assert md.version("deepspeed") == "0.19.8"
    assert int(md.version("dvc").split(".")[0]) == 3
