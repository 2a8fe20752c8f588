"""The names of the memory formats a stage can compute in (``memory_format`` does the computing).

Job: hold the names apart from torch, so that the command lines' configurations (and their
``--help``, which must load neither torch nor ray) can offer them as choices.
"""

from __future__ import annotations

LAYOUTS = ("channels_last", "contiguous")
MEMORY_FORMATS = ("auto", *LAYOUTS)  # what a trainer accepts: a layout, or measure per stage
