"""`tokenunlearn pipelines`: check (or `--write`) each experiment's dvc.yaml against its rendering from
experiments/NAME/pipeline.yaml and the stage kinds of experiments/stages.yaml."""

import logging

import click

from pipeline.common.atomic import atomic_file
from pipeline.sweep.code_deps import code_repo
from pipeline.sweep.pipelines import stale_pipelines

from .code_deps import _command_modules  # the same commands as code-deps': the two generators agree

log = logging.getLogger(__name__)


@click.command("pipelines")
@click.option("--write", is_flag=True, help="Write the out-of-date dvc.yaml files (else: name them, exit 1 if any).")
def command(write) -> None:
    """Render experiments/NAME/dvc.yaml from experiments/NAME/pipeline.yaml (what the experiment is: its params
    file and overlays, artifacts folder, inputs and stages) and experiments/stages.yaml (each stage kind the
    pipelines share, defined once). Run with --write after editing either; never edit a dvc.yaml there by hand."""
    repo = code_repo()
    stale = stale_pipelines(repo, _command_modules())
    for dvc_file, text in stale:
        if write:
            with atomic_file(dvc_file) as f:
                f.write(text)
            log.info("%s written", dvc_file.relative_to(repo))
        else:
            log.warning("%s: out of date", dvc_file.relative_to(repo))
    if stale and not write:
        raise click.ClickException(f"{len(stale)} experiment pipeline(s) differ from their rendering: "
                                   "`tokenunlearn pipelines --write`")
    if not stale:
        log.info("every experiment's dvc.yaml is up to date")
