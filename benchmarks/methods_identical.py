"""Trained weights of every method x weighting, hashed: a refactor of the unlearning code must leave them
byte-identical.

Each case trains a few steps with the project's real path (`UnlearnConfig.from_params`, `run_unlearn`: the forget
stream, the DeepSpeed engine, the retain term from a cache the run builds itself) on the tests' micro world and
untrained tiny Llama, and prints the sha256 of its state dict, tensor by tensor in name order, and the run's
fingerprint (its record's, what `--resume` compares). Run it against two checkouts, then compare the two files:

    python benchmarks/methods_identical.py --code /path/old --out /tmp/old.json
    python benchmarks/methods_identical.py --code /path/new --out /tmp/new.json
    python benchmarks/methods_identical.py --compare /tmp/old.json /tmp/new.json

`--set reduction=token` adds a key to every case (a case that refuses it is reported as refused).

The fixtures (world, tokenizer, model, attribution shards) are built once into `--work` and reused, so both runs
train from the same inputs. About 3 s a case on 2 cores.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

METHODS = ["ga", "wga", "npo", "rmu", "graddiff"]
WEIGHTINGS = ["uniform", "hard", "soft"]
# A few more: non-default knobs reach the loss, and RMU's layer reaches its retain term.
EXTRA = {"wga_hard_gamma2": {"method": "wga", "weighting": "hard", "gamma": 2.0},
         "npo_soft_beta05": {"method": "npo", "weighting": "soft", "beta": 0.5},
         "rmu_hard_activation": {"method": "rmu", "weighting": "hard", "retain_loss": "activation",
                                 "retain_weight": 10.0, "rmu_steer": 3.0},
         "ga_hard_mix": {"method": "ga", "weighting": "hard", "mix": 0.5}}
TRAIN = {"epochs": 2, "lr": 1e-3, "micro_batch_size": 2, "warmup_ratio": 0.0, "seed": 0}


def cases(extra_keys: dict) -> dict[str, dict]:
    grid = {f"{m}_{w}": {"method": m, "weighting": w} for m in METHODS for w in WEIGHTINGS}
    return {name: {"rmu_layer": 2, **spec, **extra_keys} for name, spec in {**grid, **EXTRA}.items()}


def fixtures(work: Path) -> tuple[Path, Path, Path]:
    """The micro world, the untrained tiny model and its attribution shards (tests/conftest.py's), built once."""
    from pipeline.attribution.run import AttributionConfig, run_attribution
    from pipeline.common.modeling import build_model, load_tokenizer, save_model, train_tokenizer
    from pipeline.data.config import DataConfig
    from pipeline.data.world import WorldConfig, WorldSpec, generate_world, world_texts, write_world
    from tests.conftest import ATTRIBUTION, MICRO_WORLD, REPO, TINY_MODEL

    world, model, shards = work / "world", work / "model", work / "attr" / "shards"
    if not (shards / "_manifest.json").is_file():
        write_world(generate_world(WorldSpec.load(REPO / "data" / "world"), WorldConfig(**MICRO_WORLD)), world)
        train_tokenizer(world_texts(world), 400, work / "tokenizer")
        tokenizer = load_tokenizer(work / "tokenizer")
        save_model(build_model(TINY_MODEL, tokenizer, seed=0), tokenizer, model)
        cfg = AttributionConfig(**{**ATTRIBUTION, "model": str(model)})
        run_attribution(cfg, DataConfig(source=str(world)), shards, work / "attr" / "metrics.json")
    return world, model, shards


def state_hash(model_dir: Path) -> str:
    import torch
    from safetensors.torch import load_file

    digest = hashlib.sha256()
    for name, tensor in sorted(load_file(str(model_dir / "model.safetensors")).items()):
        digest.update(name.encode())
        digest.update(tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def train_all(work: Path, only: list[str] | None, extra_keys: dict) -> dict[str, str]:
    from pipeline.common.errors import ParamError
    from pipeline.common.runs import SEED_RECORD
    from pipeline.data.config import DataConfig
    from pipeline.training.engine import TrainConfig
    from pipeline.training.unlearn import UnlearnConfig, run_unlearn

    world, model, shards = fixtures(work)
    runs = work / "runs"
    shutil.rmtree(runs, ignore_errors=True)  # nothing resumed from an earlier call
    hashes = {}
    for name, spec in cases(extra_keys).items():
        if only and name not in only:
            continue
        try:
            cfg = UnlearnConfig.from_params(spec, f"case.{name}")
        except ParamError as e:  # a --set the case refuses (reduction=token on NPO's sequence-level loss)
            hashes[name] = f"refused: {e}"
            print(f"{name:22s} {hashes[name]}", flush=True)
            continue
        out = runs / name
        run_unlearn(name, cfg, TrainConfig.from_params(TRAIN, "train"), DataConfig(source=str(world)), str(model),
                    shards, out, runs / f"ckpt-{name}", runs / f"{name}.csv", resume=False)
        # the weights, and the run's fingerprint (what --resume compares: it must not move either)
        record = json.loads((out / SEED_RECORD).read_text())["fingerprint"]
        hashes[name] = f"{state_hash(out / 'model')} fingerprint {record}"
        print(f"{name:22s} {hashes[name][:16]} fingerprint {record}", flush=True)
    return hashes


def compare(a: Path, b: Path) -> int:
    old, new = json.loads(a.read_text()), json.loads(b.read_text())
    print(f"{'case':22s} {'weights ' + a.name:33s} {'weights ' + b.name:33s} same (weights and fingerprint)")
    differ = 0
    for name in sorted(set(old) | set(new)):
        same = old.get(name) == new.get(name)
        differ += not same
        print(f"{name:22s} {str(old.get(name))[:33]:33s} {str(new.get(name))[:33]:33s} {'yes' if same else 'NO'}")
    print("all identical" if not differ else f"{differ} case(s) differ")
    return 1 if differ else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--code", type=Path, help="the checkout whose pipeline/ is imported (default: this one)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/methods_identical"), help="fixtures and runs")
    parser.add_argument("--out", type=Path, help="write {case: 'SHA256 fingerprint FP'} here")
    parser.add_argument("--only", nargs="*", help="case names (default: all)")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=YAML",
                        help="a key added to every case, e.g. reduction=token")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("A", "B"))
    args = parser.parse_args()
    if args.compare:
        return compare(*args.compare)
    code = (args.code or Path(__file__).resolve().parents[1]).resolve()
    sys.path.insert(0, str(code))
    import yaml

    import pipeline

    print(f"code: {Path(pipeline.__file__).parent}", flush=True)
    extra_keys = {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in args.set)}
    args.work.mkdir(parents=True, exist_ok=True)
    hashes = train_all(args.work, args.only, extra_keys)
    if args.out:
        args.out.write_text(json.dumps(hashes, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    from pipeline.common.cli_errors import run_script  # as the CLI: one line per error, an exit status
    run_script(main)
