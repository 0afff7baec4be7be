"""What a lone load asks of the page cache before its first read: the thread count's probe.

    .venv/bin/python bench/thread_probe.py FILE.pt [--runs 20]
    PYTHONPATH=DIR .venv/bin/python bench/thread_probe.py FILE.pt   # the package in DIR (git archive)

``FILE.pt`` is a metaseq singleton, e.g. ``bench/single_load.py --keep DIR``'s
``DIR/synth-2.pt``. The file is read first (warm), its tensors are cut into the pieces a
lone ``load_state_dict`` reads (``RangeReader._ordered_pieces``), and
``RangeReader._threads_for`` (how many threads read them, from what the cache holds) is timed
``--runs`` times in this process: the median and the best, in milliseconds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from metaseq_oneload._reading import RangeReader, read_header, storage_byte_offset
from metaseq_oneload._settings import Settings


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", help="a metaseq singleton (.pt)")
    ap.add_argument("--runs", type=int, default=20)
    args = ap.parse_args(argv)
    with open(args.path, "rb") as f:
        while f.read(64 << 20):
            pass
    runs, seen = [], set()
    for t in read_header(args.path)["model"].values():
        off = storage_byte_offset(t)
        if off not in seen:
            seen.add(off)
            runs.append((args.path, off, torch.empty(t.numel(), dtype=t.dtype)))
    with RangeReader(alone=True, settings=Settings(o_direct=None)) as reader:
        jobs = reader._ordered_pieces(runs)
        times = []
        for _ in range(args.runs):
            t0 = time.perf_counter()
            threads = reader._threads_for(jobs)
            times.append(time.perf_counter() - t0)
    print(f"{len(jobs)} pieces, {threads} threads chosen, median {statistics.median(times) * 1e3:.2f} ms, "
          f"best {min(times) * 1e3:.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
