"""`tokenunlearn`: one subcommand per DVC stage (and `sweep`); each a thin wrapper: read params, call `pipeline`."""

import logging
import os
import sys

import click

from pipeline.common.distributed import shutdown_distributed
from pipeline.common.errors import TokenUnlearnError, system_error
from pipeline.common.reproducible import pin_threads

from . import (attribute, check_models, code_deps, compare_attribution, corpora, diagnose, evaluate, finetune,
               inspect, muse, muse_report, pipelines, reference, relearn, report, report_seeds, sweep, tokenizer,
               tune, unlearn, world)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", is_flag=True, help="Debug logging (and a traceback with every error).")
@click.option("--local_rank", "--local-rank", type=int, default=None, hidden=True,
              help="Set by the `deepspeed` launcher.")
def cli(verbose: bool, local_rank: int | None) -> None:
    """TokenUnlearn: token-level attribution for precise LLM unlearning."""
    if local_rank is not None:
        os.environ["LOCAL_RANK"] = str(local_rank)
    level = logging.DEBUG if verbose else (logging.INFO if int(os.environ.get("RANK", "0")) == 0 else logging.WARNING)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    for noisy in ("DeepSpeed", "torch.distributed", "datasets", "filelock", "urllib3", "httpx", "absl"):
        logging.getLogger(noisy).setLevel(max(level, logging.WARNING))
    pin_threads()  # CPU reproducibility (pipeline/common/reproducible.py)


for command in (*(m.command for m in (world, tokenizer, finetune, check_models, attribute, reference, inspect, unlearn,
                                     evaluate, report, report_seeds, tune, compare_attribution, relearn, sweep,
                                     diagnose, corpora)), attribute.download_command, evaluate.export_command,
                *code_deps.commands, pipelines.command, *muse.commands, *muse_report.commands):
    cli.add_command(command)


def _end_progress_bars() -> None:
    """Close the bars a failed stage left open, so its error starts on a line of its own."""
    from tqdm import tqdm
    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()


def _error(message: str) -> None:
    _end_progress_bars()
    click.echo(f"tokenunlearn: error: {message}", err=True)


def run(args: list[str] | None = None) -> int:
    """Run the command line and return its exit status: 0, 2 for an error of the user's input or machine (printed
    as one line, nothing half-written), 1 for an abort or an unexpected error (one line; its traceback with -v)."""
    try:
        cli.main(args=args, prog_name="tokenunlearn", standalone_mode=False)
    except TokenUnlearnError as e:
        _error(str(e))
        return 2
    except click.exceptions.Abort:
        click.echo("Aborted!", err=True)
        return 1
    except click.ClickException as e:
        e.show()
        return e.exit_code
    except Exception as e:  # noqa: BLE001 - the last line of defence: no traceback reaches a user without -v
        if {"-v", "--verbose"} & set(args if args is not None else sys.argv):
            raise
        system = system_error(e)
        if system:
            _error(f"{system}; the stage stopped and left no half-written output: free space (or fix the "
                   "permission) and run it again")
            return 2
        message = (str(e).strip().splitlines() or [""])[0][:300]
        _error(f"unexpected {type(e).__name__}: {message} (a bug, or an input no check caught: run again with -v "
               "for the traceback, and please report it)")
        return 1
    return 0


def main() -> None:
    try:
        status = run()
    finally:
        shutdown_distributed()
    sys.exit(status)


if __name__ == "__main__":
    main()
