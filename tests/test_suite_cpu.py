"""``scripts/suite_cpu.py``: a test run's processes charged to the tests that started them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))

from suite_cpu import attribute, kind, read_spans, sample  # noqa: E402


def test_a_process_is_charged_to_the_test_its_pytest_process_ran_when_it_appeared():
    spans = {100: [["a.py::one", 10.0, 20.0], ["a.py::two", 21.0, 30.0]]}
    rows = [  # pid, ppid, first seen, cpu, title
        [100, 1, 5.0, 40.0, "python -m pytest"],
        [200, 100, 12.0, 1.0, "bash -c raytrain-mp ddp"],
        [300, 200, 13.0, 2.0, "/ray/core/src/ray/raylet/raylet --raylet_socket_name=x"],
        [400, 300, 25.0, 5.0, "ray::RayTrainWorker.train_fn"],  # a worker of one's Ray, started during two
        [500, 100, 20.5, 3.0, "python -c pass"],  # within a second of one's end: its teardown's
        [600, 100, 40.0, 4.0, "python -c pass"],
        [108, 2, 0.0, 80.0, "[kdamond.0]"],
        [700, 999, 15.0, 6.0, "/ray/_private/log_monitor.py"],  # its parent was never seen
    ]
    assert attribute(rows, spans) == [
        ("(pytest itself)", "pytest", 40.0),
        ("a.py::one", "raytrain-mp", 1.0),
        ("a.py::one", "raylet", 2.0),
        ("a.py::two", "ray::RayTrainWorker", 5.0),
        ("a.py::one", "python -c pass", 3.0),
        ("(between tests)", "python -c pass", 4.0),
        ("(outside the tests)", "[kdamond", 80.0),
        ("(outside the tests)", "log_monitor", 6.0),
    ]
    assert kind("/python3.11 /ray/_private/workers/setup_worker.py --worker") == "ray worker, untitled"


def test_a_process_alive_when_polling_starts_counts_its_cpu_from_then_on():
    def spin(until: float) -> None:
        while time.process_time() < until:
            pass

    spin(1.0)
    seen: dict = {}
    sample(seen, 0.0, first_pass=True)
    (mine,) = [row for row in seen.values() if row[0] == os.getpid()]
    assert mine[3] < 0.5
    spin(time.process_time() + 0.6)
    sample(seen, 1.0)
    assert 0.5 <= mine[3] < 1.5 and mine[2] == 0.0


def test_poll_and_the_plugin_charge_a_tests_child_to_that_test(tmp_path):
    (tmp_path / "test_busy.py").write_text(
        "import subprocess, sys\n"
        "def test_idle():\n    pass\n"
        "def test_busy():\n"
        "    subprocess.run([sys.executable, '-c', 'import time\\nt = time.process_time()\\n"
        "while time.process_time() - t < 1.5: pass'], check=True)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}  # not the outer run's junit file
    env.update(PYTHONPATH=str(SCRIPTS), SUITE_CPU_SPANS=str(tmp_path / "spans"))
    poller = subprocess.Popen([sys.executable, SCRIPTS / "suite_cpu.py", "poll", tmp_path / "cpu.json"])
    try:
        time.sleep(1)  # its first pass
        subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "suite_cpu", "-n", "0", "-p", "no:cacheprovider", "-q"],
            cwd=tmp_path,
            env=env,
            check=True,
            capture_output=True,
        )
        time.sleep(1)
    finally:
        poller.send_signal(signal.SIGTERM)
        assert poller.wait(timeout=30) == 0
    spans = read_spans(tmp_path / "spans")
    ((_, tests),) = spans.items()
    assert [node for node, _, _ in tests] == ["test_busy.py::test_idle", "test_busy.py::test_busy"]
    charged = attribute(json.loads((tmp_path / "cpu.json").read_text()), spans)
    busy = sum(cpu for test, _, cpu in charged if test == "test_busy.py::test_busy")
    assert 1.0 <= busy <= 3.0, charged  # its child's 1.5 s, less what it spent after the last sample
    assert not [row for row in charged if row[0] == "test_busy.py::test_idle"]
