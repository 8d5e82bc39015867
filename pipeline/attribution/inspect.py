"""Views of attribution shards: a per-token table for the terminal, an HTML heatmap of many samples, and every
scored token as a pandas DataFrame with its text (`token_scores`)."""

from __future__ import annotations

import html
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.attribution.shards import check_shards, column_types, read_manifest
from pipeline.attribution.variants import draw, require_columns, score_columns, variant_score
from pipeline.attribution.weights import hard_weights, soft_weights
from pipeline.common.errors import DataError
from pipeline.common.modeling import load_tokenizer, tokenizer_hash
from pipeline.common.params import section

log = logging.getLogger(__name__)

ATTRIBUTION_COLUMNS = ("sample_id", "input_ids", "scored", "delta", "entropy")  # what every view reads
# What the views read besides (the token's text and the masked prefix); the per-token lists of each row.
VIEW_COLUMNS = (*ATTRIBUTION_COLUMNS, "split", "text", "token_start", "token_end", "masked", "fact")
TOKEN_LISTS = ("scored", "delta", "entropy", "token_start", "token_end", "masked", "fact")
HARD, SOFT = "unlearn.weightings.hard", "unlearn.weightings.soft"  # where stage two's r, τ and α are set


def attribution_manifest(shard_dir, verify: bool = False) -> dict:
    """The manifest of an attribution directory, every shard's columns and row count checked before a view reads
    them (`check_shards`); one clear error for any other directory of shards (the reference cache, say), naming
    it."""
    manifest = read_manifest(shard_dir, verify=verify)
    kind = manifest.get("metadata", {}).get("kind")  # another stage's shards (attribution's have no kind)
    if manifest["shards"] and kind is not None:
        try:
            columns = pq.read_schema(Path(shard_dir) / manifest["shards"][0]["name"]).names
        except (pa.ArrowException, OSError):  # unreadable: check_shards says so, naming the file
            columns = ATTRIBUTION_COLUMNS
        missing = [c for c in ATTRIBUTION_COLUMNS if c not in columns]
        if missing:
            raise DataError(f"{shard_dir}: not attribution shards (a {kind} directory: no {', '.join(missing)} "
                            "columns); point it at `tokenunlearn attribute`'s output, e.g. artifacts/attribution")
    check_shards(shard_dir, manifest, column_types(VIEW_COLUMNS), "; rerun `attribute`")
    return manifest


def check_row(row: dict, file: Path) -> None:
    """A row's per-token lists are as long as its tokens: a view indexes one by another's positions, so an edited
    shard would otherwise fail with an IndexError, or show another token's value."""
    n = len(row["input_ids"] or [])
    for name in TOKEN_LISTS:
        if row[name] is None and name != "fact":  # fact: null where the data has no ground truth
            raise DataError(f"{file}: sample {row['sample_id']}: column {name} is null; rerun `attribute`")
        if row[name] is not None and len(row[name]) != n:
            raise DataError(f"{file}: sample {row['sample_id']}: column {name} has {len(row[name])} values for {n} "
                            "tokens; rerun `attribute`")


def iter_samples(shard_dir) -> Iterator[dict]:
    """The rows of an attribution directory, shard by shard, reading only the shards its manifest lists (each
    checked against its sha256), every row checked (`check_row`)."""
    manifest = attribution_manifest(shard_dir, verify=True)  # here, not at the first row: errors come at once

    def rows() -> Iterator[dict]:
        for shard in manifest["shards"]:
            file = Path(shard_dir) / shard["name"]
            for batch in pq.ParquetFile(file).iter_batches(batch_size=256):
                for row in batch.to_pylist():
                    check_row(row, file)
                    yield row

    return rows()


def find_sample(shard_dir, sample_id: int) -> dict:
    for row in iter_samples(shard_dir):
        if row["sample_id"] == sample_id:
            return row
    raise DataError(f"{shard_dir}: no sample with id {sample_id}")


@dataclass(frozen=True)
class WeightSettings:
    """What the weights shown are computed with, and a line saying so."""

    r: float
    tau: float
    alpha: float
    score: str
    title: str


