"""Helpers shared by tests: run the CLI in-process and capture its exit code and output."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from raytrain_mp.cli import main


@dataclass
class CliResult:
    code: int
    out: str
    err: str

    @property
    def last_json(self) -> dict:
        return json.loads(self.out.strip().splitlines()[-1])


def run_cli(capsys, *argv: str) -> CliResult:
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse's own errors exit
        code = exc.code
    captured = capsys.readouterr()
    return CliResult(code, captured.out, captured.err)


# Ray forwards its actors' logs to the driver's stderr, prefixed "(ActorName pid=N)", possibly in
# colour: e.g. Ray Train's placement-group cleaners from earlier fits in the session, which warn
# every second when the session runs without a dashboard. They are Ray's lines, not the command's.
RAY_FORWARDED = re.compile(r"^(\x1b\[[0-9;]*m)?\(\w+ pid=\d+")


def assert_usage_error(result: CliResult, *fragments: str) -> None:
    """Exit code 2 and a single ``error:`` line on stderr (besides Ray's forwarded logs and the
    tool's ``note:`` lines) holding every fragment."""
    assert result.code == 2, result
    lines = [
        line for line in result.err.strip().splitlines()
        if line.strip() and not RAY_FORWARDED.match(line) and not line.startswith("note: ")  # e.g. a device choice
    ]  # fmt: skip
    assert len(lines) == 1, lines
    assert "error:" in lines[0]
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def run_cli_json(*argv: str) -> dict:
    """Run a command that must succeed with ``--json`` and return its JSON result.

    Ray's log forwarding shares stdout, so the result is the last line that parses as a JSON object."""
    import contextlib
    import io

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        code = main([*argv, "--json"])
    assert code == 0, buffer.getvalue()[-3000:]
    for line in reversed(buffer.getvalue().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise AssertionError(f"no JSON line in output: {buffer.getvalue()[-2000:]}")
