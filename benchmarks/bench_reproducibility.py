"""What makes CPU training give other bytes on another machine: the same short training under each setting.

Each case trains the embedded base model (the `pretrain` stage's command, a few epochs) in a fresh process with
one setting changed: the number of threads, the CPU kernels torch dispatches to (ATEN_CPU_CAPABILITY: the vector
width another CPU would have), MKL's code path (MKL_CBWR), oneDNN's (ONEDNN_MAX_CPU_ISA), torch's deterministic
algorithms. It prints the model's SHA-256 per case and whether it equals the reference case's: a machine that
differs from this one only in that setting gives those bytes. `TOKENUNLEARN_CPU_PINS=0` turns the project's own
pins off (pipeline/common/reproducible.py), so that what they pin shows.

    python benchmarks/bench_reproducibility.py                 # after `make demo` (its world and tokenizer)
    python benchmarks/bench_reproducibility.py --epochs 1 --cases threads2 kernels_default
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# name -> environment changes; every case starts from the reference: pins off, one thread
UNPINNED = {"TOKENUNLEARN_CPU_PINS": "0", "OMP_NUM_THREADS": "1"}
CASES = {
    "reference": {},
    "rerun": {},
    "threads2": {"OMP_NUM_THREADS": "2"},
    "threads8": {"OMP_NUM_THREADS": "8"},  # more threads than cores: the reductions split as on an 8-core machine
    "kernels_default": {"ATEN_CPU_CAPABILITY": "default"},
    "kernels_avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
    "mkl_compatible": {"MKL_CBWR": "COMPATIBLE"},
    "mkl_avx2": {"MKL_CBWR": "AVX2"},
    "onednn_avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2"},
    "deterministic": {"TOKENUNLEARN_DETERMINISTIC": "1"},
    "pinned": {"TOKENUNLEARN_CPU_PINS": "1", "OMP_NUM_THREADS": None},
    "pinned_threads2": {"TOKENUNLEARN_CPU_PINS": "1", "OMP_NUM_THREADS": "2"},
    "pinned_kernels_default": {"TOKENUNLEARN_CPU_PINS": "1", "OMP_NUM_THREADS": None,
                               "ATEN_CPU_CAPABILITY": "default"},
}


def train(case: str, epochs: float, out: Path) -> tuple[str, float]:
    env = {**os.environ, **UNPINNED}
    for key, value in CASES[case].items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    if "TOKENUNLEARN_CPU_PINS" in CASES[case]:
        for key in ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA"):
            if key not in CASES[case]:
                env.pop(key, None)  # the pins' own values, unless the case overrides one
    model = out / case
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "stages", "finetune", "base", "-S", f"finetune.models.base.train.epochs={epochs}",
                    "--out", str(model), "--checkpoints", str(out / f"{case}-ckpt"), "--plot", str(out / f"{case}.csv"),
                    "--no-resume"], cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seconds = time.perf_counter() - start
    return hashlib.sha256((model / "model.safetensors").read_bytes()).hexdigest(), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=float, default=3)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    args = parser.parse_args()
    import torch

    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{os.cpu_count()} CPUs; {args.epochs} epochs of the base model per case")
    cases = ["reference"] + [c for c in args.cases if c != "reference"]
    with tempfile.TemporaryDirectory() as tmp:
        results = {c: train(c, args.epochs, Path(tmp)) for c in cases}
    ref = results["reference"][0]
    print(f"{'case':<24} {'sha256':<18} {'same bytes as reference':<25} seconds")
    for case in cases:
        digest, seconds = results[case]
        print(f"{case:<24} {digest[:16]:<18} {str(digest == ref):<25} {seconds:.1f}")


if __name__ == "__main__":
    from pipeline.common.cli_errors import run_script  # as the CLI: one line per error, an exit status
    run_script(main)
