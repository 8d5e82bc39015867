"""`tokenunlearn code-deps`: check (or `--write`) every DVC stage's code dependency against its imports;
`tokenunlearn code-manifests`: the `code` stage, each command's and script's manifest of the files it runs."""

import logging
from pathlib import Path

import click

from pipeline.common.errors import DataError
from pipeline.sweep.code_deps import (code_repo, stale_code_deps, unwritten_manifests, write_code_deps,
                                      write_manifests)

log = logging.getLogger(__name__)


def _command_modules() -> dict[str, Path]:
    """tokenunlearn's commands -> the module each lives in."""
    root = click.get_current_context().find_root().command
    return {name: code_repo() / f"{c.callback.__module__.replace('.', '/')}.py" for name, c in root.commands.items()}


@click.command("code-deps")
@click.argument("dvc_files", nargs=-1, type=click.Path(exists=True, dir_okay=False))
@click.option("--write", is_flag=True, help="Rewrite the stale deps in place (else: list them, exit 1 if any).")
def command(dvc_files, write) -> None:
    """Each stage's code dependency is the manifest of the files its command imports, and the `code` stage's
    deps are every such file (dvc.yaml, experiments/dvc.yaml and experiments/*/dvc.yaml by default): no one keeps
    them by hand. Run with --write after adding a module, an import or a stage."""
    repo = code_repo()
    files = [Path(f) for f in dvc_files] or [f for f in (repo / "dvc.yaml", repo / "experiments" / "dvc.yaml",
                                                         *sorted((repo / "experiments").glob("*/dvc.yaml")))
                                             if f.is_file()]
    commands = _command_modules()
    unwritten = unwritten_manifests(repo, files, commands)
    if unwritten:
        raise DataError(f"no `code` stage writes these stages' code manifests (add the script to its --script): "
                        f"{'; '.join(unwritten)}")
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


@click.command("code-manifests")
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="The manifests' directory (the `code` stage's output, artifacts/code).")
@click.option("--script", "scripts", multiple=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="A script a stage runs with `python SCRIPT.py`, beside every tokenunlearn command (repeatable).")
def manifests_command(out, scripts) -> None:
    """Write OUT/stages/COMMAND.md5 for every command module and OUT/PATH.md5 for each script: the md5 and path of
    every project file it runs (md5sum's format). A stage depends on its manifest, so that an edit reruns only
    the stages whose code imports the edited file."""
    repo = code_repo()
    written = write_manifests(repo, sorted(set(_command_modules().values())) + [p.resolve() for p in scripts], out)
    log.info("code-manifests: %d manifests in %s", len(written), out)


commands = (command, manifests_command)
