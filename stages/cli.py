"""`tokenunlearn`: one subcommand per DVC stage (and `sweep`); each a thin wrapper: read params, call `pipeline`."""

import logging
import os
import sys

import click

from pipeline.common.cli_errors import guarded
from pipeline.common.distributed import shutdown_distributed
from pipeline.common.reproducible import pin_threads

from . import (attribute, check_models, code_deps, compare_attribution, corpora, diagnose, evaluate, export,
               finetune, inspect, muse, muse_report, own_data, pipelines, reference, relearn, report, report_seeds, sweep,
               tokenizer, tune, unlearn, world)


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
                                     diagnose, corpora, own_data, export)), attribute.download_command, evaluate.export_command,
                *code_deps.commands, pipelines.command, *muse.commands, *muse_report.commands):
    cli.add_command(command)


def run(args: list[str] | None = None) -> int:
    """Run the command line and return its exit status (see `guarded`; an error leaves nothing half-written)."""
    def command_line() -> None:  # a command's return value is no exit status
        cli.main(args=args, prog_name="tokenunlearn", standalone_mode=False)

    return guarded(command_line, "tokenunlearn", bool({"-v", "--verbose"} & set(sys.argv if args is None else args)),
                   "the stage stopped and left no half-written output")


def main() -> None:
    try:
        status = run()
    finally:
        shutdown_distributed()
    sys.exit(status)


if __name__ == "__main__":
    main()
