"""The names of the placement strategies a pipeline's stage actors can be placed under (``placement``
does the placing); the memory formats a stage computes in are the shared ``config.MEMORY_FORMATS``.

Job: hold the names apart from torch and Ray, so that the command lines' configurations (and their
``--help``, which must load neither) can offer them as choices.
"""

from __future__ import annotations

PLACEMENT_STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")  # Ray's placement group strategies
