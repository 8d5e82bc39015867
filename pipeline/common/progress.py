"""Progress bars on long loops (tqdm on stderr), shown by the main process only."""

from __future__ import annotations

from typing import Iterable, TypeVar

T = TypeVar("T")


def progress(iterable: Iterable[T], total: int | None = None, desc: str = "", unit: str = "batch") -> Iterable[T]:
    from tqdm import tqdm

    from pipeline.common.distributed import is_main_process

    return tqdm(iterable, total=total, desc=desc, unit=unit, leave=False, mininterval=2.0, dynamic_ncols=True,
                disable=not is_main_process())
