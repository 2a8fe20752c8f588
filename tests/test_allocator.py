"""``allocator.keep_freed_memory``: a block the process frees stays resident for the next step,
where glibc's default hands it back to the OS. Each case runs in a child process, so that
pytest's own allocator is never changed."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = """
import sys, torch
from raytrain_mp.allocator import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
def resident_mib():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
before = resident_mib()
x = torch.ones(16 * 2**20 // 4)  # 16 MiB, every page touched
held = resident_mib() - before
del x
print(kept, round(held), round(resident_mib() - before))
"""


def probe(mode: str) -> list[str]:
    return subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True
    ).stdout.split()


@pytest.mark.skipif(not Path("/proc/self/statm").exists() or platform.libc_ver()[0] != "glibc", reason="glibc on Linux")
def test_a_freed_block_stays_resident() -> None:
    kept, held, after = probe("keep")
    assert kept == "True" and int(held) >= 15 and int(after) >= 15
    kept, held, after = probe("default")
    assert kept == "None" and int(held) >= 15 and int(after) <= 2  # glibc gives a freed 16 MiB block back
