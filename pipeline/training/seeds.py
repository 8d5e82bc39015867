"""A run's seeds: what each seed's model depends on (`seed_fingerprint`), which seeds an earlier call left that
stay beside the new ones (`earlier_seeds`), and the removal of the others (`remove_other_seeds`). The loop over the
seeds is `pipeline.training.unlearn.run_unlearn_seeds`.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from dataclasses import asdict, replace
from pathlib import Path

from pipeline.attribution.shards import read_manifest
from pipeline.common.errors import ParamError
from pipeline.common.runs import COMPLETE_RECORD, SEED_RECORD, seed_dir
from pipeline.training.checkpoints import fingerprint
from pipeline.training.engine import TrainConfig
from pipeline.training.run_config import UnlearnConfig, params_used

log = logging.getLogger(__name__)


def seed_fingerprint(name: str, cfg: UnlearnConfig, train: TrainConfig, model_path: str, manifest: dict,
                     reference_dir: Path | None = None, selection: dict | None = None) -> str:
    """What one seed's model depends on: the params it uses, the model, the forget shards and the reference cache it
    reads, and a monitor's selection rule (not the number of processes, which gives the same weights)."""
    cache = None
    if cfg.retain is not None and cfg.retain.needs_reference and cfg.retain_reference == "cache":
        cache = read_manifest(reference_dir)["shards"] if reference_dir is not None else cfg.reference_top_k
    return fingerprint({"name": name, "params": params_used(cfg), "train": asdict(train), "model": model_path,
                        "shards": manifest["shards"], "source": manifest["metadata"].get("model_hash"),
                        **({"reference": cache} if cache is not None else {}),
                        **({"selection": selection} if selection else {})})


def check_seeds(seeds) -> list[int]:
    """`unlearn.seeds` (or --seed): a non-empty list of distinct integers."""
    ok = isinstance(seeds, (list, tuple)) and seeds and len(set(seeds)) == len(seeds) and \
        all(isinstance(s, int) and not isinstance(s, bool) for s in seeds)
    if not ok:
        raise ParamError(f"unlearn.seeds={seeds!r}: expected a non-empty list of distinct integers, e.g. [0, 1, 2]")
    return list(seeds)


def remove_other_seeds(kept: dict[str, str], dirs: list[Path]) -> None:
    """Remove the seed directories (`seed{S}/`) and curves (`seed{S}.csv`, `seed{S}.timing.csv`) of seeds not in
    `kept` from `dirs`."""
    for directory in dirs:
        for path in directory.glob("seed*") if directory.is_dir() else ():
            seed = re.fullmatch(r"seed(\d+)(\..*)?", path.name)
            if seed and seed.group(1) not in kept:
                log.info("removing %s: seed %s is not one of this run's", path, seed.group(1))
                shutil.rmtree(path) if path.is_dir() else path.unlink()


def recorded_fingerprint(record: Path) -> str | None:
    """The fingerprint a seed's record holds; None where the record is missing, cut short or edited (not this run's)."""
    try:
        return json.loads(record.read_text()).get("fingerprint")
    except (OSError, ValueError, AttributeError):
        return None


def earlier_seeds(name, cfg, train, model_path, manifest, reference_dir, monitor, out_dir: Path,
                  seeds: list[int]) -> dict[str, str]:
    """The seeds an earlier call wrote into `out_dir` (`--seed 0`, then `--seed 1`) that are still there and were
    made with these same params: they stay in complete.json beside the new ones. Seeds of other params are left
    out, with a warning, so evaluation never mixes two configurations."""
    record = out_dir / COMPLETE_RECORD
    try:
        listed = json.loads(record.read_text()).get("fingerprints", {}) if record.is_file() else {}
    except (ValueError, AttributeError):
        listed = {}
    kept, dropped = {}, []
    selection = monitor.selection if monitor is not None else None
    for key, recorded in (listed.items() if isinstance(listed, dict) else ()):
        if not str(key).isdigit() or int(key) in seeds:
            continue
        seed = int(key)
        now = seed_fingerprint(name, cfg, replace(train, seed=seed), model_path, manifest, reference_dir, selection)
        if recorded == now == recorded_fingerprint(seed_dir(out_dir, seed) / SEED_RECORD):
            kept[str(seed)] = recorded
        else:
            dropped.append(seed)
    if dropped:
        log.warning("unlearn %s: seeds %s in %s were made with other params (or are gone): left out of %s",
                    name, dropped, out_dir, COMPLETE_RECORD)
    return kept
