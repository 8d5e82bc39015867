"""MUSE's table of models, and MUSE's metrics over unlearning requests and forget-set sizes (its sustainability
and scalability), read from `evaluate-muse` outputs and written as Markdown, CSV and PNG.

A request's own numbers come from the items of an evaluation of the whole forget set (`items/*.parquet`): VerbMem
and KnowMem forget are the means over its authors' verbmem prompts and knowmem questions, and its PrivLeak is
MUSE's, its authors' forget texts against every holdout text, relative to the retain model's AUC on the same texts.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from pipeline.common.atomic import atomic_dir
from pipeline.common.errors import DataError, ParamError
from pipeline.common.plots import pyplot, save_figure
from pipeline.data.muse_requests import Request
from pipeline.evaluation import eval_io
from pipeline.evaluation.muse import muse_auc, privleak
from pipeline.evaluation.registry import MUSE, of


METRICS = tuple(m for m in of(MUSE) if m.meaning)  # MUSE's four, its report's columns (the registry's order)
REQUEST_KEYS = ("verbmem_f", "knowmem_f", "privleak")  # the metrics a part of the forget set has


# ---- reading ------------------------------------------------------------------------------------------------

def read_muse_summary(eval_dir: Path) -> dict:
    """An `evaluate-muse` output's metrics.json, its MUSE metrics checked."""
    file = Path(eval_dir) / "metrics.json"
    if not file.is_file():
        raise DataError(f"{eval_dir}: no evaluate-muse output (metrics.json); evaluate the model first")
    data = eval_io.read_json(file, "evaluate-muse summary")
    for m in METRICS:
        eval_io.number(data.get(m.key), f"{file}: {m.key}", *m.range, nullable=m.key == "privleak")
    return data


@dataclass
class Items:
    """The per-item scores of one evaluation that a part of the forget set is read from."""

    verbmem: dict[str, float]         # prompt -> ROUGE-L F1
    knowmem: dict[str, float]         # question -> ROUGE-L F1
    forget_scores: dict[str, float]   # forget text -> the PrivLeak attack's score
    holdout_scores: np.ndarray


def read_items(eval_dir: Path) -> Items:
    eval_dir = Path(eval_dir)
    attack = (read_muse_summary(eval_dir).get("definitions") or {}).get("attack", "min_k")

    def table(name: str, key: str, value: str) -> dict:
        file = eval_dir / "items" / f"{name}.parquet"
        rows = eval_io.read_parquet(file).to_pylist()
        if not rows or any(key not in r or value not in r for r in rows):
            raise DataError(f"{file}: needs rows with {key} and {value} (an evaluate-muse output)")
        return {r[key]: eval_io.number(r[value], f"{file}: {value} of {str(r[key])[:40]!r}") for r in rows}

    return Items(table("verbmem", "prompt", "rougeL_f1"), table("knowmem_forget", "question", "rougeL_f1"),
                 table("privleak_forget", "text", attack),
                 np.array(list(table("privleak_holdout", "text", attack).values())))


def union(requests: Sequence[Request], name: str) -> Request:
    """Several requests as one part of the forget set."""
    return Request(name, *(tuple(x for r in requests for x in getattr(r, f))
                           for f in ("authors", "texts", "questions", "verbmem_prompts")))


def part_metrics(items: Items, retain: Items, part: Request, where: str) -> dict:
    """VerbMem, KnowMem forget and PrivLeak of `part` of the forget set."""
    def pick(scores: dict, keys: Sequence[str], what: str) -> list[float]:
        missing = [k for k in keys if k not in scores]
        if missing:
            raise DataError(f"{where}: {part.name}'s {what} {str(missing[0])[:60]!r} is not among the evaluation's "
                            "items (evaluated on another forget set?)")
        return [scores[k] for k in keys]

    def percent(values: list[float]) -> float | None:  # None: the part has no such item
        return 100 * float(np.mean(values)) if values else None

    verbmem = percent(pick(items.verbmem, part.verbmem_prompts, "verbmem prompt"))
    knowmem = percent(pick(items.knowmem, part.questions, "question"))
    leak = None
    if part.texts:
        auc = muse_auc(pick(items.forget_scores, part.texts, "text"), items.holdout_scores)
        leak = privleak(auc, muse_auc(pick(retain.forget_scores, part.texts, "text"), retain.holdout_scores))
    return {"verbmem_f": verbmem, "knowmem_f": knowmem, "privleak": leak}


# ---- MUSE's table -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Entry:
    name: str       # target, retain, or a run
    label: str      # "before unlearning", "retain model", "T-NPO", ...
    summary: dict   # its evaluate-muse metrics.json


