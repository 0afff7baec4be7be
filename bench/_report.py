"""What every benchmark reads from /proc and how it prints its table."""

from __future__ import annotations

import os
from typing import Sequence

__all__ = ["proc_status", "proc_io", "print_table", "drop_cache"]


def drop_cache(paths) -> None:
    """Written back, then out of the page cache (``posix_fadvise(DONTNEED)``): the next
    read of these files (a folder: the files in it) comes from the disk."""
    for p in paths:
        for f in ([os.path.join(p, n) for n in os.listdir(p)] if os.path.isdir(p) else [p]):
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def proc_status(field: str) -> int:
    """A memory field of /proc/self/status (``VmRSS``, ``VmHWM``), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak() -> int:
    """Reset this process's VmHWM to its current RSS (``/proc/self/clear_refs``); returns that RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return proc_status("VmRSS")


def proc_io() -> dict:
    """/proc/self/io: ``rchar``, ``read_bytes``, ... of this process so far."""
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f)}


def print_table(header: Sequence[str], body: Sequence[Sequence]) -> None:
    """Columns padded to their widest cell, a rule under the header."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *body)]
    for i, line in enumerate([list(header)] + [list(b) for b in body]):
        print("  ".join(str(c).ljust(w) for c, w in zip(line, widths)))
        if i == 0:
            print("  ".join("-" * w for w in widths))


def measure_rank(fn) -> dict:
    """(every rank of the default group, collective) Run ``fn()`` between barriers: the peak
    RSS above the RSS just before (freed heap handed back first, the peak reset through
    /proc/self/clear_refs, so the baseline counts only live memory), the /proc/self/io
    deltas, the seconds, and ``fn()``'s ``"report"`` where it returns a dict with one."""
    import ctypes
    import gc
    import time

    import torch.distributed as dist

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    dist.barrier()
    base, io0, t0 = proc_status("VmRSS"), proc_io(), time.perf_counter()
    keep = fn()
    seconds = time.perf_counter() - t0
    io1 = proc_io()
    dist.barrier()
    peak = proc_status("VmHWM")
    report = keep.get("report") if isinstance(keep, dict) else None
    del keep
    return {"extra": peak - base, "seconds": seconds, "rchar": io1["rchar"] - io0["rchar"],
            "read_bytes": io1["read_bytes"] - io0["read_bytes"], "report": report}