def weight_settings(params: dict, run_name: str | None = None, run: dict | None = None, r: float | None = None,
                    tau: float | None = None, alpha: float | None = None) -> WeightSettings:
    """r, τ, α and the score: each flag given (not None), else run `run_name`'s (`run`: its flat spec), else the
    params' hard weighting's (τ: the soft weighting's), as stage two reads them."""
    run = run or {}

    def pick(flag, key: str, where: str):
        if flag is not None:
            return flag
        return run[key] if key in run else section(params, f"{where}.{key}")

    chosen = {"r": pick(r, "r", HARD), "tau": pick(tau, "tau", SOFT), "alpha": pick(alpha, "alpha", HARD),
              "score": run["score"] if "score" in run else section(params, HARD).get("score", "phi")}
    if run_name is None:
        for key in ("alpha", "score"):  # one φ for both columns: say so where the soft weighting reads another
            soft = (section(params, "unlearn.weightings").get("soft") or {}).get(key)
            if soft is not None and soft != chosen[key] and not (key == "alpha" and alpha is not None):
                log.warning("%s.%s=%r differs from %s.%s=%r: the soft column uses the latter too; a soft run's "
                            "exact weights: --run NAME", SOFT, key, soft, HARD, key, chosen[key])
    title = weights_title(run_name, run.get("weighting", "uniform"), **chosen)
    flags = [f"--{k}" for k, v in {"r": r, "tau": tau, "alpha": alpha}.items() if v is not None]
    if run_name is not None and flags:
        title += f" ({', '.join(flags)} given over the run's)"
    return WeightSettings(**chosen, title=title)


def weights_title(run_name: str | None, weighting: str, r: float, tau: float, alpha: float, score: str) -> str:
    of = f"{score} (α = {alpha})"
    if run_name is None:
        return f"weights: hard top r = {r}, soft τ = {tau}, of {of}"
    if weighting == "hard":
        return f"run {run_name}: hard weights, the top r = {r} of {of}: column hard"
    if weighting == "soft":
        return f"run {run_name}: soft weights, softmax({score} / τ) with τ = {tau}, α = {alpha}: column soft"
    if weighting == "proportional":
        return f"run {run_name}: proportional weights, ω ∝ {score} (α = {alpha}): column score"
    return f"run {run_name}: {weighting} weights, ω = 1 at every scored token (hard r = {r}, soft τ = {tau}: " \
           f"not this run's)"


def token_text(row: dict, i: int) -> str:
    start, end = row["token_start"][i], row["token_end"][i]
    return row["text"][start:end] if end > start else "<special>"


def scores_of(row: dict, names: list[str], alpha: float, seed: int = 0) -> dict[str, np.ndarray]:
    """Each named score (φ and attribution variants) over the row's scored tokens; the random control as
    unlearning seed `seed` draws it."""
    scored = np.flatnonzero(row["scored"])
    out = {}
    for name in names:
        require_columns(name, {c for c, v in row.items() if v is not None}, f"sample {row['sample_id']}")
        columns = {c: np.array(row[c], dtype=np.float64)[scored] for c in {"delta", "entropy", *score_columns(name)}}
        columns.update(draw(name, seed, row["sample_id"], len(scored)))
        out[name] = variant_score(name, columns, alpha)
    return out


def token_table(row: dict, alpha: float, r: float, tau: float, variants: list[str] = (),
                score: str = "phi") -> list[dict]:
    """The scored tokens with Δ, H, φ (recomputed with `alpha`), `score` (φ or a variant) and the hard and soft
    weights it gives, as stage two computes them; each of `variants` adds its score and hard weight (columns
    `<name>` and `<name> hard`)."""
    scored = np.flatnonzero(row["scored"])
    delta = np.array(row["delta"], dtype=np.float64)[scored]
    entropy = np.array(row["entropy"], dtype=np.float64)[scored]
    scores = scores_of(row, list(dict.fromkeys(["phi", score, *variants])), alpha)
    weighted = scores[score]
    hard, soft = hard_weights(weighted, r=r), soft_weights(weighted, tau=tau)
    table = [
        {"position": int(p), "token": token_text(row, int(p)), "delta": float(d), "entropy": float(h),
         "phi": float(f), "score": float(s), "hard": float(w), "soft": float(sw),
         "fact": bool(row["fact"][p]) if row["fact"] else None}
        for p, d, h, f, s, w, sw in zip(scored, delta, entropy, scores["phi"], weighted, hard, soft)
    ]
    for name in variants:
        chosen = hard_weights(scores[name], r=r)
        for t, v, w in zip(table, scores[name], chosen):
            t[name], t[f"{name} hard"] = float(v), float(w)
    return table


