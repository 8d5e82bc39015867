"""Attribution quality against ground truth: how well each sample's top-r tokens find its fact tokens, where the
data marks them (the embedded world's annotations), for every variant the shards allow and a random choice."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.common.errors import DataError

from pipeline.attribution.shards import SIGNAL_COLUMNS, iter_rows, read_manifest
from pipeline.attribution.variants import available_scores, score_columns, variant_score
from pipeline.attribution.weights import hard_weights

ALWAYS = {"delta", "entropy", "logp_orig", "logp_mask"}  # the paper's columns, in every shard


def topr_counts(score: np.ndarray, fact: np.ndarray, r: float) -> np.ndarray:
    """(selected, selected that are facts, facts) for the top-r fraction of one sample's scored tokens."""
    chosen = hard_weights(score, r=r).astype(bool)
    return np.array([chosen.sum(), (chosen & fact).sum(), fact.sum()], dtype=np.float64)


def shard_scores(shard_dir: Path) -> list[str]:
    """The variants a shard directory's columns allow (its metadata names the extra signals)."""
    signals = read_manifest(shard_dir, verify=False)["metadata"].get("signals", [])
    unknown = sorted(set(signals) - set(SIGNAL_COLUMNS))
    if unknown:
        raise DataError(f"{shard_dir}: its metadata names signals this code does not know, {unknown}: rerun `attribute`")
    return available_scores(ALWAYS | {c for s in signals for c in SIGNAL_COLUMNS[s]})


def precision_recall(counts: np.ndarray, seed: int = 0, n_boot: int = 1000) -> dict:
    """Micro-averaged precision and recall from per-sample (selected, hits, facts) counts [samples, 3], with a 95%
    bootstrap interval over samples."""
    def pr(c):
        return c[..., 1] / np.maximum(c[..., 0], 1), c[..., 1] / np.maximum(c[..., 2], 1)

    precision, recall = pr(counts.sum(0))
    rng = np.random.default_rng(seed)  # the same seed for every variant: their resamples are paired
    boot = counts[rng.integers(0, len(counts), (n_boot, len(counts)))].sum(1)
    bp, br = pr(boot)
    return {"precision": float(precision), "recall": float(recall),
            "precision_ci": [float(v) for v in np.quantile(bp, [0.025, 0.975])],
            "recall_ci": [float(v) for v in np.quantile(br, [0.025, 0.975])]}


def attribution_quality(shard_dir: Path, rs: list[float], alpha: float = 0.7, seed: int = 0) -> dict | None:
    """Precision and recall of each sample's top-r tokens against its fact tokens (micro-averaged, with bootstrap
    intervals over samples), for every variant of the shards (φ with α; Δ alone, H alone among them) and a random
    choice. None where the data has no fact spans."""
    rng = np.random.default_rng(seed)
    names = shard_scores(shard_dir)
    columns = sorted({c for name in names for c in score_columns(name)} | {"delta", "entropy"})
    per_sample: dict[tuple, list] = {(r, name): [] for r in rs for name in [*names, "random"]}
    fact_tokens = scored_tokens = 0
    for row in iter_rows(shard_dir, columns=["scored", "fact", *columns], verify=False):
        if row["fact"] is None:
            return None
        scored = np.array(row["scored"])
        cols = {c: np.array(row[c], dtype=np.float64)[scored] for c in columns}
        fact = np.array(row["fact"])[scored]
        fact_tokens, scored_tokens = fact_tokens + fact.sum(), scored_tokens + len(fact)
        scores = {name: variant_score(name, cols, alpha) for name in names}
        scores["random"] = rng.random(len(fact))
        for name, score in scores.items():
            for r in rs:
                per_sample[(r, name)].append(topr_counts(score, fact, r))
    out: dict = {"fact_token_share": float(fact_tokens / max(scored_tokens, 1)), "variants": names}
    for (r, name), counts in per_sample.items():
        out.setdefault(f"r={r}", {})[name] = precision_recall(np.array(counts), seed)
    return out


