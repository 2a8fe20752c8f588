"""Where a test run's CPU goes: each process's CPU seconds, attributed to the test that started it.

    python scripts/suite_cpu.py poll cpu.json &   # samples /proc until SIGTERM or SIGINT
    SUITE_CPU_SPANS=spans PYTHONPATH=scripts PYTEST_ADDOPTS="-p suite_cpu" pytest
    kill %1; python scripts/suite_cpu.py report cpu.json spans

``poll`` reads every process's own CPU time (utime + stime) twice a second and keeps, per process,
its parent, when it was first seen, its CPU at the last sighting (less what it had used before
polling began) and its latest title (Ray's workers retitle themselves ``ray::Class.method``).
As a pytest plugin (``-p suite_cpu`` with ``SUITE_CPU_SPANS`` set) this module writes each test's
start and end, per pytest process, into that folder (``read_spans`` reads them back). ``report``
charges each process to the test its pytest worker ran when the process first appeared
(following parents up to that worker), and prints CPU seconds by process kind, by test file and
by test.

Why not psutil or ``resource`` around each test: Ray's daemons are reparented to PID 1 and the
raylet does not reap its workers into anyone's child times, so a test's own accounting misses most
of a fit. Sampling /proc sees every process, the kernel's threads and the sandbox's included.

Invariants: measurement only, never a test's outcome; the CPU a process spends after its last
sighting (under 0.5 s) is missed, and processes seen once at 0 s are kept (they count as started).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

TICK = os.sysconf("SC_CLK_TCK")
RETITLED = ("", "ray::IDLE")  # titles a process may still change: Ray's worker before it takes work
RAY_WORKER = ("setup_worker.py", "default_worker.py")
KINDS = ("gcs_server", "raylet", "dashboard/agent", "dashboard.py", "log_monitor", "monitor.py",
         "runtime_env/agent", "raytrain-mp", "torch.distributed.run", "minio", "mlflow", "pytest")  # fmt: skip


def read_title(pid: str) -> str:
    """The command line, or ``[comm]`` for a kernel thread (which has none)."""
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        title = f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:200]
    if title:
        return title
    with open(f"/proc/{pid}/comm") as f:
        return f"[{f.read().strip()}]"


def sample(seen: dict[str, list[Any]], now: float, first_pass: bool = False) -> None:
    """One pass over /proc: ``seen[pid:starttime] = [pid, ppid, first seen, cpu seconds, title,
    cpu before polling]``; a process alive at the first pass counts its CPU from then on."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            key = f"{pid}:{fields[19]}"
            total = (int(fields[11]) + int(fields[12])) / TICK
            row = seen.get(key)
            if row is None:
                before = total if first_pass else 0.0
                seen[key] = [int(pid), int(fields[1]), now, total - before, read_title(pid), before]
            else:
                row[3] = max(row[3], total - row[5])
                if row[4] in RETITLED or any(name in row[4] for name in RAY_WORKER):
                    row[4] = read_title(pid)
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue


def poll(out: str, interval: float = 0.5) -> None:
    """Sample until SIGTERM or SIGINT, then write the rows to ``out``."""
    seen: dict[str, list[Any]] = {}
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(True))
    first_pass = True
    while not stop:
        started = time.time()
        sample(seen, started, first_pass)
        first_pass = False
        time.sleep(max(0.05, interval - (time.time() - started)))
    Path(out).write_text(json.dumps([row[:5] for row in seen.values()]))


def kind(title: str) -> str:
    if title.startswith(("ray::", "[")):
        return title.split()[0].split(".")[0]
    if any(name in title for name in RAY_WORKER):
        return "ray worker, untitled"
    return next((name for name in KINDS if name in title), title[:60])


def attribute(rows: list[list[Any]], spans: dict[int, list[list[Any]]]) -> list[tuple[str, str, float]]:
    """(test, kind, cpu seconds) per process. ``spans``: per pytest process, its tests' [nodeid,
    start, end]. A process belongs to the pytest process among its ancestors, and to the test that
    ran there when it was first seen; "(outside the tests)" when no ancestor ran tests (the
    kernel, the sandbox, daemons whose parents exited before they were seen), "(pytest itself)" for
    a pytest process, "(between tests)" when its pytest process ran none at the time."""
    parent = {row[0]: row[1] for row in rows}
    charged = []
    for pid, _, first, cpu, title in rows:
        owner, hops = pid, 0
        while owner not in spans and owner in parent and hops < 64:
            owner, hops = parent[owner], hops + 1
        if owner not in spans:
            test = "(outside the tests)"
        elif owner == pid:
            test = "(pytest itself)"
        else:
            running = [node for node, start, end in spans[owner] if start <= first <= end + 1]
            test = running[-1] if running else "(between tests)"
        charged.append((test, kind(title), cpu))
    return charged


def read_spans(folder: str | Path) -> dict[int, list[list[Any]]]:
    """Per pytest process, its tests' [nodeid, start, end], as the plugin wrote them into ``folder``."""
    return {int(f.stem.split("-")[1]): json.loads(f.read_text()) for f in Path(folder).glob("spans-*.json")}


def report(poll_json: str, spans_dir: str, top: int = 40) -> None:
    rows = json.loads(Path(poll_json).read_text())
    charged = attribute(rows, read_spans(spans_dir))
    by_kind, count = Counter(), Counter()
    by_file, by_test = Counter(), Counter()
    kinds_of_file: dict[str, Counter] = defaultdict(Counter)
    for test, what, cpu in charged:
        test_file = test.split("::")[0]
        by_kind[what] += cpu
        count[what] += 1
        by_test[test] += cpu
        by_file[test_file] += cpu
        kinds_of_file[test_file][what] += cpu
    print(f"{sum(by_kind.values()):.0f} CPU seconds in {len(rows)} processes")
    print("\nby kind (seconds, processes):")
    for what, cpu in by_kind.most_common(top):
        print(f"{cpu:8.0f} {count[what]:5d}  {what}")
    print("\nby test file (seconds; its three costliest kinds):")
    for name, cpu in by_file.most_common(top):
        print(f"{cpu:8.0f}  {name}  " + ", ".join(f"{k} {v:.0f}" for k, v in kinds_of_file[name].most_common(3)))
    print("\nby test (seconds):")
    for name, cpu in by_test.most_common(top):
        print(f"{cpu:8.0f}  {name}")


# The pytest plugin (``-p suite_cpu``): each test's span, per pytest process, when SUITE_CPU_SPANS is set.
_spans: list[list[Any]] = []
_started: dict[str, float] = {}


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    _started[nodeid] = time.time()  # before the test's setup, where its module's fixtures start


def pytest_runtest_logfinish(nodeid: str, location: Any) -> None:
    if nodeid in _started:
        _spans.append([nodeid, _started.pop(nodeid), time.time()])


def pytest_sessionfinish(session: Any) -> None:
    folder = os.environ.get("SUITE_CPU_SPANS")
    if folder and _spans:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / f"spans-{os.getpid()}.json").write_text(json.dumps(_spans))


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "poll":
        poll(argv[1])
    elif len(argv) == 3 and argv[0] == "report":
        report(argv[1], argv[2])
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
