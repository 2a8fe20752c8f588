"""Rewrite ``tests/durations.json`` from a full run's JUnit XML: each test file's serial seconds.

    pytest --junitxml=run.xml && python scripts/test_durations.py run.xml

The suite starts its slowest files first (``tests/conftest.py``), so its two workers end together;
only that order depends on these figures, never a test's outcome.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "durations.json"
KEEP_FROM_SECONDS = 20  # files quicker than this go in collection order, after the listed ones


def file_seconds(junit_xml: str) -> Counter:
    seconds: Counter = Counter()
    for case in ET.parse(junit_xml).iter("testcase"):
        # classname is the dotted module path, with a test class's name appended when there is one
        parts = case.get("classname", "").split(".")
        while parts and not Path(*parts).with_suffix(".py").is_file():
            parts.pop()
        if parts:
            seconds[str(Path(*parts).with_suffix(".py"))] += float(case.get("time", 0))
    return seconds


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    seconds = file_seconds(sys.argv[1])
    table = {"_": json.loads(OUT.read_text())["_"]}
    table.update({path: round(s) for path, s in seconds.most_common() if s >= KEEP_FROM_SECONDS})
    OUT.write_text(json.dumps(table, indent=2) + "\n")
    print(f"{OUT}: {len(table) - 1} files, {round(sum(seconds.values()))} s of serial time in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