def _fmt(value) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def directions_note() -> str:
    return "\n".join(f"- **{m.name}** {m.direction}: {m.meaning}." for m in METRICS)


def muse_table(entries: Sequence[Entry]) -> tuple[str, str]:
    """MUSE's metrics of each model: a Markdown table (with each metric's direction) and its CSV."""
    head = ["model", "run", *(m.title for m in METRICS), "PrivLeak Min-K%++ → 0"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["run", "model", *(m.key for m in METRICS), "privleak_min_k_plus_plus", "auc"])
    for e in entries:
        values = [e.summary.get(m.key) for m in METRICS] + [e.summary.get("privleak_min_k_plus_plus")]
        lines.append("| " + " | ".join([e.label, e.name, *map(_fmt, values)]) + " |")
        auc = (e.summary.get("auc") or {}).get((e.summary.get("definitions") or {}).get("attack", "min_k"))
        writer.writerow([e.name, e.label, *("" if v is None else round(v, 4) for v in values),
                         "" if auc is None else auc])
    return "\n".join(lines) + "\n", out.getvalue()


def write_muse_report(entries: Sequence[Entry], out_dir: Path, title: str) -> str:
    """results.md (the table, then what each metric means) and results.csv, atomically; returns the table."""
    table, table_csv = muse_table(entries)
    with atomic_dir(out_dir) as tmp:
        (tmp / "results.md").write_text(f"# {title}\n\n{table}\n{directions_note()}\n", encoding="utf-8")
        (tmp / "results.csv").write_text(table_csv, encoding="utf-8")
    return table


# ---- requests and sizes -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Point:
    """One model of a series: run `run` (its display `label`) at x (requests unlearned, or authors forgotten)."""

    run: str
    label: str
    x: int
    eval_dir: Path


UNLEARNED = "unlearned"  # the scope of the requests unlearned so far, together
SERIES_COLUMNS = ("run", "label", "x", "scope", "verbmem_f", "knowmem_f", "knowmem_r", "privleak")


def series_rows(points: Sequence[tuple[Point, Sequence[Request]]], retain_dir: Path) -> list[dict]:
    """Per point: MUSE's metrics of the whole forget set (scope `all`, as evaluate-muse computes them), and those
    of each part of the forget set given with it (each request, or the requests unlearned), scope its name."""
    retain = read_items(retain_dir)
    rows = []
    for p, parts in points:
        summary = read_muse_summary(p.eval_dir)
        rows.append({"run": p.run, "label": p.label, "x": p.x, "scope": "all",
                     **{m.key: summary.get(m.key) for m in METRICS}})
        items = read_items(p.eval_dir) if parts else None
        for part in parts:
            rows.append({"run": p.run, "label": p.label, "x": p.x, "scope": part.name, "knowmem_r": None,
                         **part_metrics(items, retain, part, str(p.eval_dir))})
    return rows


def series_csv(rows: Sequence[dict]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=SERIES_COLUMNS, lineterminator="\n")
    writer.writeheader()
    for r in rows:
        writer.writerow({k: ("" if r.get(k) is None else round(r[k], 4) if isinstance(r[k], float) else r[k])
                         for k in SERIES_COLUMNS})
    return out.getvalue()


def series_table(rows: Sequence[dict], scope: str, x_title: str) -> str:
    """The rows of one scope as a Markdown table, one line per (run, x)."""
    chosen = [r for r in rows if r["scope"] == scope]
    keys = [m for m in METRICS if any(r.get(m.key) is not None for r in chosen)]
    head = ["run", x_title, *(m.title for m in keys)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join([r["label"], str(r["x"]), *(_fmt(r.get(m.key)) for m in keys)]) + " |"
              for r in chosen]
    return "\n".join(lines) + "\n"


def plot_series(rows: Sequence[dict], scope: str, x_title: str, path: Path, reference: dict | None = None,
                title: str = "") -> None:
    """One panel per MUSE metric over x, one line per run (scope `scope`; knowmem_r from scope `all`); the retain
    model's value of each, where given, as a dashed line."""
    plt = pyplot()
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, len(METRICS), figsize=(4 * len(METRICS), 3.4))
    for ax, m in zip(axes, METRICS):
        use = "all" if m.key == "knowmem_r" else scope
        for label in dict.fromkeys(r["label"] for r in rows):
            pts = [(r["x"], r[m.key]) for r in rows if r["label"] == label and r["scope"] == use
                   and r.get(m.key) is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=label)
        if reference and reference.get(m.key) is not None:
            ax.axhline(reference[m.key], color="grey", linestyle="--", linewidth=1, label="retain model")
        ax.set_title(m.title)
        ax.set_xlabel(x_title)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    axes[-1].legend(fontsize=8, loc="center left", bbox_to_anchor=(1.02, 0.5))  # beside the panels, off the lines
    if title:
        fig.suptitle(title)
    save_figure(fig, path)


