"""Holding glibc's allocator steady while timing CPU training steps.

By default glibc hands blocks of 128 KiB and more back to the kernel when they are freed
(``mmap``/``munmap``, and trimming the top of the heap), so the next step's activations
page-fault in again: on the project's CPU several thousand minor faults a step, a number
that moves by thousands between two runs of the same code with the allocation order (a
recorder's few small tensors change it, either way: measured 0 to 6,000 faults a step on
the 6+6 reference, ±5 ms of a 205 ms step). That noise is the allocator's, not the work's.
``steady()`` makes glibc keep freed memory (``mallopt``: blocks up to 32 MiB from the heap,
no trimming below 2 GiB, 256 MiB top pad), so after warm-up neither side of a timed pair
faults; PyTorch's CPU tuning guides get the same effect from jemalloc or tcmalloc.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3


def steady() -> str:
    """Asks glibc to keep freed memory; returns a line saying what was done.

    Returns:
        ``"glibc, steady (...)"`` when every ``mallopt`` call succeeded, else why not (not
        glibc, or a call refused), in which case the allocator is left as it was.
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return f"default (no glibc mallopt in {name!r})"
    settings = ((M_MMAP_THRESHOLD, 32 << 20), (M_TRIM_THRESHOLD, (2 << 30) - 1), (M_TOP_PAD, 256 << 20))
    if not all(mallopt(option, value) == 1 for option, value in settings):
        return "default (mallopt refused a setting)"
    return "glibc, steady (mallopt: mmap threshold 32 MiB, trim threshold 2 GiB, top pad 256 MiB)"
