"""`tokenunlearn code-deps`: check (or `--write`) every DVC stage's code dependencies against its imports."""

import logging
from pathlib import Path

import click

from pipeline.common.errors import DataError
from pipeline.sweep.code_deps import stale_code_deps, write_code_deps

log = logging.getLogger(__name__)


@click.command("code-deps")
@click.argument("dvc_files", nargs=-1, type=click.Path(exists=True, dir_okay=False))
@click.option("--write", is_flag=True, help="Rewrite the stale deps in place (else: list them, exit 1 if any).")
def command(dvc_files, write) -> None:
    """Each stage's `pipeline/` and `stages/` deps are the files its command imports (dvc.yaml and
    experiments/*/dvc.yaml by default): no one keeps them by hand. Run with --write after adding an import."""
    repo = Path.cwd()
    files = [Path(f) for f in dvc_files] or [repo / "dvc.yaml", *sorted((repo / "experiments").glob("*/dvc.yaml"))]
    root = click.get_current_context().find_root().command
    commands = {name: repo / f"{c.callback.__module__.replace('.', '/')}.py" for name, c in root.commands.items()}
    stale = 0
    for dvc_file in files:
        if write:
            for stage in write_code_deps(repo, dvc_file, commands):
                log.info("%s: %s's code deps rewritten", dvc_file, stage)
            continue
        for stage, (have, wanted) in stale_code_deps(repo, dvc_file, commands).items():
            stale += 1
            extra, missing = sorted(set(have) - set(wanted)), sorted(set(wanted) - set(have))
            log.warning("%s: %s: missing %s, not run %s", dvc_file, stage, missing or "none", extra or "none")
    if stale:
        raise DataError(f"{stale} stage(s) list other code than they run: `tokenunlearn code-deps --write`")
