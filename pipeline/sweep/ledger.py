"""What DVC knows: which stages are up to date, and recording stages that ran in dvc.lock (as `dvc repro` does
after each stage). The sweep's driver calls these one batch at a time, between the stages it runs.

DVC parses a pipeline's whole dvc.lock for every stage it loads (seconds for the embedded sweep's 130 stages), so
both calls take a batch: one parse for all the stages that became ready, or ended, at the same time."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import stat
import time
from collections import defaultdict
from pathlib import Path

from pipeline.common.atomic import atomic_file
from pipeline.common.errors import DataError
from pipeline.common.locks import LockWait
from pipeline.sweep.plan import overlaps

log = logging.getLogger(__name__)

LOCK_WAIT_S = 600  # another DVC command on the same repository (a `dvc status`, a `dvc commit`) holds its lock


@contextlib.contextmanager
def locked_repo(root: Path, wait_s: float = LOCK_WAIT_S):
    """The DVC repository with its lock held, waiting for another DVC process to let go of it (DVC itself gives up
    after a few seconds, which would fail a stage that ran well) for up to `wait_s` seconds."""
    from dvc.lock import LockError
    from dvc.repo import Repo

    deadline = time.monotonic() + wait_s
    wait = LockWait(root / ".dvc" / "tmp" / "lock", "DVC's repository lock",
                    f"if no dvc command is running on {root}, delete it")
    while True:
        repo = Repo(str(root))
        try:
            repo.lock.lock()
        except LockError:
            repo.close()
            if time.monotonic() > deadline:
                raise
            wait.report()  # at once, then every 30 s: which lock, who holds it, how to clear it
            time.sleep(2)
            continue
        try:
            yield repo
        finally:
            repo.lock.unlock()
            repo.close()
        return


def dump_by_dvc(stages: list) -> None:
    """DVC's own record of `stages` (of one dvc.yaml) in its dvc.lock, as `dvc commit` writes it."""
    stages[0].dvcfile.dump_stages(stages, update_pipeline=False)


def write_lock(stages: list) -> None:
    """Record `stages` (of one dvc.yaml) in its dvc.lock as DVC's `dump_stages` does, by DVC's own serializer (the
    bytes DVC writes, for a lock DVC wrote: tests/sweep), but faster and whole: DVC parses the lock again
    round-trip, in pure Python, to keep comments a lock never has (10 s on a 2.5 MiB lock), and rewrites it in
    place, which a kill amid the write leaves truncated. Here DVC's fast parser reads it and a rename replaces it,
    with the lock's mode and group. A hand-edited lock loses its comments and spellings (`1.0e-05`), not values."""
    from dvc.stage.serialize import to_lockfile
    from dvc.utils.serialize import dumps_yaml, parse_yaml

    dvcfile = stages[0].dvcfile
    lock = Path(os.path.splitext(dvcfile.path)[0] + ".lock").resolve()  # DVC's rule; a linked lock stays a link
    ours = lock.is_file() and os.access(lock, os.W_OK) and os.access(lock.parent, os.W_OK)
    # read again, not DVC's `lockfile_contents` from the collection: that is its schema's copy, not the file's data
    data = parse_yaml(lock.read_text(encoding="utf-8"), str(lock)) if ours else None
    if not data:  # a new lock (DVC writes its header), or one DVC must refuse to write as it would
        dump_by_dvc(stages)
        return
    recorded = data.setdefault("stages", {})
    for stage in stages:
        recorded.update(to_lockfile(stage))
    before = lock.stat()
    with atomic_file(lock) as f:
        f.write(dumps_yaml(data))
        os.chmod(f.name, stat.S_IMODE(before.st_mode))  # a shared checkout's group-writable lock stays so
        with contextlib.suppress(OSError):
            os.chown(f.name, -1, before.st_gid)


