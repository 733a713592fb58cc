"""Keep the C allocator from mapping and unmapping every large message buffer.

An MQTT message of a model (a plan, a report, a chunk of 256 KB) passes through several buffers of its size
in paho and in the codec: the socket reads, the packet being assembled, the payload, the decoded arrays.
glibc's malloc serves blocks above its mmap threshold (128 KB at start, rising to the largest block freed)
with fresh ``mmap`` pages and gives back free memory at the heap's top once it exceeds the trim threshold,
so each such buffer is zero-filled page by page by the kernel and returned again. Measured through two links
on Mosquitto (``benchmarks/message_cost.py``): sending and receiving a 256 KB message cost 0.84 ms of CPU and
197 page faults, and 0.33 ms and 5 with the thresholds below; an 800 KB message 2.6 ms and 654 faults, and
0.71 ms and 12. In a whole round the gain is smaller (docs/operations.md, "Where a round's time goes"): a
long-lived process's own thresholds have risen by then.

:func:`keep_large_buffers` raises both thresholds once per process: blocks up to ``MMAP_THRESHOLD`` come from
the heap and are reused, and up to ``TRIM_THRESHOLD`` of free heap stays mapped. The cost is that memory:
a process keeps up to 32 MB it freed (a device's model is a few MB). It is a no-op off glibc (macOS, musl,
Windows) and when the person set ``MALLOC_MMAP_THRESHOLD_`` or ``MALLOC_TRIM_THRESHOLD_`` (theirs win), or
``FEDGE_MALLOC_TUNE=0``.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform

log = logging.getLogger("fedge.allocator")

MMAP_THRESHOLD = 4 << 20  # blocks below this come from the heap
TRIM_THRESHOLD = 32 << 20  # free memory at the heap's top kept mapped up to this
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
_done: bool | None = None


def keep_large_buffers() -> bool:
    """Raise glibc's mmap and trim thresholds for this process (once); True if they were set."""
    global _done
    if _done is not None:
        return _done
    _done = False
    if (os.environ.get("FEDGE_MALLOC_TUNE", "1") == "0" or "MALLOC_MMAP_THRESHOLD_" in os.environ
            or "MALLOC_TRIM_THRESHOLD_" in os.environ or platform.system() != "Linux"
            or platform.libc_ver()[0] != "glibc"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    _done = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    log.debug("malloc thresholds: mmap %d, trim %d (%s)", MMAP_THRESHOLD, TRIM_THRESHOLD, "set" if _done else "refused")
    return _done
