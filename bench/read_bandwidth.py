"""One process's read bandwidth: the engine against the read limit measured in the same run.

    .venv/bin/python bench/read_bandwidth.py [--gib 2] [--repeats 3] [--threads 1,2,4,8] [--no-cold]
                                             [--prefault] [--json]

Writes a synthetic fp32 singleton of about ``--gib`` GiB (metaseq's names, bench/_synth.py)
under /tmp (deleted afterwards unless ``--keep``) and times, each in a fresh process so that
every run pays for fresh pages and re-reads the header:

* ``cat file > /dev/null``: the storage (or page cache) alone, no destination memory;
* ``preadv`` into one freshly allocated buffer of the file's size, one thread (64 MiB calls)
  and a pool of N threads (16 MiB pieces): the same reads and the same page faults the
  engine must pay, nothing else. This is the limit the engine is held to;
* ``metaseq_oneload.load_state_dict(path, no_dist=True)`` with the reader's pool at 1 (the
  serial reader) and N threads, and with ``O_DIRECT`` for the cold runs; it includes finding
  the layout, reading the header and planning (imports happen before the clock starts);
* ``torch.load(mmap=False)`` for reference;
* with ``--prefault``, also ``preadv`` on N threads into fresh memory whose pages each piece
  maps first in one call (``metaseq_oneload._pagecache.prefault``, ``MADV_POPULATE_WRITE``,
  as the engine's reader does): the page faults' share of the limit. Not part of the limit,
  which stays plain ``preadv`` into fresh memory.

Each run first maps, fills and frees as much memory as the file before its clock starts
(``_prime``: the host of this VM takes free memory back, and a page's first touch then waits
on it); ``ONELOAD_BENCH_MEMORY=fresh`` in the environment leaves that wait in.

Warm: the file is in the page cache, read again right before each run (this VM pages out
what sat untouched for a minute). Cold: ``posix_fadvise(POSIX_FADV_DONTNEED)`` on the
whole file before each run (its pages are clean: the file was fsync-ed), and each row shows
the bytes the run read from the block device (``read_bytes`` of /proc/self/io) to show it
was cold. Modes alternate within each round, and the table gives the best of the rounds
(and the median): this machine is shared, and the best is the least disturbed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.append(os.path.dirname(HERE))  # after PYTHONPATH: single_load --baseline puts its package first

from bench._report import drop_cache, print_table, proc_io  # noqa: E402

MiB = 1 << 20


def _pread_all(fd: int, buf, size: int, step: int) -> None:
    done = 0
    while done < size:
        n = os.preadv(fd, [buf[done: min(size, done + step)]], done)
        if n <= 0:
            raise RuntimeError(f"short read at {done}")
        done += n


def _prime(nbytes: int) -> None:
    """(in the child, before the clock) Map ``nbytes`` of private memory, have the kernel fill
    its pages, and unmap it: the pages the timed run then allocates are ones this VM's host
    backs already. The VM this was measured on reports free memory to its host
    (virtio-balloon free page reporting, ``page_reporting_order=11``), which takes it back;
    the first touch of such a page then waits on the host: ``MADV_POPULATE_WRITE`` of 1 GiB
    took 3-12 s in a fresh process and 0.4-0.6 s once the same process had touched and freed
    as much (docs/performance-history.md, seventh stop). That cost is the host's, it changes tenfold
    with the host's load, and every row would pay it alike: primed, the rows time the
    loaders. ``--memory fresh`` leaves it in."""
    import ctypes
    import mmap

    from metaseq_oneload._pagecache import prefault

    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = (ctypes.c_char * nbytes).from_buffer(m)
    try:
        prefault(ctypes.addressof(view), nbytes)
    finally:
        del view
        m.close()


def _child(mode: str, path: str, threads: int) -> dict:
    """(in a fresh process) One timed run of ``mode``; the bytes it delivered and read."""
    import ctypes

    import torch

    import metaseq_oneload as oneload

    # Imports before the clock starts (the engine's modules: 55-80 ms from bytecode here,
    # once per process; bench/fixed_cost.py's "first" column times a load with them).
    oneload.load_state_dict
    # Importing torch leaves a full collection due (about 90 ms here): whatever allocates
    # next pays it, and a mode that makes few Python objects (preadv) never does. A script
    # has long paid it by the time it loads; so do these, before the clock.
    import gc

    gc.collect()

    size = os.path.getsize(path)
    if os.environ.get("ONELOAD_BENCH_MEMORY", "primed") == "primed":
        _prime(size + size // 8)
    before = proc_io()
    t0 = time.perf_counter()
    if mode == "populate":  # the destination's pages alone: what every row pays before any byte lands
        from metaseq_oneload._pagecache import prefault

        buf = torch.empty(size, dtype=torch.uint8)
        prefault(buf.data_ptr(), size)
        delivered = 0
    elif mode.startswith(("preadv", "prefault")):
        from metaseq_oneload._pagecache import prefault

        first = prefault if mode.startswith("prefault") else (lambda address, n: None)
        buf = torch.empty(size, dtype=torch.uint8)
        view = memoryview((ctypes.c_char * size).from_address(buf.data_ptr())).cast("B")
        fd = os.open(path, os.O_RDONLY)
        try:
            if threads <= 1:
                _pread_all(fd, view, size, 64 * MiB)
            else:
                from concurrent.futures import ThreadPoolExecutor

                piece = 16 * MiB
                def one(a: int) -> None:
                    first(buf.data_ptr() + a, min(size, a + piece) - a)
                    _pread_all_at(fd, view, a, min(size, a + piece))

                with ThreadPoolExecutor(threads) as pool:
                    list(pool.map(one, range(0, size, piece)))
        finally:
            os.close(fd)
        delivered = size
    elif mode.startswith("engine"):
        sd = oneload.load_state_dict(path, no_dist=True)
        delivered = sum(t.numel() * t.element_size() for t in sd.values())
    elif mode == "torch.load":
        sd = torch.load(path, map_location="cpu", weights_only=False, mmap=False)["model"]  # our own file
        delivered = sum(t.numel() * t.element_size() for t in sd.values())
    elif mode == "torch.load-mmap-copy":  # mapped, then copied into fresh memory (one copy per storage)
        mapped = torch.load(path, map_location="cpu", weights_only=False, mmap=True)["model"]
        copies: dict = {}
        sd = {k: copies.setdefault(t.untyped_storage().data_ptr(), t.clone()) for k, t in mapped.items()}
        del mapped
        delivered = unique_bytes(sd)
    elif mode == "safetensors-copy":  # the same weights as .safetensors beside the .pt (with_safetensors)
        from safetensors.torch import load_file

        # load_file maps the file (0.8 on CPU): nothing is read until touched, and the
        # tensors stay the page cache's. A copy into fresh memory makes it a load.
        mapped = load_file(os.path.splitext(path)[0] + ".safetensors")
        sd = {k: t.clone() for k, t in mapped.items()}
        del mapped
        delivered = unique_bytes(sd)
    elif mode == "fastsafetensors":
        from fastsafetensors import fastsafe_open

        with fastsafe_open(os.path.splitext(path)[0] + ".safetensors", nogds=True, device="cpu") as f:
            sd = {k: f.get_tensor(k) for k in f.keys()}
        delivered = unique_bytes(sd)
    else:
        raise ValueError(mode)
    seconds = time.perf_counter() - t0
    after = proc_io()
    return {"seconds": seconds, "delivered": delivered,
            "rchar": after["rchar"] - before["rchar"], "read_bytes": after["read_bytes"] - before["read_bytes"]}


def unique_bytes(sd: dict) -> int:
    """Bytes of a state dict's tensors, each storage once (a tied weight shares one)."""
    seen = {}
    for t in sd.values():
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def with_safetensors(path: str) -> str:
    """The model of our .pt ``path`` saved beside it as .safetensors (each storage once,
    under its first name, as safetensors' own ``save_model`` would); returns its path."""
    import torch
    from safetensors.torch import save_file

    out = os.path.splitext(path)[0] + ".safetensors"
    if not os.path.exists(out):
        sd = torch.load(path, map_location="cpu", weights_only=False, mmap=True)["model"]
        first: dict = {}
        for k, t in sd.items():
            first.setdefault(t.untyped_storage().data_ptr(), (k, t))
        save_file({k: t.contiguous() for k, t in first.values()}, out)
        fd = os.open(out, os.O_RDONLY)
        os.fsync(fd)  # clean pages: DONTNEED can drop them
        os.close(fd)
    return out


