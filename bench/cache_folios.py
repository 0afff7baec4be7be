"""What a cold file's last reader leaves in the page cache, and what that costs the next warm read.

    .venv/bin/python bench/cache_folios.py FILE [--readers torch.load,torch.load-mmap-copy,preadv2,engine8]
                                                [--reps 7] [--json]

Linux holds a cached file in folios of 4 KiB up to 2 MiB (ext4 from 6.16, XFS), built by the
reads that brought it in: read-ahead of one sequential reader grows them to 2 MiB, where a
mapping's faults or two threads' 16 MiB ``preadv`` pieces at two places in the file build
small ones (measured: docs/performance.md). A warm read copies out of them, and a copy out
of many small folios is slower than out of a few large ones. So a warm load's time depends on
who read the file cold before, not only on the loader: ``bench/single_load.py``'s warm rows
compared a .pt and a .safetensors held in different folios until both were re-read first
(``_report.recache``).

For FILE, each reader in ``--readers`` (a mode of ``bench/read_bandwidth.py``, in a fresh
process, the file dropped from the cache first), then ``sequential`` (``_report.recache``:
dropped, then ``cat``): what share of the file the cache then holds in which folios
(``_report.folio_mix``: ``/proc/kpageflags``, root only), and the page cache's side of a warm
read alone, from that state: ``preadv`` of the file into one buffer whose pages are mapped
already (2 threads, 16 MiB pieces, ``--reps`` times, the median and best in GB/s). A reader
that leaves more than 1% of the file uncached (the engine reads a cold file with
``O_DIRECT``, past the cache) is not timed: the next read of it is a cold one.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.append(os.path.dirname(HERE))

from bench._report import drop_cache, folio_mix, print_table, recache  # noqa: E402
from bench.read_bandwidth import _pread_all_at, run_mode  # noqa: E402

_PIECE = 16 << 20


def _cached_gbps(path: str, view: memoryview, pool, reps: int) -> list:
    """GB/s of ``preadv`` of the whole file into ``view`` (pages already mapped), ``reps``
    times, from the cache as it is: each read leaves the folios it found as they were."""
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            list(pool.map(lambda a: _pread_all_at(fd, view, a, min(size, a + _PIECE)), range(0, size, _PIECE)))
            out.append(size / (time.perf_counter() - t0) / 1e9)
        return out
    finally:
        os.close(fd)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file", help="a torch.save file (the engine's and torch's readers read it)")
    ap.add_argument("--readers", default="torch.load,torch.load-mmap-copy,preadv2,engine8",
                    help="comma-separated modes of bench/read_bandwidth.py, each the cold file's one reader")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.reps < 1:
        ap.error(f"--reps: {args.reps}: at least 1")
    readers = [r.strip() for r in args.readers.split(",") if r.strip()]
    size = os.path.getsize(args.file)
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.write(b"\1" * size)  # its pages mapped: the copy out of the cache alone is timed
    view = memoryview(buf)
    rows = []
    try:
        with ThreadPoolExecutor(2) as pool:
            for reader in readers + ["sequential"]:
                if reader == "sequential":
                    recache([args.file])
                else:
                    drop_cache([args.file])
                    run_mode(reader, args.file, int("".join(filter(str.isdigit, reader)) or 1), {})
                mix = folio_mix(args.file)
                if mix is not None and mix.get(0, 0.0) > 0.01:
                    rows.append({"reader": reader, "folios": mix, "gbps_median": None, "gbps_best": None})
                    continue
                gbps = _cached_gbps(args.file, view, pool, args.reps)
                print(f"  {reader}: {statistics.median(gbps):.2f} GB/s", file=sys.stderr)
                rows.append({"reader": reader, "folios": mix, "gbps_median": round(statistics.median(gbps), 2),
                             "gbps_best": round(max(gbps), 2)})
    finally:
        view.release()
        buf.close()
    if args.json:
        print(json.dumps({"file_bytes": size, "reps": args.reps, "rows": [
            {**r, "folios": None if r["folios"] is None else {str(k): round(v, 4) for k, v in r["folios"].items()}}
            for r in rows]}, indent=2))
        return 0

    def share(mix, lo, hi=None):
        if mix is None:
            return "?"
        return f"{sum(v for k, v in mix.items() if k and k >= lo and (hi is None or k < hi)):.0%}"

    print(f"{os.path.basename(args.file)}, {size / 2**30:.2f} GiB: the cache after one cold reader, and preadv "
          f"out of it into mapped memory (2 threads, 16 MiB pieces, median and best of {args.reps}); "
          "folio shares are of the file's pages ('?': /proc/kpageflags not readable, run as root)")
    print_table(["left by", "not cached", "in 4-60 KiB folios", "in 64 KiB-1 MiB", "in 2 MiB", "GB/s median", "GB/s best"],
                [[r["reader"], "?" if r["folios"] is None else f"{r['folios'].get(0, 0.0):.0%}",
                  share(r["folios"], 1, 64 << 10), share(r["folios"], 64 << 10, 2 << 20),
                  share(r["folios"], 2 << 20)]
                 + (["-", "-"] if r["gbps_median"] is None else [f"{r['gbps_median']:.2f}", f"{r['gbps_best']:.2f}"])
                 for r in rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
