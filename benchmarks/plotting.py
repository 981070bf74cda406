"""Matplotlib for the benchmark scripts: optional (the `bench` extra), headless, one way to save."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def pyplot() -> Any | None:
    """matplotlib.pyplot on the Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_figure(plt: Any, fig: Any, path: Path) -> str:
    """Lay out, write the PNG (creating its folder) and free the figure; returns the path."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
