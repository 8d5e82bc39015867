"""Regenerate RESULTS.md's tables from the report stages' outputs: one command after the pipelines.

Each generated block of the file is fenced by two comments, `<!-- table: PATH -->` and `<!-- end table -->`
(optionally `<!-- table: PATH#HEADING -->`: only the part of a Markdown output under that heading, to the next
heading of the same or a higher level). The block's content is replaced by the file's; the prose around the blocks
is written by hand from those numbers. A missing output is an error naming it, and the file is written whole or
not at all.

    python experiments/paste_tables.py RESULTS.md          # after the pipelines that write them (make demo, ...)
    python experiments/paste_tables.py RESULTS.md --check  # exit 1 if a block differs from its output
    python experiments/paste_tables.py RESULTS.md --only experiments/artifacts/seeds/report/results.md  # one output
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pipeline.common.atomic import atomic_file  # noqa: E402

BLOCK = re.compile(r"(<!-- table: (?P<ref>[^\n]+?) -->\n)(?P<body>.*?)(<!-- end table -->)", re.S)  # a heading may hold spaces


def section(text: str, heading: str, where: str) -> str:
    """The lines under the Markdown heading `heading` (its own line excluded), to the next heading of its level or
    higher."""
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        m = re.match(r"(#+) (.*)", line.rstrip("\n"))
        if m and m.group(2).strip() == heading:
            level, out = len(m.group(1)), []
            for rest in lines[i + 1:]:
                n = re.match(r"(#+) ", rest)
                if n and len(n.group(1)) <= level:
                    break
                out.append(rest)
            return "".join(out).strip("\n") + "\n"
    raise SystemExit(f"{where}: no heading '{heading}'")


def render(text: str, root: Path, only: tuple[str, ...] = ()) -> str:
    """`only`: fill just the blocks of these outputs (paths as in the blocks), leaving the others as they are."""
    def fill(m: re.Match) -> str:
        ref = m.group("ref")
        path, _, heading = ref.partition("#")
        if only and path not in only:
            return m.group(0)
        file = root / path
        if not file.is_file():
            raise SystemExit(f"{file}: no such output (run the pipeline that writes it first)")
        body = file.read_text()
        body = section(body, heading, str(file)) if heading else body
        return m.group(1) + body.rstrip("\n") + "\n" + m.group(4)

    return BLOCK.sub(fill, text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", type=Path)
    parser.add_argument("--check", action="store_true", help="Only say whether every block is current.")
    parser.add_argument("--only", action="append", default=[], metavar="PATH",
                        help="Fill only the blocks of this output (repeatable), e.g. after one pipeline.")
    args = parser.parse_args()
    if not args.file.is_file():
        raise SystemExit(f"{args.file}: no such file (the Markdown file whose tables to fill)")
    text = args.file.read_text()
    new = render(text, REPO, tuple(args.only))
    if args.check:
        sys.exit(0 if new == text else 1)
    with atomic_file(args.file) as f:
        f.write(new)
    print(f"{args.file}: {len(BLOCK.findall(text))} tables from the report outputs")


if __name__ == "__main__":
    from pipeline.common.cli_errors import run_script  # the CLI's error handling: one line, an exit status, -v for a traceback
    run_script(main)
