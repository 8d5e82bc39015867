"""What DVC knows: which stages are up to date, and recording stages that ran in dvc.lock (as `dvc repro` does
after each stage). The sweep's driver calls these one batch at a time, between the stages it runs.

DVC parses a pipeline's whole dvc.lock for every stage it loads (seconds for the embedded sweep's 130 stages), so
both calls take a batch: one parse for all the stages that became ready, or ended, at the same time."""

from __future__ import annotations

import contextlib
import logging
import time
from collections import defaultdict
from pathlib import Path

from pipeline.common.errors import DataError

log = logging.getLogger(__name__)

LOCK_WAIT_S = 600  # another DVC command on the same repository (a `dvc status`, a `dvc commit`) holds its lock


@contextlib.contextmanager
def locked_repo(root: Path, wait_s: float = LOCK_WAIT_S):
    """The DVC repository with its lock held, waiting for another DVC process to let go of it (DVC itself gives up
    after a few seconds, which would fail a stage that ran well) for up to `wait_s` seconds."""
    from dvc.lock import LockError
    from dvc.repo import Repo

    deadline = time.monotonic() + wait_s
    while True:
        repo = Repo(str(root))
        try:
            repo.lock.lock()
        except LockError:
            repo.close()
            if time.monotonic() > deadline:
                raise
            log.info("%s: another DVC process holds the lock; waiting", root)
            time.sleep(2)
            continue
        try:
            yield repo
        finally:
            repo.lock.unlock()
            repo.close()
        return


class DvcLedger:
    def __init__(self, root: Path):
        self.root = Path(root)

    def _stages(self, repo, addresses: list[str]):
        """(address, stage) for each address, grouped by dvc.yaml, with one parse per file. DVC reads a relative
        path from the working directory, so the file is made absolute."""
        files = defaultdict(list)
        for address in addresses:
            path, _, name = address.rpartition(":")
            files[str(self.root / (path or "dvc.yaml"))].append((address, name))
        for path, wanted in files.items():
            stages = {s.name: s for s in repo.stage.collect(path)}
            missing = sorted(name for _, name in wanted if name not in stages)
            if missing:
                raise DataError(f"{path}: no stage {missing}")
            yield [(address, stages[name]) for address, name in wanted]

    def stale(self, addresses: list[str]) -> set[str]:
        """The addresses that `dvc repro` would run: a changed command, param or dependency, or missing outputs.
        Asked once every chosen stage before them is recorded, so DVC sees their new outputs."""
        from dvc.exceptions import DvcException

        try:
            with locked_repo(self.root) as repo:
                return {a for group in self._stages(repo, addresses) for a, stage in group if stage.changed()}
        except DvcException as e:
            raise DataError(f"{', '.join(addresses)}: DVC cannot tell whether they are up to date: {e}") from None

    def record(self, addresses: list[str]) -> None:
        """The stages' deps, params and outs into dvc.lock and their outputs into the cache, as `dvc commit --force`
        does for each (its own steps: save, commit, then one write of the lock file per dvc.yaml)."""
        from dvc.exceptions import DvcException

        try:
            with locked_repo(self.root) as repo:
                for group in self._stages(repo, addresses):
                    stages = [stage for _, stage in group]
                    for stage in stages:
                        stage.save()
                        stage.commit()
                    stages[0].dvcfile.dump_stages(stages, update_pipeline=False)
        except DvcException as e:  # an output the stage did not write, say
            raise DataError(f"{', '.join(addresses)}: dvc commit failed: {e}") from None
