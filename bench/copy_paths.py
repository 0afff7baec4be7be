"""Ways to land a cached file's bytes in fresh memory, side by side in one process, round by round.

    .venv/bin/python bench/copy_paths.py FILE [--rounds 15] [--threads 2] [--piece-mib 16] [--json]

#26 asked whether a copy out of a mapping of the file (what safetensors' ``load_file`` then a
copy does) lands cached bytes faster than ``preadv``. Timed between processes, the rows of
``bench/single_load.py`` spread by 20-40% from one round to the next on the VM this was
measured on, more than the paths differ; here every path runs in one process, on one file
held by the page cache (dropped, then read whole first: in the folios a sequential read
builds, up to 2 MiB, which a mapping faults in one at a time; the table says what they were),
``--rounds`` times in a shuffled order each round, each into a fresh
anonymous mapping of the file's size (unmapped after), on a pool of ``--threads`` threads
taking ``--piece-mib`` MiB pieces (the engine's reader's pieces):

* ``preadv, pages mapped first``: each piece's pages mapped in one call first
  (``MADV_POPULATE_WRITE``, ``metaseq_oneload._pagecache.prefault``), then ``preadv``: the
  engine's reader on a cached piece, the row the others are held against;
* ``preadv``: the read limit of ``bench/single_load.py``, ``preadv`` writing into pages the
  kernel maps one fault per 4 KiB as it writes;
* ``copy out of a mapping``: ``memmove`` from a shared read-only mapping of the file, then
  ``MADV_DONTNEED`` over the piece's source (here, not in safetensors: its page-table entries
  dropped, the resident mapping #26 asks to avoid), with and without the source's pages mapped
  in one call first (``MADV_POPULATE_READ``, the faster of the two in docs/performance-history.md's
  sixth stop). A file cut short while this copies kills the process (SIGBUS);
* ``process_vm_readv`` from that mapping, with and without the pages mapped first: the
  same source copied by the kernel, which returns a short count where the file was cut
  short (no signal): the one safe form of a copy out of a mapping a Python loader can take.

Unlike ``bench/single_load.py``, one process for all paths and no priming of its memory: a
round's first fresh mapping may wait on the host (docs/performance.md), on whichever path the
shuffle put first. One round before the timed ones (not counted) starts the threads and maps
the file once on every path.

The table gives each path's median and best time, and round by round its time over the
engine's in the same round (median ratio, the rounds it was faster in, and the two-sided sign
test of that split, ``bench/single_load.py``'s).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.append(os.path.dirname(HERE))

from bench._report import folio_line, print_table, recache  # noqa: E402
from bench.single_load import sign_test  # noqa: E402

_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.mmap.restype = ctypes.c_void_p
_LIBC.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_LIBC.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_LIBC.process_vm_readv.restype = ctypes.c_ssize_t
_MAP_FAILED = ctypes.c_void_p(-1).value
_PROT_READ, _PROT_RW = 1, 3
_MAP_SHARED, _MAP_PRIVATE_ANON = 0x01, 0x22
_MADV_DONTNEED = 4
_MADV_POPULATE_READ = 22


class _IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_LIBC.process_vm_readv.argtypes = [ctypes.c_int, ctypes.POINTER(_IOVec), ctypes.c_ulong,
                                   ctypes.POINTER(_IOVec), ctypes.c_ulong, ctypes.c_ulong]

PATHS = {  # the first is what the others are held against: the engine's reader
    "preadv+pages": "preadv, pages mapped first (the engine)",
    "preadv": "preadv (the limit's)",
    "memmove": "copy out of a mapping",
    "memmove+source": "copy out of a mapping, its pages mapped first",
    "pvm": "process_vm_readv from a mapping",
    "pvm+pages": "process_vm_readv, pages mapped first",
}


def _mmap(size: int, prot: int, flags: int, fd: int) -> int:
    addr = _LIBC.mmap(None, size, prot, flags, fd, 0)
    if addr in (None, _MAP_FAILED):
        raise OSError(ctypes.get_errno(), "mmap")
    return addr


def _land(path: str, fd: int, src: int, size: int, pool, piece: int) -> float:
    """Seconds to land the file's bytes in fresh memory along ``path`` (a key of PATHS)."""
    from metaseq_oneload._pagecache import advise, prefault

    dst = _mmap(size, _PROT_RW, _MAP_PRIVATE_ANON, -1)
    view = memoryview((ctypes.c_char * size).from_address(dst)).cast("B")
    pid = os.getpid()

    def one(off: int) -> None:
        n = min(piece, size - off)
        if path.endswith("+pages"):
            prefault(dst + off, n)
        if path.startswith("preadv"):
            done = 0
            while done < n:
                got = os.preadv(fd, [view[off + done: off + n]], off + done)
                if got <= 0:
                    raise RuntimeError(f"short read at {off + done}")
                done += got
        elif path.startswith("pvm"):
            local, remote = _IOVec(dst + off, n), _IOVec(src + off, n)
            got = _LIBC.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
            if got != n:
                raise OSError(ctypes.get_errno(), f"process_vm_readv: {got} of {n} bytes")
            advise(src + off, n, _MADV_DONTNEED)
        else:
            if path.endswith("+source"):  # the mapping's page-table entries in one call, not a fault per 16 pages
                advise(src + off, n, _MADV_POPULATE_READ)
            ctypes.memmove(dst + off, src + off, n)
            advise(src + off, n, _MADV_DONTNEED)

    t0 = time.perf_counter()
    list(pool.map(one, range(0, size, piece)))
    seconds = time.perf_counter() - t0
    view.release()
    _LIBC.munmap(dst, size)
    return seconds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file", help="a file to land (dropped from the page cache, then read whole into it first)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--piece-mib", type=int, default=16)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    size = os.path.getsize(args.file)
    fd = os.open(args.file, os.O_RDONLY)
    src = _mmap(size, _PROT_READ, _MAP_SHARED, fd)
    recache([args.file])  # warm, in the folios a sequential read builds (a mapping's faults depend on them)
    folios = folio_line([args.file])
    keys = list(PATHS)
    times: dict = {k: [] for k in keys}
    with ThreadPoolExecutor(args.threads) as pool:
        for k in keys:  # the warm-up round, not counted
            _land(k, fd, src, size, pool, args.piece_mib << 20)
        for _ in range(args.rounds):
            order = keys[:]
            random.shuffle(order)
            for k in order:
                times[k].append(_land(k, fd, src, size, pool, args.piece_mib << 20))
    rows = []
    for k in keys:
        ratios = [a / b for a, b in zip(times[k], times[keys[0]])]
        rows.append({"path": PATHS[k], "median_s": round(statistics.median(times[k]), 4),
                     "best_s": round(min(times[k]), 4), "ratio_median": round(statistics.median(ratios), 3),
                     "faster_rounds": sum(r < 1 for r in ratios),
                     "sign_p": round(sign_test(sum(r < 1 for r in ratios), len(ratios)), 4)})
    if args.json:
        print(json.dumps({"file_bytes": size, "rounds": args.rounds, "threads": args.threads, "folios": folios,
                          "rows": rows}, indent=2))
        return 0
    print(f"{size / 2**30:.2f} GiB held by the page cache into fresh memory, {args.threads} threads, "
          f"{args.piece_mib} MiB pieces, {args.rounds} rounds in one process; 'over {PATHS[keys[0]]}': "
          "the path's time over that row's in the same round")
    print(f"page cache (dropped, then read whole): {folios}")
    print_table(["path", "median s", "best s", f"over {PATHS[keys[0]]}, median", "faster in", "sign p"],
                [[r["path"], f"{r['median_s']:.4f}", f"{r['best_s']:.4f}", f"{r['ratio_median']:.3f}"]
                 + (["-", "-"] if r["path"] == PATHS[keys[0]] else
                    [f"{r['faster_rounds']} of {args.rounds}", f"{r['sign_p']:.4f}"]) for r in rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
