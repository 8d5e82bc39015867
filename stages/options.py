"""Options shared by the stage commands."""

import click

params_option = click.option(
    "--params", "params_file", default="params.yaml", show_default=True, type=click.Path(dir_okay=False),
    help="The params file (DVC's params.yaml).",
)
