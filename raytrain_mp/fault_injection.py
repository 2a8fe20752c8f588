"""The ``--inject-fault`` testing hook of both training loops: which worker or stage actor fails, when, once.

Invariants: a spec fails its target once per run, also across restarts (the MARKER file it writes
says it did); a malformed spec is one ``UsageError`` line naming ``--inject-fault`` and its forms,
raised when the options are validated. Hidden from ``--help`` and from saved configs.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from raytrain_mp.errors import UsageError


@dataclasses.dataclass(frozen=True)
class FaultSpec:
    """``--inject-fault INDEX:WHEN:MARKER``, a testing hook: worker or stage actor INDEX fails once
    at WHEN, ``E`` after epoch E or ``sS`` after global step S; the file MARKER says it did (and
    that it is not to fail again, also after a restart)."""

    index: int
    when: str
    marker: str

    @classmethod
    def parse(cls, spec: str | None, at_steps: bool = True) -> FaultSpec | None:
        """The spec of ``--inject-fault`` (None: none); a malformed one is a UsageError naming the
        accepted forms (``sS`` only where the loop ``at_steps`` can fail after a step)."""
        if spec is None:
            return None
        parts = spec.split(":", 2)
        at_step = at_steps and len(parts) == 3 and parts[1][:1] == "s" and parts[1][1:].isdigit()
        accepted = "INDEX:EPOCH:MARKER" + (" or INDEX:sSTEP:MARKER" if at_steps else "")
        if not (len(parts) == 3 and parts[0].isdigit() and (parts[1].isdigit() or at_step)):
            raise UsageError(f"--inject-fault: accepted: {accepted}")
        return cls(int(parts[0]), parts[1], parts[2])

    def due(self, at: str) -> bool:
        """Whether it fails at ``at`` (a WHEN: the loops ask after each epoch and step): once, until MARKER exists."""
        return self.when == at and not Path(self.marker).exists()

    def mark(self, what: str) -> str:
        """Write MARKER: ``what`` happened ``after epoch E`` (or ``after step S``), which it returns."""
        point = f"after epoch {self.when}" if self.when.isdigit() else f"after step {self.when[1:]}"
        Path(self.marker).write_text(f"{what} {point}\n")
        return point
