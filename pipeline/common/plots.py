"""matplotlib for the stages: the file-only backend, and figures written atomically."""

from __future__ import annotations

from pathlib import Path

from pipeline.common.atomic import atomic_file


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (stages run without a display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path) -> None:
    """Write `fig` as a PNG to `path` (atomically) and close it."""
    plt = pyplot()
    fig.tight_layout()
    with atomic_file(path, "wb") as f:
        fig.savefig(f, format="png", dpi=120)
    plt.close(fig)
