"""What a load's fresh memory costs this machine before any byte is read.

    .venv/bin/python bench/fresh_memory.py [--gib 1] [--rounds 3] [--json]

Every load that returns fresh tensors has the kernel map a page for each 4 KiB of them; the
read limit of ``bench/single_load.py`` and ``bench/read_bandwidth.py`` pays the same. This
times that part alone, in a fresh process per run (as each load there is): a private
anonymous mapping of ``--gib`` GiB whose pages the kernel maps in one call
(``MADV_POPULATE_WRITE``), unmapped, then the same again three times in that process
("again": pages the process itself just freed), with 4 KiB pages and with transparent huge
pages asked for (``MADV_HUGEPAGE``; ``thp`` counts the 2 MiB pages the kernel gave,
``thp_fault_alloc`` of /proc/vmstat).

On a VM whose host takes free memory back (virtio-balloon free page reporting), the first
touch of a page the host took waits on the host: "first" then holds the host's cost and
"again" the guest's own. Rounds alternate the two page sizes; the table gives medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.append(os.path.dirname(HERE))

from bench._report import print_table  # noqa: E402

_HUGE = 2 << 20
_MADV_HUGEPAGE = 14


def _thp_allocated() -> int:
    with open("/proc/vmstat") as f:
        for line in f:
            if line.startswith("thp_fault_alloc "):
                return int(line.split()[1])
    return 0


def _child(nbytes: int, huge: bool) -> dict:
    """(in a fresh process) Four populate calls of ``nbytes``, each on a new mapping."""
    import ctypes

    from metaseq_oneload._pagecache import _LIBC, _MADV_POPULATE_WRITE, advise  # (its libc, mmap typed)

    seconds, thp = [], _thp_allocated()
    for _ in range(4):
        base = _LIBC.mmap(None, nbytes + _HUGE, 3, 0x22, -1, 0)  # PROT_READ|WRITE, MAP_PRIVATE|ANONYMOUS
        if base in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap refused")
        at = -(-base // _HUGE) * _HUGE  # 2 MiB aligned: every huge page asked for can be one
        try:
            if huge:
                advise(at, nbytes, _MADV_HUGEPAGE)
            t0 = time.perf_counter()
            if not advise(at, nbytes, _MADV_POPULATE_WRITE):
                raise OSError(ctypes.get_errno(), "MADV_POPULATE_WRITE refused (kernel before 5.14?)")
            seconds.append(time.perf_counter() - t0)
        finally:
            _LIBC.munmap(base, nbytes + _HUGE)
    return {"first": seconds[0], "again": statistics.median(seconds[1:]), "thp": _thp_allocated() - thp}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="memory per mapping, GiB")
    ap.add_argument("--rounds", type=int, default=3, help="fresh processes per page size")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(_child(int(args.child[0]), args.child[1] == "huge")))
        return 0
    nbytes = int(args.gib * (1 << 30)) // _HUGE * _HUGE
    runs: dict = {"4k": [], "huge": []}
    for rnd in range(args.rounds):
        for kind in runs:
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", str(nbytes), kind],
                                 capture_output=True, text=True)
            if out.returncode:
                print(out.stderr[-2000:], file=sys.stderr)
                return 1
            r = json.loads(out.stdout.strip().splitlines()[-1])
            runs[kind].append(r)
            print(f"  round {rnd + 1}, {kind}: first {r['first']:.3f} s, again {r['again']:.3f} s", file=sys.stderr)
    rows = [{"pages": "4 KiB" if kind == "4k" else "2 MiB asked (MADV_HUGEPAGE)",
             "first_s": round(statistics.median(r["first"] for r in rs), 3),
             "first_range_s": [round(min(r["first"] for r in rs), 3), round(max(r["first"] for r in rs), 3)],
             "again_s": round(statistics.median(r["again"] for r in rs), 3),
             "thp_pages": max(r["thp"] for r in rs)} for kind, rs in runs.items()]
    if args.json:
        print(json.dumps({"gib": nbytes / 2**30, "rounds": args.rounds, "rows": rows}, indent=2))
        return 0
    print(f"{nbytes / 2**30:g} GiB populated (MADV_POPULATE_WRITE) in a fresh process, medians of {args.rounds}; "
          "'first': the process's first mapping, 'again': the next three, after it freed the one before")
    print_table(["pages", "first s", "first, range s", "again s", "2 MiB pages given (of 4 mappings)"],
                [[r["pages"], f"{r['first_s']:.3f}", f"{r['first_range_s'][0]:.3f}-{r['first_range_s'][1]:.3f}",
                  f"{r['again_s']:.3f}", str(r["thp_pages"])] for r in rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
