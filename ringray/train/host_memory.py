"""Give freed tensors' host memory back to the system, so that a rank's resident memory
follows its live tensors and the plan.

glibc's ``malloc`` serves a large request (128 KiB and up, at first) with a mapping of its
own, returned to the system on ``free``. But each such free raises that threshold to the
freed size (up to 32 MiB): from then on tensors below it come from the heap, and the heap
keeps what they freed, fragmented, for the life of the process. A training step allocates
and frees gigabytes of activations, gradients and buffers, so a CPU rank's resident peak
ends up 17-43 % above its live tensors' (and above the plan ``ringray plan`` and the memory
check count on), more still after a checkpoint restore, whose read buffers raise the
threshold early. 8 ranks of a 0.5B-parameter FSDP job needed 24 GB of this 24 GB machine
that way, against 18.7 GB (2343 MiB a rank, the plan + imports: 2321) with the threshold
held at 128 KiB (``benchmarks/RESULTS.md``, issue 25).

:func:`release_freed_memory` holds it at :data:`THRESHOLD_BYTES` (``mallopt(M_MMAP_THRESHOLD)``,
which also stops the adjustment) in the processes that train: ``python -m ringray.train``
and the Ray worker actors. A ``MALLOC_MMAP_THRESHOLD_`` the user set in the environment is
theirs and is left alone, as is any C library that is not glibc. Every fresh page of a
mapped tensor costs a page fault: at 128 KiB the quickstart's steps took 40 % longer, at
4 MiB no longer than with the moving threshold (within 1 %). At 4 MiB the 0.5B job above
ran to the end in 2.6-2.8 GB a rank (12-20 % above the plan + imports; many of its tensors
are 3 MiB); a user who wants the last of it sets ``MALLOC_MMAP_THRESHOLD_=131072``.
"""

from __future__ import annotations

import ctypes
import os

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
THRESHOLD_BYTES = 4 << 20
"""Requests this large or larger get mappings of their own, freed back to the system."""
ENVIRONMENT_VARIABLE = "MALLOC_MMAP_THRESHOLD_"


def release_freed_memory() -> bool:
    """Hold glibc's mmap threshold at :data:`THRESHOLD_BYTES` for the rest of this process;
    ``False`` (nothing done) when the user set :data:`ENVIRONMENT_VARIABLE` or the C library
    is not glibc."""
    if ENVIRONMENT_VARIABLE in os.environ:
        return False
    # The process's own symbols (libc's among them): no library search, which on Linux
    # would start ldconfig in a subprocess.
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return False
    mallopt = libc.mallopt
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, THRESHOLD_BYTES) == 1
