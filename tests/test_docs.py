"""The front door stays a front door: a short README whose first commands are the two that do everything, links
that lead somewhere, and no issue numbers a reader cannot look up."""

import re

import pytest

from tests.conftest import REPO

PAGES = [REPO / "README.md", REPO / "RESULTS.md", *sorted((REPO / "docs").glob("*.md"))]


def test_the_readme_is_short_and_opens_with_the_two_commands():
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250
    first_code = lines[lines.index("```bash") + 1: lines.index("```bash") + 3]
    assert [line.split()[:2] for line in first_code] == [["make", "demo"], ["make", "test"]]
    assert "make test" in (REPO / ".ci" / "run").read_text()  # CI runs the README's test command


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_leads_to_a_file_and_no_issue_number_is_left(page):
    text = page.read_text(encoding="utf-8")
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if not re.match(r"[a-z]+://", target):
            assert (page.parent / target).exists(), f"{page.name}: the link {target} leads nowhere"
    assert not re.search(r"\bissues? \d+", text, re.I), f"{page.name} names an issue number"
