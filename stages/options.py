"""Options shared by the stage commands."""

import click

params_option = click.option(
    "--params", "params_file", default="params.yaml", show_default=True, type=click.Path(dir_okay=False),
    help="The params file (DVC's params.yaml).",
)

overlay_option = click.option(
    "--overlay", default=None, metavar="SECTION",
    help="Apply the params' overlay SECTION first (e.g. corpus: the WMDP-style run's changes to the sections).",
)

shards_option = click.option(
    "--shards", default="artifacts/attribution", show_default=True, type=click.Path(file_okay=False),
    help="The attribution shards of the forget set (stage one's output).",
)
