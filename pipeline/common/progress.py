"""Progress of long loops, shown by the main process only: a tqdm bar where stderr is a terminal, and where it is
not (a pipe, a DVC stage, a log file, CI) a plain log line every `LOG_INTERVAL` seconds and one at the end, so that
a log holds no redraws. A loop shorter than that interval logs nothing."""

from __future__ import annotations

import logging
import sys
import time
from typing import Callable, Iterable, Iterator, TextIO, TypeVar

T = TypeVar("T")

log = logging.getLogger(__name__)

LOG_INTERVAL = 30.0  # seconds between two log lines of one loop


def progress(iterable: Iterable[T] | None = None, total: int | None = None, desc: str = "", unit: str = "batch",
             initial: int = 0, leave: bool = False, stream: TextIO | None = None,
             clock: Callable[[], float] = time.monotonic) -> "Iterable[T] | LogProgress":
    """A tqdm bar on a terminal, else a `LogProgress`; both iterate over `iterable` and have `update(n)`,
    `set_postfix(**values)` and `close()`. `leave`: the bar stays once done (outer loops; inner ones vanish).
    `stream`: where the bar would go [sys.stderr]; `clock`: the log lines' clock (tests give fake ones)."""
    from tqdm import tqdm

    from pipeline.common.distributed import is_main_process

    stream = stream or sys.stderr
    if not is_main_process():
        return tqdm(iterable, total=total, disable=True)
    if _is_terminal(stream):
        return tqdm(iterable, total=total, desc=desc, unit=unit, initial=initial, leave=leave, file=stream,
                    mininterval=1.0, dynamic_ncols=True)
    return LogProgress(iterable, total, desc, unit, initial, clock)


def _is_terminal(stream) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


class LogProgress:
    """A progress bar's stand-in for a stream that is no terminal: `desc: step 150/525 (29%), loss 0.934,
    4.4 steps/s, eta 1m25s` at most every `interval` seconds, and a last line on `close` if the loop logged any."""

    def __init__(self, iterable: Iterable[T] | None = None, total: int | None = None, desc: str = "",
                 unit: str = "batch", initial: int = 0, clock: Callable[[], float] = time.monotonic,
                 interval: float = LOG_INTERVAL):
        if total is None and hasattr(iterable, "__len__"):
            total = initial + len(iterable)  # as tqdm: a resumed loop's iterable holds the steps left
        self.iterable, self.total, self.desc, self.unit = iterable, total, desc, unit
        self.n, self.initial = initial, initial
        self.clock, self.interval = clock, interval
        self.started = self.last_logged = clock()
        self.logged_n: int | None = None  # the count of the last line logged (None: none yet)
        self.postfix: dict[str, object] = {}
        self.closed = False

    def __iter__(self) -> Iterator[T]:
        for item in self.iterable or ():
            yield item
            self.update(1)
        self.close()

    def update(self, n: int = 1) -> None:
        self.n += n
        now = self.clock()
        finished = self.total is not None and self.n >= self.total  # `close` logs that one, with the time taken
        if now - self.last_logged >= self.interval and not finished:
            self._log(now, last=False)

    def set_postfix(self, **values) -> None:
        self.postfix = values

    def close(self) -> None:
        """The last line, where the loop was long enough to log any (a short loop stays silent)."""
        if self.closed:
            return
        self.closed = True
        now = self.clock()
        if now - self.started >= self.interval and self.logged_n != self.n:
            self._log(now, last=True)

    def _log(self, now: float, last: bool) -> None:
        self.last_logged, self.logged_n = now, self.n
        done = f"{self.unit} {self.n}" + (f"/{self.total} ({100 * self.n // max(self.total, 1)}%)"
                                          if self.total else "")
        parts = [done, *(f"{key} {_number(value)}" for key, value in self.postfix.items())]
        elapsed = now - self.started
        rate = (self.n - self.initial) / elapsed if elapsed > 0 else 0.0
        if rate > 0:
            parts.append(f"{rate:.1f} {_plural(self.unit)}/s" if rate >= 1 else f"{1 / rate:.1f} s/{self.unit}")
        if last:
            parts.append(f"done in {_duration(elapsed)}")
        elif rate > 0 and self.total:
            parts.append(f"eta {_duration((self.total - self.n) / rate)}")
        log.info("%s: %s", self.desc or "progress", ", ".join(parts))


def _number(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _plural(unit: str) -> str:
    return unit + ("es" if unit.endswith(("s", "x", "ch", "sh")) else "s")


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
