"""`tokenunlearn sweep`: a DVC pipeline's chosen stages on Ray (params: sweep), recorded in dvc.lock."""

import logging
from pathlib import Path

import click

from pipeline.common.errors import TokenUnlearnError
from pipeline.common.params import check_keys, load_params, section
from pipeline.sweep.ledger import DvcLedger
from pipeline.sweep.plan import (downstream_closure, plan_from_dvc, read_plan, record_outcome, refuse_unseen_changes,
                                 resources_table, write_plan)
from pipeline.sweep.runner import run_sweep

from .options import params_options

log = logging.getLogger(__name__)


@click.command("sweep")
@click.argument("pipeline", required=False)
@click.argument("patterns", nargs=-1)
@params_options
@click.option("--address", help="A Ray cluster's address (HOST:PORT, or `auto` on one of its nodes) [none: a local "
                                "Ray on this machine].")
@click.option("--workers", type=int, help="A local Ray's CPUs: with each stage's `cpus`, how many run at once "
                                          "[all cores].")
@click.option("--first", multiple=True, help="Start the stages matching this pattern first (long ones: 'tune@*').")
@click.option("--force", is_flag=True, help="Run the chosen stages even where DVC has them up to date.")
@click.option("--log-dir", type=click.Path(file_okay=False, path_type=Path), default=Path("artifacts/logs/sweep"),
              show_default=True, help="Each stage's log (STAGE.log) and the outcome (sweep.json).")
@click.option("--write-plan", "plan_out", type=click.Path(dir_okay=False, path_type=Path),
              help="Only write the stages to run (those not up to date, and what follows them) as JSON.")
@click.option("--plan", "plan_file", type=click.Path(dir_okay=False, path_type=Path),
              help="Run this plan file, without DVC (nothing recorded: see --record).")
@click.option("--record", type=click.Path(dir_okay=False, path_type=Path),
              help="Only record in dvc.lock the stages a --plan run finished (its sweep.json), where DVC is; a "
                   "stage whose "
                   "command, params or inputs changed since --write-plan is refused.")
def command(pipeline, patterns, params, address, workers, first, force, log_dir, plan_out, plan_file, record):
    """Run PIPELINE's stages matching PATTERNS ('unlearn@*' report) on Ray, each as soon as those it needs are
    done, and record them in dvc.lock as `dvc repro` would. Stopped (Ctrl-C, SIGTERM, its terminal closed), it
    ends the stages running, records none of them and exits with an error: the same command resumes it."""
    root = Path.cwd()
    given = click.get_current_context().params
    refuse_unseen_changes(load_params(given["params_file"]), params, given["overrides"], given["overlays"],
                          given["params_file"], reads_params=not (record or plan_file))
    if record:
        record_outcome(record, DvcLedger(root))
        return
    if plan_file:
        plan, ledger = read_plan(plan_file), None
    elif pipeline and patterns:
        table = resources_table(check_keys(section(params, "sweep"), ["resources"], "sweep").get("resources"))
        plan, ledger = plan_from_dvc(pipeline, list(patterns), root, table), DvcLedger(root)
        ledger.refresh_code()
    else:
        raise click.UsageError("give a pipeline and stage patterns, or --plan FILE, or --record FILE")
    if plan_out:
        if ledger is None:
            raise click.UsageError("--write-plan asks DVC what to run: give a pipeline and patterns, not --plan")
        stale = {e["stage"] for e in plan} if force else ledger.stale([e["stage"] for e in plan])
        todo = downstream_closure(plan, {e["name"] for e in plan if e["stage"] in stale})
        chosen = [e for e in plan if e["name"] in todo]
        marks = ledger.fingerprints([e["stage"] for e in chosen])  # for --record to check each stage is still this
        write_plan([{**e, "fingerprint": marks[e["stage"]]} for e in chosen], plan_out)
        log.info("%d of %d stages to run, written to %s", len(todo), len(plan), plan_out)
        return
    result = run_sweep(plan, root, log_dir, address=address, workers=workers, first=first, ledger=ledger,
                       force=force)
    counts = {s: len(result.named(s)) for s in ("done", "up to date", "failed", "blocked")}
    log.info("sweep: %s in %.0f s (%s)", ", ".join(f"{n} {s}" for s, n in counts.items()), result.seconds,
             log_dir / "sweep.json")
    if counts["failed"] or counts["blocked"]:
        raise TokenUnlearnError(f"stages failed: {', '.join(result.named('failed'))}; not run: "
                                f"{', '.join(result.named('blocked')) or 'none'} (logs in {log_dir})")
