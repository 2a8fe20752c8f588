"""The code is clean under ruff (pyproject.toml's ``[tool.ruff]``): ``ruff check`` (pycodestyle,
pyflakes, warnings, import order) and ``ruff format --check`` on every Python folder. Before
committing, ``ruff format`` and ``ruff check --fix`` do most of the work."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PATHS = ("raytrain_mp", "tests", "scripts", "jobs")

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("ruff") is None,
    reason="ruff is not installed (it is in the test extra: pip install -e '.[test]')",
)


@pytest.mark.parametrize(
    "command",
    [["check", "--no-cache"], ["format", "--check", "--no-cache"]],
    ids=["check", "format"],
)
def test_ruff_is_clean(command):
    done = subprocess.run(
        [sys.executable, "-m", "ruff", *command, *PATHS], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"ruff {' '.join(command)} failed:\n{done.stdout}{done.stderr}"
