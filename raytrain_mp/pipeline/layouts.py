"""The names of the memory formats a stage can compute in (``memory_format`` does the computing), and
of the placement strategies its actors can be placed under (``placement`` does the placing).

Job: hold the names apart from torch, so that the command lines' configurations (and their
``--help``, which must load neither torch nor ray) can offer them as choices.
"""

from __future__ import annotations

LAYOUTS = ("channels_last", "contiguous")
MEMORY_FORMATS = ("auto", *LAYOUTS)  # what a trainer accepts: a layout, or measure per stage
PLACEMENT_STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")  # Ray's placement group strategies