def shards_tokenizer(manifest: dict, tokenizer=None):
    """The tokenizer of the model the shards were made with (their manifest names it), or `tokenizer` (a loaded
    one, or a name or path to load); refused where its hash is not the one the shards record."""
    metadata = manifest.get("metadata", {})
    if tokenizer is None:
        if not metadata.get("model"):
            raise DataError("the shards' manifest names no model to read their tokenizer from; pass tokenizer=")
        try:
            tokenizer = load_tokenizer(metadata["model"])
        except DataError as e:  # a relative path, read from another directory than the one `attribute` ran in
            raise DataError(f"{e}; it is the model the shards' manifest names: pass tokenizer= its directory "
                            "(or run from the directory `attribute` ran in)") from None
    if isinstance(tokenizer, (str, Path)):
        tokenizer = load_tokenizer(tokenizer)
    recorded = metadata.get("tokenizer_hash")
    if recorded is not None and tokenizer_hash(tokenizer) != recorded:
        raise DataError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r}: hash {tokenizer_hash(tokenizer)}, "
                        f"the shards were made with tokenizer_hash {recorded}; its text would be wrong")
    return tokenizer


def token_scores(shard_dir, r: float = 0.2, tau: float = 0.5, alpha: float = 0.7, tokenizer=None,
                 score: str = "phi"):
    """Every scored token of an attribution directory as a pandas DataFrame: sample_id, position, token_id, token
    (its text, decoded with the shards' tokenizer), delta, entropy, phi (with `alpha`), the hard (top `r`) and
    soft (softmax by `tau`) weights of `score` as stage two computes them, `score` where it is not φ, and fact
    where the shards have ground truth. Reads only the shards the manifest lists."""
    import pandas as pd

    tokenizer = shards_tokenizer(attribution_manifest(shard_dir), tokenizer)
    records = []
    for row in iter_samples(shard_dir):
        for t in token_table(row, alpha, r, tau, score=score):
            token_id = row["input_ids"][t["position"]]
            records.append({"sample_id": row["sample_id"], "position": t["position"], "token_id": token_id, **t})
    columns = ["sample_id", "position", "token_id", "token", "delta", "entropy", "phi", "score", "hard", "soft",
               "fact"]
    df = pd.DataFrame.from_records(records, columns=columns)
    texts = {i: tokenizer.decode([i]) for i in df["token_id"].unique().tolist()}
    df["token"] = df["token_id"].map(texts)
    drop = (["score"] if score == "phi" else []) + (["fact"] if df["fact"].isna().all() else [])
    return df.drop(columns=drop).sort_values(["sample_id", "position"], ignore_index=True)


def masked_prefix(row: dict) -> str:
    """The text before the first scored token, with every masked token shown as [MASK]."""
    end = row["token_start"][row["scored"].index(True)] if any(row["scored"]) else len(row["text"])
    parts, cursor = [], 0
    for start, stop, masked in zip(row["token_start"], row["token_end"], row["masked"]):
        if masked and stop > start and start >= cursor:
            parts += [row["text"][cursor:start], "[MASK]"]
            cursor = stop
    parts.append(row["text"][cursor:end])
    return "".join(parts)


def _bg(phi: float) -> str:
    level = int(255 - 200 * max(0.0, min(1.0, phi)))
    return f"\x1b[48;2;255;{level};{level}m\x1b[38;2;0;0;0m"


