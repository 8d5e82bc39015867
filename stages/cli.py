"""`tokenunlearn`: one subcommand per DVC stage. Each is a thin wrapper: read params, call `pipeline`, write."""

from __future__ import annotations

import logging
import os
import sys

import click

from pipeline.common.distributed import shutdown_distributed
from pipeline.common.errors import TokenUnlearnError

from . import attribute, check_models, evaluate, finetune, inspect, report, tokenizer, tune, unlearn, world


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
@click.option("--local_rank", "--local-rank", type=int, default=None, hidden=True,
              help="Set by the `deepspeed` launcher.")
def cli(verbose: bool, local_rank: int | None) -> None:
    """TokenUnlearn: token-level attribution for precise LLM unlearning."""
    if local_rank is not None:
        os.environ["LOCAL_RANK"] = str(local_rank)
    rank = int(os.environ.get("RANK", "0"))
    level = logging.DEBUG if verbose else (logging.INFO if rank == 0 else logging.WARNING)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    for noisy in ("DeepSpeed", "torch.distributed", "datasets", "filelock", "urllib3", "httpx"):
        logging.getLogger(noisy).setLevel(max(level, logging.WARNING))


for command in (world.command, tokenizer.command, finetune.command, check_models.command, attribute.command,
                attribute.download_command, inspect.command, unlearn.command, evaluate.command,
                report.command, tune.command):
    cli.add_command(command)


def main() -> None:
    try:
        cli.main(prog_name="tokenunlearn", standalone_mode=False)
    except TokenUnlearnError as e:
        # A user error: one line, no traceback.
        click.echo(f"tokenunlearn: error: {e}", err=True)
        sys.exit(2)
    except click.exceptions.Abort:
        click.echo("Aborted!", err=True)
        sys.exit(1)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    finally:
        shutdown_distributed()


if __name__ == "__main__":
    main()
