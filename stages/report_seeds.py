"""Stage `report-seeds`: the main table over model seeds × unlearning seeds, each token-level variant against
its method with a paired bootstrap interval, and their bisections' trade-off curves compared at equal utility
(params: seeds, unlearn.seeds, unlearn.runs, tune)."""

import json
import logging
from pathlib import Path

import click

from pipeline.common.atomic import atomic_file, hold_outputs
from pipeline.evaluation.eval_io import write_strict_json
from pipeline.common.errors import ParamError
from pipeline.common.params import check_keys, section
from pipeline.studies.report import run_row
from pipeline.studies.significance import (comparison_table, comparisons, comparisons_heading, load_cells,
                                              lr_table, main_table, models_table, variant_pairs)
from pipeline.studies.tradeoff import write_curves

from .options import params_options

log = logging.getLogger(__name__)


@click.command("report-seeds")
@params_options
@click.option("--root", default="artifacts/seeds", show_default=True, type=click.Path(file_okay=False),
              help="The model seeds' directories, m{SEED}/ (experiments/seeds/dvc.yaml).")
@click.option("--models-root", type=click.Path(file_okay=False), default=None,
              help="Where m{SEED}/models and m{SEED}/eval of the target and retain model are, when the runs reuse "
              "another experiment's models (experiments/methods: artifacts/seeds) [default: --root].")
@click.option("--experiment", default="seeds", show_default=True,
              help="The params section naming the model seeds and runs (its `models` and `runs`): seeds or ladder.")
@click.option("--out", default="artifacts/seeds/report", show_default=True, type=click.Path(file_okay=False),
              help="results.md, results.csv, comparisons.csv, comparisons.json, curves.csv, curve_comparisons.csv and "
              "tradeoff_{method}.png.")
def command(params: dict, root, models_root, experiment, out) -> None:
    """The table of the runs over the model seeds × unlearn.seeds (params: seeds, or --experiment's section), and
    the variant − method comparisons."""
    keys = {"seeds": ("models", "runs", "bootstrap"), "ladder": ("rungs", "models", "runs")}
    if experiment not in keys:
        raise click.BadParameter("seeds or ladder", param_hint="--experiment")
    if experiment not in params:  # the section is an overlay's, never params.yaml's
        raise ParamError(f"the params have no `{experiment}` section (the model seeds and runs to report): give "
                         f"its overlay, e.g. --overlay configs/{experiment}.yaml")
    seeds = section(params, experiment)
    check_keys(seeds, keys[experiment], experiment)
    runs_params, defaults = section(params, "unlearn.runs"), section(params, "unlearn.defaults")
    unknown = [n for n in seeds["runs"] if n not in runs_params]
    if unknown:
        raise ParamError(f"{experiment}.runs: {unknown} are not runs of unlearn.runs")
    boot = {"samples": 10000, "confidence": 0.95, "seed": 0, **(section(params, "seeds").get("bootstrap") or {})}
    specs = {n: {**defaults, **runs_params[n]} for n in seeds["runs"]}
    labels = {"target": "before unlearning", "retain": "retain model",
              **{n: run_row(n, s, {}).label + (f" mix {s['mix']}" if s.get("mix") else "")  # T-NPO [learned]
                 + (" first" if s.get("focus") == "first" else "")
                 for n, s in specs.items()}}
    model_seeds, unlearn_seeds = list(seeds["models"]), list(section(params, "unlearn.seeds"))
    models = Path(models_root or root)
    cells = load_cells(Path(root), model_seeds, seeds["runs"], unlearn_seeds, models)
    pairs = variant_pairs(specs, seeds["runs"])
    results, level = comparisons(cells, pairs, boot["confidence"], boot["samples"], boot["seed"])
    table_md, table_csv = main_table(cells, labels)
    comp_md, comp_csv = comparison_table(results, labels, level)
    lrs_md = lr_table(Path(root), model_seeds, seeds["runs"], labels)
    counts = {v: sum(r["verdict"] == v for r in results) for v in ("better", "worse", "undecided")}
    out_dir = Path(out)
    with hold_outputs(out_dir):
        text = (f"## The main table over {len(model_seeds)} model seeds × {len(unlearn_seeds)} unlearning seeds\n\n"
                "### Before unlearning: each model seed's target and retain model\n\n"
                + models_table(models, model_seeds) + "\n### The runs\n\n"
                "Each cell: mean over every (model seed, unlearning seed) ± standard deviation between model seeds "
                "(of their means) / within them (over unlearning seeds).\n\n" + table_md
                + f"\n### {comparisons_heading(specs, pairs)}: {len(results)} comparisons\n\n"
                f"Paired on (model seed, unlearning seed); two-level bootstrap ({boot['samples']} draws: model seeds, "
                f"then unlearning seeds within each); family-wise confidence {boot['confidence']} by Bonferroni over "
                f"the {len(results)} comparisons. Verdicts: {counts['better']} better, {counts['worse']} worse, "
                f"{counts['undecided']} undecided.\n\n" + comp_md
                + "\n### Learning rates: bisected onto the utility floor per model seed\n\n" + lrs_md + "\n"
                + write_curves(Path(root), model_seeds, seeds["runs"], specs, pairs, out_dir))
        with atomic_file(out_dir / "results.md") as f:
            f.write(text)
        with atomic_file(out_dir / "results.csv") as f:
            f.write(table_csv)
        with atomic_file(out_dir / "comparisons.csv") as f:
            f.write(comp_csv)
        write_strict_json(out_dir / "comparisons.json", {"level": level, "comparisons": len(results), "verdicts": counts,
                                                  "model_seeds": model_seeds, "unlearn_seeds": unlearn_seeds,
                                                  "results": results})
    log.info("report-seeds: %d comparisons (%s) in %s/results.md", len(results), json.dumps(counts), out)