class DvcLedger:
    def __init__(self, root: Path):
        self.root = Path(root)

    def refresh_code(self) -> None:
        """Run the project's `code` stage if it is not up to date (as `dvc repro code`): every stage depends on a
        manifest it writes, so only then does DVC see which stages an edit of the code changed."""
        from dvc.exceptions import DvcException
        from dvc.repo import Repo

        top = self.root / "dvc.yaml"
        if not top.is_file():
            return
        try:
            with Repo(str(self.root)) as repo:
                if "code" in {s.name for s in repo.stage.collect(str(top))}:
                    repo.reproduce(f"{top}:code", single_item=True)
        except DvcException as e:
            raise DataError(f"{top}: the stage `code` (the code manifests) failed: {e}") from None

    def _stages(self, repo, addresses: list[str], missing_ok: bool = False, parsed: dict | None = None):
        """(address, stage) for each address, grouped by dvc.yaml, with one parse per file (per `parsed`, the files
        already parsed in this call on `repo`: a large dvc.lock takes seconds to parse). DVC reads a relative path
        from the working directory, so the file is made absolute. A stage not there is an error, or (with
        `missing_ok`) left out."""
        parsed = {} if parsed is None else parsed
        files = defaultdict(list)
        for address in addresses:
            path, _, name = address.rpartition(":")
            files[str(self.root / (path or "dvc.yaml"))].append((address, name))
        for path, wanted in files.items():
            if path not in parsed:
                parsed[path] = {s.name: s for s in repo.stage.collect(path)}
            stages = parsed[path]
            missing = sorted(name for _, name in wanted if name not in stages)
            if missing and not missing_ok:
                raise DataError(f"{path}: no stage {missing}")
            yield [(address, stages[name]) for address, name in wanted if name in stages]

    def stale(self, addresses: list[str]) -> set[str]:
        """The addresses that `dvc repro` would run: a changed command, param or dependency, or missing outputs.
        Asked once every chosen stage before them is recorded, so DVC sees their new outputs."""
        from dvc.exceptions import DvcException

        try:
            with locked_repo(self.root) as repo:
                return {a for group in self._stages(repo, addresses) for a, stage in group if stage.changed()}
        except DvcException as e:
            raise DataError(f"{', '.join(addresses)}: DVC cannot tell whether they are up to date: {e}") from None

    def _fingerprint(self, stage, produced: list[str]) -> str:
        """What a stage's outputs follow from, apart from what the plan itself makes: its command, working
        directory, params values and the hashes of its other dependencies (DVC's own, as in dvc.lock). Taken when
        the plan is written and again when its run is recorded: if they differ, the outputs are of another stage."""
        def rel(path):
            return os.path.relpath(path, self.root)

        def value(dep):
            try:
                return dep.get_hash().value
            except Exception:  # noqa: BLE001 - a missing dependency: no hash, which differs from any real one
                return None

        deps = {f"{type(d).__name__}:{rel(d.fs_path)}": value(d) for d in stage.deps  # params and files apart
                if not any(overlaps(rel(d.fs_path), o) for o in produced)}
        what = {"cmd": stage.cmd, "wdir": rel(stage.wdir), "deps": deps}
        return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def _fingerprints(self, repo, addresses: list[str], planned: list[str], parsed: dict) -> dict[str, str]:
        planned_stages = self._stages(repo, planned, missing_ok=True, parsed=parsed)
        produced = [os.path.relpath(o.fs_path, self.root) for group in planned_stages for _, stage in group
                    for o in stage.outs]
        return {a: self._fingerprint(stage, produced)
                for group in self._stages(repo, addresses, parsed=parsed) for a, stage in group}

    def fingerprints(self, addresses: list[str]) -> dict[str, str]:
        """Each planned stage's fingerprint (see `_fingerprint`); `addresses` is the whole plan."""
        from dvc.exceptions import DvcException

        try:
            with locked_repo(self.root) as repo:
                return self._fingerprints(repo, addresses, addresses, {})
        except DvcException as e:
            raise DataError(f"{', '.join(addresses)}: DVC cannot read them: {e}") from None

    def record(self, addresses: list[str], expected: dict[str, str | None] | None = None,
               planned: list[str] = ()) -> list[str]:
        """The stages' deps, params and outs into dvc.lock and their outputs into the cache, as `dvc commit --force`
        does for each (its own steps: save, commit, then one write of the lock file per dvc.yaml).

        With `expected` (address -> the fingerprint its plan had; `planned`: the whole plan), only the stages whose
        fingerprint is still that: the others ran a command, params or inputs that are no longer the stage's, so
        recording them would mark outputs up to date that are not. Returns those refused."""
        from dvc.exceptions import DvcException

        try:
            with locked_repo(self.root) as repo:
                refused, parsed = [], {}
                if expected is not None:
                    now = self._fingerprints(repo, addresses, list(planned) or addresses, parsed)
                    refused = [a for a in addresses if expected.get(a) is None or expected[a] != now[a]]
                    addresses = [a for a in addresses if a not in refused]
                for group in self._stages(repo, addresses, parsed=parsed):
                    stages = [stage for _, stage in group]
                    for stage in stages:
                        stage.save()
                        stage.commit()
                    write_lock(stages)
                return refused
        except DvcException as e:  # an output the stage did not write, say
            raise DataError(f"{', '.join(addresses)}: dvc commit failed: {e}") from None
