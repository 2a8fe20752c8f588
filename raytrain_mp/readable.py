"""How the tool writes a number for a person: one format for lr, losses and accuracies in epoch
lines, progress lines, summaries and ``eval``'s output.

Invariant: ``number(x)`` has 4 significant digits (``5.098e-06``, ``0.9694``, ``1.055``) and reads
as a float where the value is whole (``1.0``, ``0.0``, never ``1`` or ``0``: an accuracy of 1 is a
measured value, not a count; ``1235`` is 1234.56 rounded, as ``.4g`` writes it). Machine-readable
output (``--json``, ``metrics.csv``, ``eval.json``) keeps full precision and never goes through here.
"""

from __future__ import annotations

from typing import Any


def number(value: float) -> str:
    """``value`` with 4 significant digits, as a float (see the module doc)."""
    text = f"{float(value):.4g}"
    return text + ".0" if float(value).is_integer() and text.lstrip("-").isdigit() else text


class Readable(float):
    """A float that prints as ``number`` does, also inside a list or dict."""

    def __repr__(self) -> str:
        return number(self)

    __str__ = __repr__


def readable(value: Any) -> Any:
    """``value`` with every float, also inside lists and dicts, a ``Readable``."""
    if isinstance(value, float):
        return Readable(value)
    if isinstance(value, dict):
        return {key: readable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [readable(item) for item in value]
    return value
