"""experiments/paste_tables.py: RESULTS.md's fenced tables replaced by the report outputs they name."""

import importlib.util
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("paste_tables", Path(__file__).parents[1] / "experiments" / "paste_tables.py")
paste = importlib.util.module_from_spec(spec)
spec.loader.exec_module(paste)


def test_blocks_take_the_whole_output_or_one_section_and_keep_the_prose(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "a.md").write_text("| x |\n|---|\n| 1 |\n")
    (tmp_path / "out" / "b.md").write_text("# T\n\nintro\n\n## Two\n\nkept\n\n### sub\n\nkept too\n\n## Three\n\nnot\n")
    text = ("prose\n<!-- table: out/a.md -->\nold\n<!-- end table -->\nmore prose\n"
            "<!-- table: out/b.md#Two -->\n<!-- end table -->\n")
    assert paste.render(text, tmp_path) == ("prose\n<!-- table: out/a.md -->\n| x |\n|---|\n| 1 |\n<!-- end table -->\n"
                                            "more prose\n<!-- table: out/b.md#Two -->\nkept\n\n### sub\n\nkept too\n"
                                            "<!-- end table -->\n")
    with pytest.raises(SystemExit, match="out/c.md: no such output"):
        paste.render("<!-- table: out/c.md -->\n<!-- end table -->", tmp_path)
    with pytest.raises(SystemExit, match="no heading 'Four'"):
        paste.render("<!-- table: out/b.md#Four -->\n<!-- end table -->", tmp_path)


def test_a_heading_may_hold_spaces_and_only_fills_the_named_outputs(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "b.md").write_text("## The runs\n\nrows\n\n## Other part\n\nnot\n")
    text = "<!-- table: out/b.md#The runs -->\n<!-- end table -->\n<!-- table: out/missing.md -->\nold\n<!-- end table -->\n"
    assert paste.render(text, tmp_path, only=("out/b.md",)) == (
        "<!-- table: out/b.md#The runs -->\nrows\n<!-- end table -->\n<!-- table: out/missing.md -->\nold\n"
        "<!-- end table -->\n")
    with pytest.raises(SystemExit, match="out/missing.md: no such output"):  # without `only`, every block is filled
        paste.render(text, tmp_path)
