"""How the C heap serves a separation's tensors, where the C library is glibc.

Every segment a model separates allocates and frees the same few hundred megabytes of
tensors, many of them megabytes large. glibc hands an allocation above its mmap threshold
(128 kB at first, raised as blocks are freed, never above 32 MB) fresh pages from the kernel
and returns them on free, and gives the top of its heap back whenever a little of it is
free: so each segment faults the same memory in again, page by page, each page zeroed by
the kernel. A full-size model faulted 1.3–1.5 million pages per minute of song that way.
With the threshold at its ceiling, the heap grown 256 MB at a time and nothing given back
on free, a song faults 0.24–0.29 million (mostly its first segment's; tensors above 32 MB
are still mapped afresh), and the separation ran 5–8 % faster (docs/benchmarks.md). What the
heap keeps is given back once the song is done (`give_back`), so an idle worker holds no
more than before (985 MB after a song of the full-size model, 1.6 GB without it).

Elsewhere (macOS, Windows, musl) both are no-ops: those allocators keep freed memory their
own way.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import platform
import sys

log = logging.getLogger(__name__)

# mallopt's parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 * 1024 * 1024  # glibc's ceiling on 64-bit machines
TOP_PAD = 256 * 1024 * 1024  # without it, most of the faults stayed
TRIM_THRESHOLD = 2**31 - 1  # the largest mallopt takes: no trim on free, give_back trims


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def hold_for_separation() -> bool:
    """Have the heap keep what a segment frees for the next one (see the module's doc);
    False where the C library is not glibc or refused."""
    libc = _glibc()
    if libc is None:
        return False
    held = bool(
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)
        and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
        and libc.mallopt(M_TOP_PAD, TOP_PAD)
    )
    if not held:
        log.info("the C heap kept its own settings (mallopt refused)")
    return held


def give_back() -> None:
    """Return the heap's free pages to the system: after a song, and after a failed attempt
    (whose tensors the next one needs the room of)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
