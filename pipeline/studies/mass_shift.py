"""Where unlearning moves probability mass on the forget answers: per answer token, log p under the target model
and under an unlearned model, with the weight ω the run trained that token with, and a summary per token class.

Why: token-level runs (hard or soft ω) forget less than uniform ω at the same utility. These records say whether
the push lands on the selected tokens only or spills to the rest of the answer, and whether it lands on the fact
tokens (the embedded world's ground truth) or on the easy ones (the first token of the answer, the subject).

- `load_forget_samples`: the attribution shards' rows (token ids, scored mask, fact flags): the forget split,
  tokenized exactly as stage two trained on it.
- `load_run_weights`: the ω a run wrote beside its model (`seed*/token_weights.parquet`), checked against the shards.
- `answer_logp`: teacher-forced log p of every token and whether it is the model's greedy choice.
- `token_records`: one record per scored answer token (a pure function of the above).
- `summarize`: group means, drop shares, flip rates and the spill (pure; tested on hand-made records).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from pipeline.attribution.weights import WEIGHTING
from pipeline.common.errors import DataError

MANIFEST = "_manifest.json"  # an attribution directory's index of its shards (pipeline/attribution/shards.py)
SHARD_COLUMNS = ("sample_id", "input_ids", "scored")
POSITIONS = ("answer_first", "fact_first", "other")  # the position bucket of a token, the first that applies


@dataclass
class ForgetSample:
    sample_id: int
    input_ids: np.ndarray     # int64, prompt and answer, as the shards hold them
    scored: np.ndarray        # bool: the answer tokens (and EOS) stage two weights
    fact: np.ndarray | None   # bool ground truth per token (the embedded world), None where the data has none


# ---- loading ----------------------------------------------------------------------------------------------------

def shard_manifest(shard_dir: str | Path) -> tuple[dict, list[Path]]:
    """An attribution directory's manifest and its shard files. Read here, not with pipeline.attribution (evaluation
    reads stage one's output from disk, never its code): the same file, the same confinement of names."""
    path = Path(shard_dir) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
        names = [shard["name"] for shard in manifest["shards"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{path}: not an attribution manifest ({e.__class__.__name__}: {e}); pass `attribute`'s "
                        "output, e.g. artifacts/attribution") from None
    files = []
    for name in names:
        file = Path(shard_dir) / str(name)
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", "..") or not file.is_file():
            raise DataError(f"{path}: shard {name!r} is not a file beside the manifest")
        files.append(file)
    return manifest, files


def load_forget_samples(shard_dir: str | Path) -> list[ForgetSample]:
    """The forget samples of an attribution directory, in shard order, each row's lists checked against its
    length (a wrong one names the file and sample)."""
    samples = []
    for file in shard_manifest(shard_dir)[1]:
        try:
            names = pq.ParquetFile(file).schema_arrow.names
            missing = [c for c in SHARD_COLUMNS if c not in names]
            if missing:
                raise DataError(f"{file}: no column {', '.join(missing)}; rerun `attribute`")
            table = pq.read_table(file, columns=list(SHARD_COLUMNS) + (["fact"] if "fact" in names else []))
        except (OSError, pa.ArrowException) as e:
            raise DataError(f"{file}: not a readable Parquet shard ({str(e).splitlines()[0]})") from None
        for row in table.to_pylist():
            ids, scored, fact = row["input_ids"] or [], row["scored"] or [], row.get("fact")
            if len(scored) != len(ids) or (fact is not None and len(fact) != len(ids)):
                raise DataError(f"{file}: sample {row['sample_id']}: scored/fact lists differ in length from its "
                                f"{len(ids)} tokens; rerun `attribute`")
            if not any(scored):
                raise DataError(f"{file}: sample {row['sample_id']} has no scored token")
            samples.append(ForgetSample(row["sample_id"], np.asarray(ids, dtype=np.int64), np.asarray(scored, bool),
                                        None if fact is None else np.asarray([bool(f) for f in fact])))
    if not samples:
        raise DataError(f"{shard_dir}: the attribution shards hold no sample")
    return samples


def load_run_weights(path: str | Path, samples: list[ForgetSample]) -> tuple[str, dict[int, np.ndarray]]:
    """(weighting, ω per sample id, full length) from a run's token_weights.parquet; every forget sample must be
    there with the same token ids, or the run was trained on other shards."""
    path = Path(path)
    try:
        file = pq.ParquetFile(path)
        used = json.loads((file.schema_arrow.metadata or {}).get(b"tokenunlearn", b"{}"))
        rows = file.read(columns=["sample_id", "input_ids", "weight"]).to_pylist()
    except (OSError, ValueError, KeyError, pa.ArrowException) as e:
        raise DataError(f"{path}: not a token_weights.parquet written by `unlearn` ({str(e).splitlines()[0]})") \
            from None
    weighting = used.get("weighting")
    if weighting not in WEIGHTING:
        raise DataError(f"{path}: its metadata names weighting {weighting!r}, not one of {sorted(WEIGHTING)}")
    weights = {row["sample_id"]: row for row in rows}
    out = {}
    for s in samples:
        row = weights.get(s.sample_id)
        if row is None or list(row["input_ids"]) != s.input_ids.tolist():
            what = "is missing" if row is None else "has other token ids"
            raise DataError(f"{path}: sample {s.sample_id} {what} than in the attribution shards: the run was "
                            "trained on other shards (pass the --shards it used)")
        out[s.sample_id] = np.asarray(row["weight"], dtype=np.float64)
    return weighting, out


def run_seeds(run_dir: str | Path) -> list[tuple[int, Path]]:
    """(seed, directory) of every finished seed of an unlearn output: `seed{S}/` holding model/ and
    token_weights.parquet, by seed."""
    found = []
    for d in Path(run_dir).glob("seed*"):
        if d.name[4:].isdigit() and (d / "model").is_dir() and (d / "token_weights.parquet").is_file():
            found.append((int(d.name[4:]), d))
    if not found:
        raise DataError(f"{run_dir}: no seed*/ directory with model/ and token_weights.parquet (an `unlearn` "
                        "output, e.g. artifacts/unlearn/npo)")
    return sorted(found)


def check_target(model, model_path: str | Path, shard_dir: str | Path) -> None:
    """The target must be the model stage one scored: its log p is the baseline every Δ is taken against."""
    from pipeline.common.modeling import model_hash

    recorded = (shard_manifest(shard_dir)[0].get("metadata") or {}).get("model_hash")
    ours = model_hash(model, str(model_path))
    if recorded is not None and recorded != ours:
        raise DataError(f"{shard_dir}: the shards were made by a model with model_hash={recorded}, but "
                        f"{model_path} has {ours}: pass the target model that `attribute` scored")


# ---- the models' view of the answers ------------------------------------------------------------------------------

@torch.no_grad()
def answer_logp(model, samples: list[ForgetSample], batch_size: int = 8) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per sample: (log p(token_i | tokens_<i), whether token_i is the model's argmax there), full length, teacher
    forced on the shards' own token ids (position 0 has no prefix: NaN, False)."""
    model.eval()
    device = next(model.parameters()).device
    out = []
    for start in range(0, len(samples), batch_size):
        batch = samples[start:start + batch_size]
        width = max(len(s.input_ids) for s in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        attention = torch.zeros_like(ids)
        for b, s in enumerate(batch):
            ids[b, :len(s.input_ids)] = torch.from_numpy(s.input_ids)
            attention[b, :len(s.input_ids)] = 1  # right padding: causal attention never sees it
        logits = model(input_ids=ids.to(device), attention_mask=attention.to(device)).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None].to(device))[..., 0].cpu().numpy()
        top = (logits.argmax(-1).cpu() == ids[:, 1:]).numpy()
        for b, s in enumerate(batch):
            n = len(s.input_ids)
            out.append((np.concatenate([[np.nan], logp[b, :n - 1]]), np.concatenate([[False], top[b, :n - 1]])))
    return out


# ---- records ------------------------------------------------------------------------------------------------------

def selected_tokens(weighting: str, weights: np.ndarray) -> np.ndarray:
    """The tokens a run pushes on: hard ω > 0; soft and proportional ω above the sample's mean ω (they give every
    token some weight); uniform every token."""
    if weighting in ("soft", "proportional"):
        return weights > weights.mean()
    return weights > 0


def token_records(sample: ForgetSample, weighting: str, weights: np.ndarray, target: tuple[np.ndarray, np.ndarray],
                  unlearned: tuple[np.ndarray, np.ndarray]) -> list[dict]:
    """One record per scored token of `sample`. `weights`: ω full length; `target`, `unlearned`: `answer_logp`'s
    (log p, is argmax) of the two models. first_of_fact: the token starts a contiguous run of fact tokens."""
    where = np.flatnonzero(sample.scored)
    w = weights[where]
    selected = selected_tokens(weighting, w)
    records = []
    for k, pos in enumerate(where):
        fact = None if sample.fact is None else bool(sample.fact[pos])
        first_of_fact = None if sample.fact is None else bool(fact and (pos == 0 or not sample.fact[pos - 1]))
        records.append({
            "sample_id": int(sample.sample_id), "index": k, "rel_position": k / len(where),
            "fact": fact, "first_of_fact": first_of_fact,
            "position": "answer_first" if k == 0 else "fact_first" if first_of_fact else "other",
            "weight": float(w[k]), "selected": bool(selected[k]),
            "logp_target": float(target[0][pos]), "logp_unlearned": float(unlearned[0][pos]),
            "delta": float(unlearned[0][pos] - target[0][pos]),
            "argmax_target": bool(target[1][pos]), "argmax_unlearned": bool(unlearned[1][pos]),
        })
    return records


# ---- summary (pure) -------------------------------------------------------------------------------------------------

def _mean(values) -> float | None:
    values = list(values)
    return float(np.mean(values)) if values else None


def _flip_rate(records: list[dict]) -> float | None:
    """Of the tokens the target ranked first, the fraction the unlearned model no longer ranks first."""
    top = [r for r in records if r["argmax_target"]]
    return _mean(not r["argmax_unlearned"] for r in top)


def _pooled_share(records: list[dict], keep) -> float | None:
    """The share of the records' whole log-p drop (Σ of the negative Δ) on the records `keep` selects."""
    drop = sum(min(r["delta"], 0.0) for r in records)
    return sum(min(r["delta"], 0.0) for r in records if keep(r)) / drop if drop else None


def _sample_key(r: dict) -> tuple:
    return r.get("seed"), r["sample_id"]  # seeds pooled: a sample of each seed is its own sample


def group_of(r: dict) -> tuple:
    return ({True: "fact", False: "not_fact", None: "unknown"}[r["fact"]],
            "selected" if r["selected"] else "unselected", r["position"])


def summarize(records: list[dict]) -> dict:
    """Over the records of one run (one or several seeds):

    - groups: per (fact, selected, position) the token count, mean Δlogp, flip rate, and the group's mean share of
      its sample's logp drop (Σ of the negative Δ) against its mean share of the sample's tokens, both averaged
      over the samples whose drop is not 0 (so each sample counts once, whatever its length);
    - overall: mean Δ on fact and non-fact tokens, on selected and unselected tokens, and the spill, mean Δ
      unselected / mean Δ selected (None when a side is empty, e.g. uniform runs select every token)."""
    by_sample: dict[tuple, list[dict]] = {}
    for r in records:
        by_sample.setdefault(_sample_key(r), []).append(r)
    groups = sorted({group_of(r) for r in records})
    drop_share = {g: [] for g in groups}
    token_share = {g: [] for g in groups}
    for rows in by_sample.values():
        drop = sum(min(r["delta"], 0.0) for r in rows)
        if drop == 0:
            continue
        for g in groups:
            mine = [r for r in rows if group_of(r) == g]
            drop_share[g].append(sum(min(r["delta"], 0.0) for r in mine) / drop)
            token_share[g].append(len(mine) / len(rows))
    group_rows = []
    for g in groups:
        mine = [r for r in records if group_of(r) == g]
        group_rows.append({"fact": g[0], "selected": g[1], "position": g[2], "tokens": len(mine),
                           "mean_delta": _mean(r["delta"] for r in mine),
                           "drop_share": _mean(drop_share[g]), "token_share": _mean(token_share[g]),
                           "flip_rate": _flip_rate(mine)})

    def mean_delta(keep) -> float | None:
        return _mean(r["delta"] for r in records if keep(r))

    selected, unselected = mean_delta(lambda r: r["selected"]), mean_delta(lambda r: not r["selected"])
    spill = unselected / selected if selected not in (None, 0.0) and unselected is not None else None
    overall = {"tokens": len(records), "samples": len(by_sample), "mean_delta": mean_delta(lambda r: True),
               "mean_delta_fact": mean_delta(lambda r: r["fact"] is True),
               "mean_delta_not_fact": mean_delta(lambda r: r["fact"] is False),
               "mean_delta_selected": selected, "mean_delta_unselected": unselected, "spill": spill,
               "selected_share": _mean(r["selected"] for r in records), "flip_rate": _flip_rate(records),
               # does the push find the facts: the fact tokens selected, the selected tokens that are facts, the
               # share of all the drop (pooled) on fact tokens, and the flips where extraction derails or not
               "fact_selected": _mean(r["selected"] for r in records if r["fact"] is True),
               "selected_fact": _mean(r["fact"] is True for r in records if r["selected"]),
               "drop_on_facts": _pooled_share(records, lambda r: r["fact"] is True),
               "flip_rate_fact_first": _flip_rate([r for r in records if r["position"] == "fact_first"]),
               "flip_rate_answer_first": _flip_rate([r for r in records if r["position"] == "answer_first"])}
    return {"overall": overall, "groups": group_rows}


def _cell(value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def summary_markdown(summaries: dict[str, dict]) -> str:
    """Two tables: one line per run (fact vs not, selected vs not, spill), then one per run and token group."""
    keys = ("weighting", "tokens", "selected_share", "fact_selected", "selected_fact", "drop_on_facts", "mean_delta",
            "mean_delta_fact", "mean_delta_not_fact", "mean_delta_selected", "mean_delta_unselected", "spill",
            "flip_rate", "flip_rate_fact_first", "flip_rate_answer_first")
    lines = ["| run | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for run, s in summaries.items():
        lines.append(f"| {run} | " + " | ".join(_cell(s["overall"].get(k, s.get(k))) for k in keys) + " |")
    group_keys = ("fact", "selected", "position", "tokens", "token_share", "drop_share", "mean_delta", "flip_rate")
    lines += ["", "| run | " + " | ".join(group_keys) + " |", "|---" * (len(group_keys) + 1) + "|"]
    for run, s in summaries.items():
        for g in s["groups"]:
            lines.append(f"| {run} | " + " | ".join(_cell(g[k]) for k in group_keys) + " |")
    return "\n".join(lines) + "\n"