def _pread_all_at(fd: int, view, lo: int, hi: int) -> None:
    done = lo
    while done < hi:
        n = os.preadv(fd, [view[done:hi]], done)
        if n <= 0:
            raise RuntimeError(f"short read at {done}")
        done += n


def run_mode(mode: str, path: str, threads: int, env: dict) -> dict:
    """One timed run of ``mode`` in a fresh process (``cat`` here): seconds, bytes
    delivered and /proc/self/io's ``rchar``/``read_bytes`` deltas."""
    if mode == "cat":
        t0 = time.perf_counter()
        with open(os.devnull, "wb") as null:
            subprocess.run(["cat", path], stdout=null, check=True)
        return {"seconds": time.perf_counter() - t0, "delivered": 0, "rchar": None, "read_bytes": None}
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", mode, path, str(threads)],
                         env={**os.environ, **env}, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{mode} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _modes(threads: list, cold: bool, prefaulted: bool = False) -> list:
    """(label, mode, threads, env) in the order each round runs them."""
    pool = max(threads)
    modes = [("cat file > /dev/null", "cat", 1, {}),
             ("preadv, 1 thread, fresh memory", "preadv", 1, {})]
    modes += [(f"preadv, {n} threads, fresh memory", f"preadv{n}", n, {}) for n in threads if n > 1]
    if prefaulted:
        modes += [(f"preadv, {n} threads, pages mapped first", f"prefault{n}", n, {}) for n in threads if n > 1]
    for n in threads:
        modes.append((f"engine, read_threads={n}", f"engine{n}", n, {"METASEQ_ONELOAD_READ_THREADS": str(n)}))
    if cold:
        modes.append((f"engine, read_threads={pool}, O_DIRECT", f"engine{pool}-direct", pool,
                      {"METASEQ_ONELOAD_READ_THREADS": str(pool), "METASEQ_ONELOAD_O_DIRECT": "1"}))
    modes.append(("torch.load(mmap=False)", "torch.load", 1, {}))
    return modes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=2.0, help="model size in GiB (fp32)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds per cache state")
    ap.add_argument("--threads", default="1,2,4,8", help="thread counts for the pooled preadv and the engine")
    ap.add_argument("--no-cold", action="store_true", help="warm page cache only")
    ap.add_argument("--prefault", action="store_true",
                    help="also time preadv into memory whose pages each piece maps first (MADV_POPULATE_WRITE)")
    ap.add_argument("--keep", help="write the checkpoint here and keep it")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.child[0], args.child[1], int(args.child[2]))))
        return 0

    import torch

    from bench._synth import metaseq_lm, model_shape, write_metaseq

    threads = sorted({int(x) for x in args.threads.split(",")})
    shape = model_shape(args.gib)
    tmp = args.keep or tempfile.mkdtemp(prefix="oneload-readbw-", dir="/tmp")
    os.makedirs(tmp, exist_ok=True)
    path = os.path.join(tmp, "synth.pt")
    results: dict = {}
    try:
        if not os.path.exists(path):
            t0 = time.perf_counter()
            write_metaseq(os.path.join(tmp, "synth"), metaseq_lm(shape["layers"], shape["dim"], shape["ffn"],
                                                                   shape["vocab"], shape["positions"]))
            print(f"  wrote {path} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)  # clean pages: DONTNEED can drop them
        os.close(fd)
        size = os.path.getsize(path)
        states = ["warm"] + ([] if args.no_cold else ["cold"])
        for state in states:
            modes = _modes(threads, state == "cold", args.prefault)
            for rnd in range(args.repeats):
                for label, mode, n, env in modes:
                    if state == "cold":
                        drop_cache([path])
                    elif mode != "cat":
                        run_mode("cat", path, 1, {})
                    r = run_mode(mode, path, n, env)
                    results.setdefault((state, label), []).append(r)
                    print(f"  {state} round {rnd + 1}: {label}: {r['seconds']:.2f} s", file=sys.stderr)
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)

    rows = []
    for state in ("warm", "cold"):
        limit = None
        for label, mode, n, env in _modes(threads, state == "cold", args.prefault):
            runs = results.get((state, label))
            if not runs:
                continue
            best = min(r["seconds"] for r in runs)
            if mode.startswith("preadv"):
                limit = best if limit is None else min(limit, best)
            rows.append({"cache": state, "run": label, "best_s": round(best, 3),
                         "median_s": round(statistics.median(r["seconds"] for r in runs), 3),
                         "gib_per_s": round(size / best / 2**30, 2),
                         "read_bytes_mib": None if runs[0]["read_bytes"] is None else
                         round(max(r["read_bytes"] for r in runs) / MiB),
                         "delivered_mib": round(runs[0]["delivered"] / MiB) if runs[0]["delivered"] else None})
        for r in rows:
            if r["cache"] == state and limit:
                r["over_preadv_limit"] = round(r["best_s"] / limit, 2)
    meta = {"file_bytes": size, "layers": shape["layers"], "dim": shape["dim"], "repeats": args.repeats,
            "torch": torch.__version__, "cpus": os.cpu_count()}
    if args.json:
        print(json.dumps({**meta, "rows": rows}, indent=2))
        return 0
    print(f"file: {size / 2**30:.2f} GiB ({shape['layers']} layers of width {shape['dim']}, fp32 singleton), "
          f"best of {args.repeats}, torch {torch.__version__}, {os.cpu_count()} CPUs; "
          "'x limit': best time over the best preadv-into-fresh-memory time of the same cache state")
    header = ["cache", "run", "best s", "median s", "GiB/s", "x limit", "read_bytes MiB"]
    body = [[r["cache"], r["run"], f"{r['best_s']:.2f}", f"{r['median_s']:.2f}", f"{r['gib_per_s']:.2f}",
             f"{r['over_preadv_limit']:.2f}x" if r.get("over_preadv_limit") else "-",
             "-" if r["read_bytes_mib"] is None else str(r["read_bytes_mib"])] for r in rows]
    print_table(header, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