def plot_per_request(rows: Sequence[dict], requests: Sequence[Request], path: Path, x_title: str) -> None:
    """VerbMem and KnowMem forget of each request over x, one panel per run: a request drops once it is unlearned,
    and stays down or comes back while the later ones are."""
    plt = pyplot()
    from matplotlib.ticker import MaxNLocator

    labels = list(dict.fromkeys(r["label"] for r in rows))
    keys = [m for m in METRICS if m.key in ("verbmem_f", "knowmem_f")]
    fig, axes = plt.subplots(len(keys), len(labels), figsize=(3.6 * len(labels), 3.0 * len(keys)), squeeze=False)
    for i, m in enumerate(keys):
        for j, label in enumerate(labels):
            ax = axes[i][j]
            for request in requests:
                pts = [(r["x"], r[m.key]) for r in rows if r["label"] == label and r["scope"] == request.name]
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=request.name)
            ax.set_title(f"{label}: {m.title}", fontsize=9)
            ax.set_xlabel(x_title)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
    save_figure(fig, path)


def pivot_table(rows: Sequence[dict], key: str, scopes: Sequence[str], x_title: str) -> str:
    """One metric of several scopes (the requests) side by side, one line per (run, x)."""
    lines = ["| " + " | ".join(["run", x_title, *scopes]) + " |", "|" + "---|" * (len(scopes) + 2)]
    by = {(r["label"], r["x"], r["scope"]): r.get(key) for r in rows}
    for label, x in dict.fromkeys((r["label"], r["x"]) for r in rows):
        lines.append("| " + " | ".join([label, str(x), *(_fmt(by.get((label, x, s))) for s in scopes)]) + " |")
    return "\n".join(lines) + "\n"


def write_series_report(sequential: Sequence[tuple[Point, Sequence[Request]]],
                        sizes: Sequence[tuple[Point, Sequence[Request]]], requests: Sequence[Request],
                        retain_dir: Path, out_dir: Path) -> dict[str, list[dict]]:
    """The sequential series (x: requests unlearned, 0 the target) and the forget-set-size series (x: authors
    forgotten at once) into `out_dir`, atomically: results.md, sequential.csv, size.csv and their plots."""
    reference = read_muse_summary(retain_dir)
    seq_rows, size_rows = series_rows(sequential, retain_dir), series_rows(sizes, retain_dir)
    names = [r.name for r in requests]
    seq_x, size_x = "requests unlearned", "authors forgotten"
    text = "\n".join([
        "# MUSE over unlearning requests and forget-set sizes", "",
        "## Sequential requests", "",
        f"Each run unlearns request 1, then 2, ... {len(requests)}, each from the model the request before left. "
        "MUSE's metrics on the whole forget set (every request; KnowMem retain is the utility):", "",
        series_table(seq_rows, "all", seq_x), "",
        "The same on the requests unlearned so far:", "", series_table(seq_rows, UNLEARNED, seq_x), "",
        "KnowMem forget of each request:", "", pivot_table(seq_rows, "knowmem_f", names, seq_x), "",
        "VerbMem of each request:", "", pivot_table(seq_rows, "verbmem_f", names, seq_x), "",
        "## Forget-set size", "",
        "Each run unlearns requests 1..n at once, from the target. MUSE's metrics on the authors unlearned:", "",
        series_table(size_rows, UNLEARNED, size_x), "",
        "The same on the whole forget set:", "", series_table(size_rows, "all", size_x), "",
        "## The metrics", "", directions_note(),
        "- n/a: PrivLeak is undefined where the retain model's AUC on those texts is 0 (it divides by it); with one "
        "forget text a request's AUC moves in steps of 1 / (holdout texts).", ""])
    with atomic_dir(out_dir) as tmp:
        (tmp / "results.md").write_text(text, encoding="utf-8")
        (tmp / "sequential.csv").write_text(series_csv(seq_rows), encoding="utf-8")
        (tmp / "size.csv").write_text(series_csv(size_rows), encoding="utf-8")
        plot_series(seq_rows, "all", seq_x, tmp / "sequential.png", reference,
                    "Sequential requests: the whole forget set")
        plot_per_request(seq_rows, requests, tmp / "sequential_requests.png", seq_x)
        plot_series(size_rows, UNLEARNED, size_x, tmp / "size.png", reference,
                    "Forget-set size: the authors unlearned")
    return {"sequential": seq_rows, "size": size_rows}


# ---- the series of a pipeline -------------------------------------------------------------------------------

