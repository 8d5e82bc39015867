"""Checkpoints of a training run: its fingerprint (params and data), whether a checkpoint on disk is this run's to
resume, DeepSpeed's checkpoint files loaded as weights only (a planted pickle is refused, never run), and their
removal once the run's outputs are written."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

import torch

from pipeline.common.distributed import is_main_process
from pipeline.common.errors import TokenUnlearnError

log = logging.getLogger(__name__)


class CheckpointRefused(TokenUnlearnError):
    """A checkpoint file holds something other than weights and plain training state."""


class CheckpointUnreadable(TokenUnlearnError):
    """No checkpoint of a run's directory can be read (their files cut short)."""


def _checkpoint_globals() -> list:
    """The only classes a DeepSpeed checkpoint may hold besides tensors and containers (found by saving ZeRO 0-3
    checkpoints in fp32 and bf16): plain records that run no code when loaded."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


class WeightsOnlyLoading:
    """DeepSpeed's checkpoint engine, except that it loads with `torch.load(weights_only=True)` and an allow-list
    of DeepSpeed's record classes, never with the full unpickler (DeepSpeed's own default): a pickle planted in a
    checkpoint file cannot run code on resume, it is refused."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def load(self, path: str, map_location=None):
        import pickle

        try:
            with torch.serialization.safe_globals(_checkpoint_globals()):
                return torch.load(path, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as e:
            reason = str(e).strip().splitlines()
            culprit = next((line.strip() for line in reason if "GLOBAL" in line or "Unsupported" in line), reason[0])
            raise CheckpointRefused(
                f"{path}: refused to load: it holds objects other than weights ({culprit[:200]}); it was not "
                "written by this pipeline or was tampered with. Delete the checkpoint directory to start over"
            ) from None


def fingerprint(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def matching_checkpoint(ckpt_dir: Path, run_fingerprint: str) -> bool:
    if not (ckpt_dir / "latest").is_file():
        log.info("no checkpoint in %s: starting from step 0", ckpt_dir)
        return False
    meta = ckpt_dir / "run.json"
    try:  # a record cut short by a kill, or edited, is no proof the checkpoint is this run's
        recorded = json.loads(meta.read_text()).get("fingerprint")
    except (OSError, ValueError, AttributeError):
        recorded = None
    if recorded != run_fingerprint:
        log.warning("the checkpoint in %s belongs to another run (other params or data): starting from step 0",
                    ckpt_dir)
        return False
    return True


def checkpoint_tags(ckpt_dir: Path) -> list[str]:
    """The checkpoints to try on resume: the latest, then the earlier ones, newest first (a kill mid-save can leave
    the latest cut short; the ones before it are whole)."""
    def step(tag: str) -> int:
        return int(tag[4:]) if tag.startswith("step") and tag[4:].isdigit() else -1

    latest = (ckpt_dir / "latest").read_text().strip()
    return [latest] + sorted((p.name for p in ckpt_dir.glob("step*") if p.is_dir() and step(p.name) < step(latest)),
                             key=step, reverse=True)


def clear_checkpoints(ckpt_dir: Path) -> None:
    if is_main_process():
        shutil.rmtree(ckpt_dir, ignore_errors=True)
