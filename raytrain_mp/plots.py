"""Charts as files: matplotlib on its file-only backend, and a finished figure as PNG bytes.

Job: the one place that picks matplotlib's Agg backend (Ray workers and CI have no display) and
turns a figure into PNG bytes and frees it, for every chart the tool writes (a run's curves, a
sweep's plot, an evaluation's confusion matrix, the benchmarks' charts). Invariant: a figure
handed to ``png_bytes`` is closed afterwards, so a long run that redraws its curves keeps no
figures alive. matplotlib is imported on first use, so importing this module costs nothing.
"""

from __future__ import annotations

import io
from typing import Any


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def png_bytes(fig: Any, dpi: int = 100) -> bytes:
    """``fig`` laid out and encoded as a PNG at ``dpi``; the figure is closed."""
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    pyplot().close(fig)
    return buffer.getvalue()
