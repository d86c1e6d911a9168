"""Keep large message buffers in the heap instead of a fresh ``mmap`` for each (glibc).

Why: a group of 8 × 8k tokens is 0.85 MB, above glibc's mmap threshold (128 KiB at start;
glibc raises it only when such a chunk is freed, which with ZMQ's zero-copy frames and many
buffers alive at once does not settle). Every such buffer (a packed group, a received ZMQ
message, a Redis reply) was then a fresh ``mmap``: a page fault for each of its ~200 pages
on first touch, an ``munmap`` when freed. On the buffer benchmark's 8×8k row this cut the
producer's CPU per group from about 700 to 400 µs and raised throughput by 45-70 %.

Process-wide, so a role calls it once at its start (:mod:`asyncrl.launch.roles`); a library
never does it behind its caller's back. The cost: up to :data:`TRIM_THRESHOLD` of freed memory
stays mapped in the process instead of going back to the system.
"""

from __future__ import annotations

import ctypes
import logging

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's own cap for its dynamic threshold on 64-bit
TRIM_THRESHOLD = 128 << 20


def keep_large_buffers() -> bool:
    """Allocations under :data:`MMAP_THRESHOLD` come from the heap, and up to
    :data:`TRIM_THRESHOLD` freed at its top stays there. False where there is no glibc
    ``mallopt`` (musl, macOS): nothing changes."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    done = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and \
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not done:
        logger.info("mallopt refused the buffer thresholds; large buffers stay mmap'd")
    return done
