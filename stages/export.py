"""Stage `export`: what a user gets back from a forget request: the unlearned model in `save_pretrained` layout
with its model card, and each forget question's (and a retain sample's) answer before and after unlearning."""

import json
import logging
from pathlib import Path

import click

from pipeline.common.atomic import hold_outputs
from pipeline.studies.request import export_request, run_settings
from pipeline.training.run_config import run_configs

from .options import NAME, params_options

log = logging.getLogger(__name__)


@click.command("export")
@click.argument("name", type=NAME)
@params_options
@click.option("--model", required=True, type=click.Path(file_okay=False),
              help="The unlearned model: a run's seed{S}/model (artifacts/unlearn/NAME/seed0/model).")
@click.option("--before", required=True, type=click.Path(file_okay=False),
              help="The evaluation of the model before unlearning (tokenunlearn evaluate target ...).")
@click.option("--after", required=True, type=click.Path(file_okay=False),
              help="The evaluation of the unlearned model, on the same data.")
@click.option("--data-manifest", type=click.Path(dir_okay=False),
              help="own-data's manifest.json [data.source/manifest.json where it is there]: what was forgotten.")
@click.option("--retain-sample", default=20, show_default=True, type=click.IntRange(min=1),
              help="Retain items in the before/after table (spread over the set).")
@click.option("--out", required=True, type=click.Path(file_okay=False),
              help="Output directory: the model files, README.md (the model card), before_after/*.parquet and "
                   "before_after.md.")
def command(name, params: dict, model, before, after, data_manifest, retain_sample, out) -> None:
    """Export run NAME's unlearned model with its model card and the before/after tables (params: unlearn, data)."""
    cfg, train = run_configs(params, name)
    manifest_file = Path(data_manifest) if data_manifest else Path(str(params["data"]["source"])) / "manifest.json"
    manifest = None
    if manifest_file.is_file():
        manifest = json.loads(manifest_file.read_text())
        if manifest.get("written_by") != "tokenunlearn own-data":
            manifest = None  # a benchmark's directory: its own manifest says nothing of a forget request
    run_config = run_settings(cfg, train)
    with hold_outputs(out):
        export_request(name, run_config, Path(model), Path(before), Path(after), Path(out), manifest, retain_sample)
