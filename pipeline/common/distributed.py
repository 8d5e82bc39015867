"""The process group and DeepSpeed's environment, shared by every stage that may run on several processes.

One plain `python` process works (the environment of a one-process group is filled in); so do `torchrun` and
`deepspeed` launches (gloo on CPU, NCCL on GPU).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
from pathlib import Path

import torch

from pipeline.common.errors import TokenUnlearnError
from pipeline.common.locks import LockWait, break_stale_lock
from pipeline.common.paths import cache_dir

log = logging.getLogger(__name__)


def _prepare_environment() -> None:
    # DeepSpeed JIT-compiles a CPU communication op on first use (~30 s): keep it in one cache so it is built once.
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(cache_dir() / "torch_extensions"))
    _break_stale_build_locks()
    # It builds with the `ninja` first on PATH; the environment's and the system's record commands differently, so
    # runs alternating between them (a test process and the CLI it launches) rebuild every op: the environment's.
    own = Path(sys.executable).parent
    if (own / "ninja").is_file() and os.environ.get("PATH", "").split(os.pathsep)[0] != str(own):
        os.environ["PATH"] = f"{own}{os.pathsep}{os.environ.get('PATH', '')}"
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(key, value)  # a plain one-process run; launchers set these themselves
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])


class _OwnedBaton:
    """torch's JIT-build lock (`FileBaton`: a `lock` file that every other build waits on while it exists), with its
    owner's host and pid written in it: a lock whose owner was killed is broken at once, with one line, instead of
    making every later stage wait forever. torch's own baton writes nothing; an empty lock is broken once older than
    `EMPTY_LOCK_SECONDS`. A wait says at once, and every `locks.WAIT_REPORT_SECONDS`, which lock it waits on, who
    holds it and how to clear it."""

    # This baton writes its owner in the moment it creates the lock, so an empty one is torch's own baton's (a
    # process outside the pipeline) or one killed in between; DeepSpeed's CPU ops build in about 30 s, so a minute
    # covers a live unpatched build without keeping a dead one's waiters for the 10 minutes a stage used to wait.
    EMPTY_LOCK_SECONDS = 60

    def __init__(self, lock_file_path, wait_seconds=0.1, warn_after_seconds=None) -> None:
        self.lock_file_path, self.wait_seconds, self.fd = lock_file_path, wait_seconds, None

    def try_acquire(self) -> bool:
        for _ in range(2):  # a second try after breaking a stale lock
            try:
                self.fd = os.open(self.lock_file_path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                if not self._break_if_stale():
                    return False
                continue
            os.write(self.fd, f"{socket.gethostname()} {os.getpid()}".encode())
            return True
        return False

    def wait(self) -> None:
        path = Path(self.lock_file_path)
        waiting = LockWait(path, f"DeepSpeed's build of its op '{path.parent.name}'",
                           f"if no build of it is running, delete {path} (a lock whose owner is not running is "
                           f"removed at once, an empty one once {self.EMPTY_LOCK_SECONDS} s old)")
        while path.exists():
            owner = self._break_if_stale()
            if owner:
                raise TokenUnlearnError(f"{path}: the process building this DeepSpeed op ({owner}) died before it "
                                        "finished; its lock is removed: run the command again to build it")
            waiting.report()
            time.sleep(self.wait_seconds)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
        os.remove(self.lock_file_path)

    def _break_if_stale(self) -> str | None:
        owner = break_stale_lock(Path(self.lock_file_path), self.EMPTY_LOCK_SECONDS)
        if owner is not None:
            log.warning("removed the build lock %s of a killed run (%s)", self.lock_file_path, owner)
        return owner


def _break_stale_build_locks() -> None:
    """Every JIT build in this process takes torch's build lock through `_OwnedBaton`."""
    import torch.utils.cpp_extension as cpp_extension

    cpp_extension.FileBaton = _OwnedBaton


def deepspeed_module():
    """`deepspeed`, imported with the environment it needs and its logger quietened."""
    _prepare_environment()
    import deepspeed
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(logging.WARNING)
    return deepspeed


def init_distributed() -> tuple[int, int]:
    """Join (or start) the process group, gloo on CPU and NCCL on GPU; return (rank, world size). Idempotent."""
    deepspeed = deepspeed_module()
    import torch.distributed as dist

    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "gloo" and os.environ.get("WORLD_SIZE") == "1":
            _skip_shared_memory_op(deepspeed)
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    return dist.get_rank(), dist.get_world_size()


def _skip_shared_memory_op(deepspeed) -> None:
    """One CPU process exchanges nothing, yet DeepSpeed JIT-builds (about 30 s, then loads in about 6 s) and prints
    its shared-memory collective op at every start: mark the op unavailable, so the process group is plain gloo."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def shutdown_distributed() -> None:
    """Tear the process group down; with ZeRO-3 on several processes a process can abort at exit otherwise.

    Called once, when a command ends: DeepSpeed caches its groups, so a process does not start a second one."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def is_main_process() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def broadcast_from_main(value):
    """The main process's `value` on every process (as is in a one-process run): a path it chose, or an error."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