def render_terminal(row: dict, table: list[dict], color: bool, variants: list[str] = (), score: str = "phi",
                    title: str = "") -> str:
    """The table of `token_table`; a column for `score` where the weights come from another score than φ."""
    lines = [f"sample {row['sample_id']} ({row['split']})", *([title] if title else []),
             f"masked prefix: {masked_prefix(row)!r}", ""]
    width = max(len(score), 6)
    header = f"{'pos':>4}  {'token':<18}{'delta':>8}{'entropy':>9}{'phi':>7}"
    header += (f"  {score:>{width}}" if score != "phi" else "") + f"{'hard':>6}{'soft':>8}"
    header += "".join(f"  {name:>{max(len(name), 6)}} hard" for name in variants)
    lines.append(header + ("  fact" if table and table[0]["fact"] is not None else ""))
    for t in table:
        token = repr(t["token"])[1:-1][:17]
        cell = f"{token:<18}"
        if color:
            cell = f"{_bg(t['score'])}{cell}\x1b[0m"
        line = f"{t['position']:>4}  {cell}{t['delta']:>8.3f}{t['entropy']:>9.3f}{t['phi']:>7.3f}"
        line += (f"  {t['score']:>{width}.3f}" if score != "phi" else "") + f"{t['hard']:>6.0f}{t['soft']:>8.3f}"
        line += "".join(f"  {t[name]:>{max(len(name), 6)}.3f} {t[name + ' hard']:>4.0f}" for name in variants)
        lines.append(line + ("  *" if t["fact"] else ""))
    if color:
        lines += ["", "".join(f"{_bg(t['score'])}{t['token']}\x1b[0m " for t in table)]
    return "\n".join(lines)


def _html_line(label: str, table: list[dict], key: str, hard_key: str) -> str:
    cells = []
    for t in table:
        value = t[key]
        alpha_bg = 0.1 + 0.9 * max(0.0, min(1.0, value)) if not math.isnan(value) else 0
        classes = "t" + (" sel" if t[hard_key] else "") + (" fact" if t["fact"] else "")
        title = (f"{key}={value:.3f} Δ={t['delta']:.3f} H={t['entropy']:.3f} φ={t['phi']:.3f} "
                 f"hard={t[hard_key]:.0f} soft={t['soft']:.3f}")
        cells.append(f"<span class='{classes}' style='background:rgba(220,30,30,{alpha_bg:.2f})' "
                     f"title='{html.escape(title)}'>{html.escape(t['token'])}</span>")
    return f"<div><span class='l'>{html.escape(label)}</span>{''.join(cells)}</div>"


def render_html(rows: list[dict], alpha: float, r: float, tau: float, variants: list[str] = (), score: str = "phi",
                title: str = "") -> str:
    """A heatmap page: per sample, one line of tokens coloured by `score` (φ: the paper's) and one by each of
    `variants`, side by side."""
    out = [
        "<!doctype html><html><head><meta charset='utf-8'><title>TokenUnlearn attribution</title><style>",
        "body{font-family:system-ui,sans-serif;margin:2em;max-width:80em}"
        ".s{margin:1em 0;padding:.5em;border-bottom:1px solid #ddd}.p{color:#555}"
        ".t{padding:1px 2px;margin:1px;border-radius:3px;display:inline-block}.sel{outline:2px solid #c00}"
        ".fact{text-decoration:underline}.l{display:inline-block;width:11em;color:#555;font-size:90%}",
        "</style></head><body>",
        f"<h1>Token attribution</h1><p>φ = {alpha}·minmax(Δ) + {1 - alpha:.2f}·minmax(H); each line is coloured by "
        f"its score ({', '.join([score, *variants])}); red outline: hard weight 1 (top r = {r}); underline: a fact "
        f"token (ground truth); hover for values (soft τ = {tau}).{' ' + html.escape(title) if title else ''}</p>",
    ]
    for row in rows:
        table = token_table(row, alpha, r, tau, variants, score)
        lines = [_html_line("φ (the paper's)" if score == "phi" else score, table, "score", "hard")]
        lines += [_html_line(name, table, name, f"{name} hard") for name in variants]
        out.append(f"<div class='s'><div class='p'>#{row['sample_id']} {html.escape(masked_prefix(row))}</div>"
                   f"{''.join(lines)}</div>")
    out.append("</body></html>")
    return "\n".join(out)
