"""How every command line of the project ends (the CLI's and each script's under experiments/ and benchmarks/):
its status, or one line for an error and no traceback without -v. Light on imports, so a script pays for no torch."""

import sys
from pathlib import Path
from typing import Callable, NoReturn

import click

from pipeline.common.errors import TokenUnlearnError, system_error


def _error(prog: str, message: str, status: int) -> int:
    """One line, and the exit status; the bars a failed stage left open closed first, so it starts a line of its own."""
    from tqdm import tqdm
    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()
    click.echo(f"{prog}: error: {message}", err=True)
    return status


def guarded(body: Callable[[], object], prog: str, verbose: bool, left: str = "it stopped") -> int:
    """`body` (a command line's work) ended as every command line of the project ends: its status (an int it
    returns, or 0); 2 and one line for an error of the user's input or machine; 1 for an abort or an unexpected
    error (one line; raised, for its traceback, when `verbose`). `left`: what a full disk's line says is left."""
    try:
        status = body()
    except TokenUnlearnError as e:
        return _error(prog, str(e), 2)
    except (click.exceptions.Abort, KeyboardInterrupt):
        click.echo("Aborted!", err=True)
        return 1
    except click.ClickException as e:
        e.show()
        return e.exit_code
    except Exception as e:  # noqa: BLE001 - the last line of defence: no traceback reaches a user without -v
        if verbose:
            raise
        if system := system_error(e):
            return _error(prog, f"{system}; {left}: free space (or fix the permission) and run it again", 2)
        message = (str(e).strip().splitlines() or [""])[0][:300]
        return _error(prog, f"unexpected {type(e).__name__}: {message} (a bug, or an input no check caught: run again "
                      "with -v for the traceback, and please report it)", 1)
    return status if type(status) is int else 0


def run_script(main: Callable[[], object]) -> NoReturn:
    """A script's entry point (experiments/, benchmarks/): `main`, a click command or a function that reads
    sys.argv, with the CLI's error handling; -v/--verbose (a traceback) is taken off its command line."""
    prog, verbose = Path(sys.argv[0]).name, bool({"-v", "--verbose"} & set(sys.argv[1:]))
    sys.argv[1:] = [a for a in sys.argv[1:] if a not in ("-v", "--verbose")]
    body = main
    if isinstance(main, click.Command):
        def body():
            return main.main(args=sys.argv[1:], prog_name=prog, standalone_mode=False)
    sys.exit(guarded(body, prog, verbose))
