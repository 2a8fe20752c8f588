"""How a CPU training process's C allocator treats freed memory: kept, as CUDA's caching allocator
keeps GPU memory, instead of handed back to the OS.

Job: ``keep_freed_memory`` sets glibc's malloc so that memory a training step frees stays in the
process for the next step. By default glibc trims the top of its heap and serves blocks above an
adaptive threshold by ``mmap``, returning them to the OS when freed, so every step pays page
faults again for the same tensors: the gradients (freed by ``zero_grad(set_to_none=True)``) and
the activations. That slows a step, and skews the profile that time balance cuts by (the
figures: docs/performance.md, "freed memory kept").

Why not a library: jemalloc or tcmalloc would do this too, but must be installed and preloaded
(``LD_PRELOAD``) before the process starts, which a Ray worker's runtime environment would have to
arrange on every node; two ``mallopt`` calls in the running process need nothing installed.

Invariants:
- Never raises, and changes nothing where the C library has no ``mallopt`` (not glibc: macOS,
  musl); the result says which.
- The process's resident memory no longer shrinks after a peak; meant for processes that train
  (or profile) until they exit. GPU memory is untouched.
"""

from __future__ import annotations

import ctypes

# glibc's mallopt parameters (malloc.h), and the largest mmap threshold it accepts on 64 bits
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX = -1, -3, 32 * 1024 * 1024


def keep_freed_memory() -> bool:
    """Make this process's glibc malloc keep freed memory: no heap trimming, blocks up to 32 MiB
    from the heap. True where both settings took; False where there is no ``mallopt``."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    return bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1)) and bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX))
