"""Memory: the ranks' fixed glibc mmap threshold (bound_heap_retention) and the peak-memory probes around a
job (_peak_begin resets the kernel's VmHWM, _peak_end reads it; ru_maxrss where the reset is refused)."""

from __future__ import annotations

import ctypes
import gc
import os
import resource

MMAP_THRESHOLD = 1 << 20  # glibc: allocations from 1 MiB on get their own mapping, returned when freed
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (glibc malloc.h)


def bound_heap_retention() -> None:
    """In a rank this module started: a fixed glibc mmap threshold. glibc's default threshold is dynamic:
    freeing a mapped block raises it to that block's size, after which blocks up to that size come from
    the heap, which keeps freed memory resident wherever a live block sits above it. The ring frees and
    allocates arrays of many sizes (the rank's inputs, projections, sub-block temporaries): under the
    dynamic threshold a rank's peak over the call was 1.8-2.3x what it is with a fixed one (T 16384,
    4 ranks, docs/sharding.md); the unsharded call's did not move. Same as
    MALLOC_MMAP_THRESHOLD_=1048576 in the environment, which a torchrun start can set. No-op elsewhere."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    except (OSError, AttributeError):
        pass



def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"/proc/self/status has no {field}")


def _peak_begin() -> tuple[int, str]:
    """Before a job: free what can be freed, reset the kernel's peak-RSS counter (VmHWM, by writing 5 to
    /proc/self/clear_refs) and return (resident bytes now, the method _peak_end reads). Where the kernel
    refuses the reset, the process's lifetime peak (ru_maxrss) stands in: it can only overstate the job's."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # glibc: hand freed heap pages back, so `before` is what is in use
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status_bytes("VmRSS"), "VmHWM"
    except OSError:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"), "ru_maxrss"


def _peak_end(method: str) -> int:
    if method == "VmHWM":
        return _status_bytes("VmHWM")
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