def choose_variant(quality: dict, r: float = 0.2) -> tuple[str, dict]:
    """The rule that picks a variant on the choice world: the highest F1 of top-r precision and recall (ties: the
    earlier variant in the shards' order, cheaper bases first)."""
    table = quality[f"r={r}"]
    names = [n for n in quality["variants"] if n in table]

    def f1(v):
        p, rec = table[v]["precision"], table[v]["recall"]
        return 2 * p * rec / (p + rec) if p + rec else 0.0

    best = max(names, key=lambda n: (f1(n), -names.index(n)))
    return best, {"rule": f"highest F1 of top-{r} precision and recall", "f1": f1(best)}


def compare_variants(choose: dict, report: dict, r_choice: float = 0.2) -> tuple[str, dict]:
    """The variant chosen on one world (`choose`: mode -> its attribution quality) and every variant's precision and
    recall on the held-out world (`report`: mode -> quality), as Markdown and as metrics."""
    lines, metrics = [], {}
    for mode in report:
        for world, quality in (("choice", choose[mode]), ("held-out", report[mode])):
            if f"r={r_choice}" not in quality:
                raise DataError(f"{mode} mode, {world} world: no figures at r={r_choice} (its attribute stage measured "
                                f"{sorted(k for k in quality if k.startswith('r='))}; add it to attribution.quality_r)")
        chosen, why = choose_variant(choose[mode], r_choice)
        held, picked = report[mode], choose[mode][f"r={r_choice}"]
        if chosen not in held[f"r={r_choice}"]:
            raise DataError(f"{mode} mode: the chosen variant {chosen!r} was not measured on the held-out world (its "
                            "attribute stage lacks a signal the variant needs: add it to attribution.signals)")
        rs = sorted(k for k in held if k.startswith("r="))
        metrics[mode] = {"chosen": chosen, **why, "choice_world": picked[chosen],
                         "heldout": {r: {n: held[r][n] for n in dict.fromkeys([chosen, "phi", "entropy", "random"])}
                                     for r in rs}}
        lines += [f"## {mode} mode: chosen `{chosen}` ({why['rule']} on the choice world, F1 {why['f1']:.3f})", "",
                  f"Held-out world: {held['fact_token_share']:.3f} of the scored tokens are facts. Precision / recall "
                  f"of each sample's top-r tokens (95% bootstrap interval over samples for r = {r_choice}); the "
                  f"choice world's r = {r_choice} in the last column.", "",
                  "| variant | " + " | ".join(f"held-out {r}" for r in rs) + f" | choice world r={r_choice} |",
                  "|---|" + "---|" * (len(rs) + 1)]
        order = sorted(held[f"r={r_choice}"], key=lambda n: -held[f"r={r_choice}"][n]["precision"])
        for name in order:
            cells = []
            for r in rs:
                v = held[r][name]
                cell = f"{v['precision']:.3f} / {v['recall']:.3f}"
                if r == f"r={r_choice}":
                    cell += f" ({v['precision_ci'][0]:.2f}–{v['precision_ci'][1]:.2f})"
                cells.append(cell)
            c = picked.get(name)
            cells.append(f"{c['precision']:.3f} / {c['recall']:.3f}" if c else "")
            label = f"**{name}** (chosen)" if name == chosen else ("phi (the paper's)" if name == "phi" else name)
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines), metrics


def headline_metrics(metrics: dict, r: float = 0.2) -> dict:
    """The few numbers `dvc metrics show` lists for stage one: the counts, and how well φ finds the facts at the
    paper's r = 0.2 (where the world has fact annotations and attribution.quality_r has r)."""
    out = {k: metrics[k] for k in ("samples", "scored_tokens") if isinstance(metrics.get(k), int)}
    phi = ((metrics.get("quality") or {}).get(f"r={r}") or {}).get("phi")
    if phi:
        out |= {"phi_precision": phi["precision"], "phi_recall": phi["recall"]}
    return out
