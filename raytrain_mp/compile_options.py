"""The options of compiled execution (``--compile``, ``--compile-mode``, ``--compile-cache``), shared
by the ``ddp``, ``pipeline``, ``tune``, ``eval`` and ``predict`` configs; what they do is
``compilation``'s.

Job: the fields and their checks, as a dataclass mixin a command's config inherits. Invariants:
pure (no torch, Ray or pyarrow import: the command line builds its parser from these); a mode that
does not exist, or a mode or cache without ``--compile``, is one line before anything starts.
Whether this machine can compile at all is ``compilation.check_compiler``'s probe on the driver,
also before any worker starts.
"""

from __future__ import annotations

import dataclasses

from raytrain_mp.config import check, check_choice, option

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")  # torch.compile's modes
DEFAULT_CACHE = "~/.cache/raytrain_mp/torch-compile"


@dataclasses.dataclass
class CompileOptions:
    """How the model runs: eager (the default) or compiled by ``torch.compile`` (inductor)."""

    compile: bool = option(
        False,
        "torch.compile the model (inductor): faster steps where fused element-wise work weighs (GPUs, small kernels), "
        "slower where it does not (ResNet-18 on 2 CPU workers: 0.95x eager at 32x32, 0.84x at 8x8; the run notes "
        "it); the first step pays the compile (ResNet-18 on a CPU: about a minute cold, seconds from --compile-cache "
        "on a restart, a resize, a rerun or a later trial)",
        group="model",
    )
    compile_mode: str = option(
        "default",
        "--compile: torch.compile's mode (reduce-overhead adds CUDA graphs on a GPU; max-autotune also times kernels)",
        COMPILE_MODES,
        group="model",
    )
    compile_cache: str | None = option(
        None,
        f"--compile: each node's local folder of compiled graphs, kept across restarts and runs (default: "
        f"TORCHINDUCTOR_CACHE_DIR where a node sets it, else {DEFAULT_CACHE})",
        group="model",
    )

    def validate(self) -> None:
        getattr(super(), "validate", lambda: None)()  # the next base's, where the config has one
        check_choice(self, "compile_mode")
        check(self.compile or self.compile_mode == "default", "compile_mode", "needs --compile")
        check(self.compile or self.compile_cache is None, "compile_cache", "needs --compile")
