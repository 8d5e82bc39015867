"""CPU reproducibility: the settings this project pins so that a CPU run gives the same bytes on another machine.

What changes a CPU training's bytes between machines (benchmarks/bench_reproducibility.py measures each):
- the number of intra-op threads: a reduction split over more threads adds in another order;
- the vector kernels torch dispatches to (ATEN_CPU_CAPABILITY: AVX2 here, AVX-512 on many servers), and MKL's and
  oneDNN's own code paths (MKL_CBWR, ONEDNN_MAX_CPU_ISA), which block their sums differently per instruction set.
Each stage therefore runs, on an x86 CPU, with torch's and MKL's and oneDNN's AVX2 paths (a machine with AVX-512
steps down to them; one without AVX2 keeps its own and differs) and one intra-op thread (the embedded model's
fastest too), unless the environment sets them: an explicit OMP_NUM_THREADS or ATEN_CPU_CAPABILITY wins, and
TOKENUNLEARN_CPU_PINS=0 turns every pin off. TOKENUNLEARN_DETERMINISTIC=1 also asks torch for deterministic
algorithms (an error where an op has none). GPUs are not pinned: their kernels differ by device and library.
"""

from __future__ import annotations

import logging
import os
import platform

# Set before torch is imported (torch, MKL and oneDNN read them once, at load).
KERNEL_PINS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
THREADS = 1
log = logging.getLogger(__name__)


def pins_on(env=os.environ) -> bool:
    return env.get("TOKENUNLEARN_CPU_PINS", "1") != "0"


def pin_environment(env=os.environ) -> dict:
    """The kernel pins the environment does not set already (x86 only), set in `env`; returns what was set. Call
    before torch is imported."""
    if not pins_on(env) or platform.machine().lower() not in ("x86_64", "amd64"):
        return {}
    added = {k: v for k, v in KERNEL_PINS.items() if k not in env}
    env.update(added)
    return added


def pin_threads(env=os.environ) -> None:
    """One intra-op thread on CPU unless OMP_NUM_THREADS says otherwise; deterministic algorithms if asked."""
    import torch

    if pins_on(env) and "OMP_NUM_THREADS" not in env and not torch.cuda.is_available():
        torch.set_num_threads(THREADS)
    if env.get("TOKENUNLEARN_DETERMINISTIC", "0") == "1":
        torch.use_deterministic_algorithms(True)
    log.debug("CPU settings: %s", describe())


def describe() -> dict:
    """What a run used, for its logs: threads, the kernels torch dispatched to, and the pins' variables."""
    import torch

    return {"threads": torch.get_num_threads(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            **{k: os.environ.get(k) for k in KERNEL_PINS}, "deterministic": torch.are_deterministic_algorithms_enabled()}