SPEC_KEYS = ("requests", "seed", "runs", "sizes", "chain")


def read_series_spec(file: Path) -> dict:
    """The `sequential` section of a series file (configs/sequential.yaml), its keys checked."""
    import yaml

    try:
        data = yaml.safe_load(Path(file).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise DataError(f"{file}: not a readable YAML file ({str(e).splitlines()[0] if str(e) else e!r})") from None
    spec = data.get("sequential") if isinstance(data, dict) else None
    if not isinstance(spec, dict):
        raise ParamError(f"{file}: no `sequential` section")
    missing = [k for k in SPEC_KEYS if k not in spec]
    if missing:
        raise ParamError(f"{file}: sequential lacks {missing} (it needs {', '.join(SPEC_KEYS)})")
    if not isinstance(spec["runs"], list) or not isinstance(spec["chain"], dict):
        raise ParamError(f"{file}: sequential.runs must be a list and sequential.chain a mapping")
    return spec


def chain_order(runs: Sequence[str], chain: dict, n_requests: int) -> dict[str, list[str]]:
    """Each run's models after request 1, 2, ... K, by name: request 1 is the size series' first run (`RUN_n1`,
    from the target), request k the entry of `chain` (`sequential.chain`) with that run and request, which must
    start from the model after request k − 1 (its `after`). Any other shape of `chain` is a ParamError."""
    for key, item in chain.items():  # each entry's own faults first, named as such (not as a missing link)
        if not isinstance(item, dict):
            raise ParamError(f"sequential.chain.{key}={item!r}: a mapping {{run, request, after}}")
        request = item.get("request")
        if request == 1:
            raise ParamError(f"sequential.chain.{key}.request=1: request 1 of every run is RUN_n1 (the size series' "
                             "first run, from the target), not a chain entry; the chain starts at request 2")
        if not isinstance(request, int) or isinstance(request, bool) or not 2 <= request <= n_requests:
            raise ParamError(f"sequential.chain.{key}.request={request!r}: a request from 2 to {n_requests} "
                             "(sequential.requests)")
        if item.get("run") not in runs:
            raise ParamError(f"sequential.chain.{key}.run={item.get('run')!r}: not a run of sequential.runs "
                             f"{list(runs)}")
    order = {}
    for run in runs:
        names = [f"{run}_n1"]
        for k in range(2, n_requests + 1):
            found = [key for key, item in chain.items() if item.get("run") == run and item.get("request") == k]
            if len(found) != 1:
                raise ParamError(f"sequential.chain: run {run} has {len(found)} entries for request {k}; one is needed")
            after = chain[found[0]].get("after")
            if after != names[-1]:
                raise ParamError(f"sequential.chain.{found[0]}.after={after!r}: request {k} of run {run} starts from "
                                 f"the model after request {k - 1}, {names[-1]!r}")
            names.append(found[0])
        order[run] = names
    extra = sorted(set(chain) - {name for names in order.values() for name in names})
    if extra:
        raise ParamError(f"sequential.chain: {extra} belong to no run of sequential.runs {list(runs)}, or to a request "
                         f"past the last ({n_requests})")
    return order


def series_points(spec: dict, labels: dict[str, str], requests: Sequence[Request], eval_dir: Path,
                  target_eval: Path) -> tuple[list, list]:
    """The evaluations of the sequential series (x = requests unlearned: 0 the target, then each request's model;
    with each request's part and the requests unlearned so far) and of the size series (x = authors forgotten:
    `RUN_n{n}`, requests 1..n at once; with those requests' part), from the `sequential` params."""
    if spec.get("requests") != len(requests):
        raise DataError(f"the corpora hold {len(requests)} requests, sequential.requests is {spec.get('requests')}: "
                        "write them again with muse-corpora --requests")
    sizes = spec.get("sizes") or []
    if 1 not in sizes or not set(sizes) <= set(range(1, len(requests) + 1)):
        raise ParamError(f"sequential.sizes={sizes!r}: request counts from 1 to {len(requests)}, 1 among them (the "
                         "first request of every chain)")
    order = chain_order(spec["runs"], spec.get("chain") or {}, len(requests))
    sequential, by_size = [], []
    for run in spec["runs"]:
        for k, name in enumerate([None, *order[run]]):
            parts = [*requests, union(requests[:k], UNLEARNED)] if k else list(requests)
            sequential.append((Point(run, labels[run], k, target_eval if name is None else eval_dir / name), parts))
        for n in sorted(sizes):
            authors = sum(len(r.authors) for r in requests[:n])
            by_size.append((Point(run, labels[run], authors, eval_dir / f"{run}_n{n}"),
                            [union(requests[:n], UNLEARNED)]))
    return sequential, by_size
