"""`tokenunlearn`: one subcommand per DVC stage (and `sweep`); each a thin wrapper: read params, call `pipeline`."""

import errno
import logging
import os
import sys

import click

from pipeline.common.distributed import shutdown_distributed
from pipeline.common.errors import TokenUnlearnError
from pipeline.common.reproducible import pin_threads

from . import (attribute, check_models, code_deps, compare_attribution, evaluate, finetune, inspect, reference, relearn,
               report, report_seeds, sweep, tokenizer, tune, unlearn, world)


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


for command in (world.command, tokenizer.command, finetune.command, check_models.command, attribute.command,
                attribute.download_command, reference.command, inspect.command, unlearn.command, evaluate.command,
                evaluate.export_command, report.command, report_seeds.command, tune.command,
                compare_attribution.command, relearn.command, sweep.command, code_deps.command):
    cli.add_command(command)

SYSTEM_ERRNOS = {  # errors of the machine, not of the code: one line each, as the user's errors
    errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded", errno.EACCES: "permission denied",
    errno.EROFS: "read-only file system"}


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
    as one line, nothing half-written), 1 for an abort."""
    try:
        cli.main(args=args, prog_name="tokenunlearn", standalone_mode=False)
    except TokenUnlearnError as e:
        _error(str(e))
        return 2
    except OSError as e:
        if e.errno not in SYSTEM_ERRNOS or "-v" in (args or sys.argv) or "--verbose" in (args or sys.argv):
            raise
        where = f"{e.filename}: " if e.filename else ""
        _error(f"{where}{SYSTEM_ERRNOS[e.errno]} ({e.strerror}); the stage stopped and left no half-written "
               "output: free space (or fix the permission) and run it again")
        return 2
    except click.exceptions.Abort:
        click.echo("Aborted!", err=True)
        return 1
    except click.ClickException as e:
        e.show()
        return e.exit_code
    return 0


def main() -> None:
    try:
        status = run()
    finally:
        shutdown_distributed()
    sys.exit(status)


if __name__ == "__main__":
    main()
