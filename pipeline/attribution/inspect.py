"""Views of attribution shards: a per-token table for the terminal, and an HTML heatmap of many samples."""

from __future__ import annotations

import html
import math

import numpy as np

from pipeline.attribution.shards import iter_rows
from pipeline.attribution.variants import require_columns, score_columns, variant_score
from pipeline.attribution.weights import hard_weights, soft_weights
from pipeline.common.errors import DataError


def find_sample(shard_dir, sample_id: int) -> dict:
    for row in iter_rows(shard_dir):
        if row["sample_id"] == sample_id:
            return row
    raise DataError(f"{shard_dir}: no sample with id {sample_id}")


def token_text(row: dict, i: int) -> str:
    start, end = row["token_start"][i], row["token_end"][i]
    return row["text"][start:end] if end > start else "<special>"


def scores_of(row: dict, names: list[str], alpha: float) -> dict[str, np.ndarray]:
    """Each named score (φ and attribution variants) over the row's scored tokens."""
    scored = np.flatnonzero(row["scored"])
    out = {}
    for name in names:
        require_columns(name, {c for c, v in row.items() if v is not None}, f"sample {row['sample_id']}")
        columns = {c: np.array(row[c], dtype=np.float64)[scored] for c in {"delta", "entropy", *score_columns(name)}}
        out[name] = variant_score(name, columns, alpha)
    return out


def token_table(row: dict, alpha: float, r: float, tau: float, variants: list[str] = ()) -> list[dict]:
    """The scored tokens with Δ, H, φ (recomputed with `alpha`) and the hard and soft weights they give; each of
    `variants` adds its score and hard weight (columns `<name>` and `<name> hard`)."""
    scored = np.flatnonzero(row["scored"])
    delta = np.array(row["delta"], dtype=np.float64)[scored]
    entropy = np.array(row["entropy"], dtype=np.float64)[scored]
    scores = scores_of(row, ["phi", *variants], alpha)
    phi = scores["phi"]
    hard, soft = hard_weights(phi, r=r), soft_weights(phi, tau=tau)
    table = [
        {"position": int(p), "token": token_text(row, int(p)), "delta": float(d), "entropy": float(h),
         "phi": float(f), "hard": float(w), "soft": float(s), "fact": bool(row["fact"][p]) if row["fact"] else None}
        for p, d, h, f, w, s in zip(scored, delta, entropy, phi, hard, soft)
    ]
    for name in variants:
        chosen = hard_weights(scores[name], r=r)
        for t, v, w in zip(table, scores[name], chosen):
            t[name], t[f"{name} hard"] = float(v), float(w)
    return table


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


def render_terminal(row: dict, table: list[dict], color: bool, variants: list[str] = ()) -> str:
    lines = [f"sample {row['sample_id']} ({row['split']})", f"masked prefix: {masked_prefix(row)!r}", ""]
    header = f"{'pos':>4}  {'token':<18}{'delta':>8}{'entropy':>9}{'phi':>7}{'hard':>6}{'soft':>8}"
    header += "".join(f"  {name:>{max(len(name), 6)}} hard" for name in variants)
    lines.append(header + ("  fact" if table and table[0]["fact"] is not None else ""))
    for t in table:
        token = repr(t["token"])[1:-1][:17]
        cell = f"{token:<18}"
        if color:
            cell = f"{_bg(t['phi'])}{cell}\x1b[0m"
        line = (f"{t['position']:>4}  {cell}{t['delta']:>8.3f}{t['entropy']:>9.3f}{t['phi']:>7.3f}"
                f"{t['hard']:>6.0f}{t['soft']:>8.3f}")
        line += "".join(f"  {t[name]:>{max(len(name), 6)}.3f} {t[name + ' hard']:>4.0f}" for name in variants)
        lines.append(line + ("  *" if t["fact"] else ""))
    if color:
        lines += ["", "".join(f"{_bg(t['phi'])}{t['token']}\x1b[0m " for t in table)]
    return "\n".join(lines)


def _html_line(label: str, table: list[dict], key: str, hard_key: str) -> str:
    cells = []
    for t in table:
        value = t[key]
        alpha_bg = 0.1 + 0.9 * max(0.0, min(1.0, value)) if not math.isnan(value) else 0
        classes = "t" + (" sel" if t[hard_key] else "") + (" fact" if t["fact"] else "")
        title = (f"{key}={value:.3f} Δ={t['delta']:.3f} H={t['entropy']:.3f} φ={t['phi']:.3f} "
                 f"hard={t[hard_key]:.0f} soft(φ)={t['soft']:.3f}")
        cells.append(f"<span class='{classes}' style='background:rgba(220,30,30,{alpha_bg:.2f})' "
                     f"title='{html.escape(title)}'>{html.escape(t['token'])}</span>")
    return f"<div><span class='l'>{html.escape(label)}</span>{''.join(cells)}</div>"


def render_html(rows: list[dict], alpha: float, r: float, tau: float, variants: list[str] = ()) -> str:
    """A heatmap page: per sample, one line of tokens coloured by φ and one by each of `variants`, side by side."""
    out = [
        "<!doctype html><html><head><meta charset='utf-8'><title>TokenUnlearn attribution</title><style>",
        "body{font-family:system-ui,sans-serif;margin:2em;max-width:80em}"
        ".s{margin:1em 0;padding:.5em;border-bottom:1px solid #ddd}.p{color:#555}"
        ".t{padding:1px 2px;margin:1px;border-radius:3px;display:inline-block}.sel{outline:2px solid #c00}"
        ".fact{text-decoration:underline}.l{display:inline-block;width:11em;color:#555;font-size:90%}",
        "</style></head><body>",
        f"<h1>Token attribution</h1><p>φ = {alpha}·minmax(Δ) + {1 - alpha:.2f}·minmax(H); each line is coloured by "
        f"its score{' (φ, then ' + ', '.join(variants) + ')' if variants else ''}; red outline: hard weight 1 (top "
        f"r = {r}); underline: a fact token (ground truth); hover for values (soft τ = {tau}).</p>",
    ]
    for row in rows:
        table = token_table(row, alpha, r, tau, variants)
        lines = [_html_line("φ (the paper's)", table, "phi", "hard")]
        lines += [_html_line(name, table, name, f"{name} hard") for name in variants]
        out.append(f"<div class='s'><div class='p'>#{row['sample_id']} {html.escape(masked_prefix(row))}</div>"
                   f"{''.join(lines)}</div>")
    out.append("</body></html>")
    return "\n".join(out)
