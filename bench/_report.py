"""What every benchmark reads from /proc and how it prints its table."""

from __future__ import annotations

import os
from typing import Sequence

__all__ = ["proc_status", "proc_io", "print_table", "drop_cache", "recache", "folio_mix", "folio_line"]


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


def recache(paths) -> None:
    """Out of the page cache, then read whole in file order (``cat``): each file held in the
    folios the kernel's read-ahead builds for a sequential read (up to 2 MiB on ext4 and XFS),
    whoever read it before. A file's cached folios are its last cold reader's: a mapped copy
    left a .pt mostly in 4-16 KiB folios here, which ``preadv`` copied out 1.2-1.3x slower than
    2 MiB ones (``bench/cache_folios.py``), so a warm row on one file against one on another
    compared their histories, not their loaders."""
    import subprocess

    drop_cache(paths)
    for p in paths:
        with open(os.devnull, "wb") as null:
            subprocess.run(["cat", p], stdout=null, check=True)


def folio_mix(path: str):
    """{folio size in bytes: share of the file's pages held in folios of that size; 0: the
    share not cached}, from the page cache as it is (``mincore``, then ``/proc/self/pagemap`` and
    ``/proc/kpageflags`` for the cached pages only: touching an uncached page would read it);
    None where those cannot be read (not root, not Linux). A folio cut by the file's end
    counts at the size seen."""
    import collections
    import ctypes
    import mmap
    import struct

    from metaseq_oneload._pagecache import _LIBC as libc, _MAP_FAILED  # the engine's own mincore binding

    tail = 1 << 16  # KPF_COMPOUND_TAIL: a page inside a folio, not its first
    if libc is None:
        return None
    try:
        page, n = mmap.PAGESIZE, os.path.getsize(path)
        if n == 0:
            return {}
        pages = -(-n // page)
        with open(path, "rb") as f, open("/proc/self/pagemap", "rb") as pm, open("/proc/kpageflags", "rb") as kf:
            addr = libc.mmap(None, n, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
            if addr in (None, _MAP_FAILED):
                return None
            try:
                vec = ctypes.create_string_buffer(pages)
                if libc.mincore(addr, n, vec) != 0:
                    return None
                resident = [b & 1 for b in vec.raw[:pages]]
                for i in range(pages):
                    if resident[i]:
                        ctypes.string_at(addr + i * page, 1)  # mapped, not read: pagemap tells mapped pages only
                pm.seek(addr // page * 8)
                entries = struct.unpack(f"{pages}Q", pm.read(pages * 8))
                sizes, run = collections.Counter(), 0
                for i, e in enumerate(entries):
                    pfn = e & ((1 << 55) - 1)
                    if resident[i] and e >> 63 and pfn == 0:  # PFNs hidden (not root)
                        return None
                    if not resident[i] or not e >> 63:
                        flags = None
                    else:
                        kf.seek(pfn * 8)
                        flags = struct.unpack("Q", kf.read(8))[0]
                    if flags is not None and flags & tail and run:
                        run += 1
                        continue
                    if run:
                        sizes[run] += 1
                    run = 0 if flags is None else 1
                if run:
                    sizes[run] += 1
            finally:
                libc.munmap(addr, n)
    except (OSError, ValueError):
        return None
    mix = {k * page: k * v / pages for k, v in sorted(sizes.items())}
    missing = pages - sum(resident)
    return {**mix, 0: missing / pages} if missing else mix


def folio_line(paths) -> str:
    """One line: each file's pages by the size of the folio holding them (``folio_mix``; shares
    under 1% left out), or 'not known'."""
    def one(p):
        mix = folio_mix(p)
        if mix is None:
            return f"{os.path.basename(p)}: not known (needs root)"
        return f"{os.path.basename(p)}: " + ", ".join(
            (f"{share:.0%} in {size // 1024} KiB folios" if size else f"{share:.0%} not cached")
            for size, share in sorted(mix.items(), reverse=True) if share >= 0.01) or "empty"
    return "; ".join(one(p) for p in paths)


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
