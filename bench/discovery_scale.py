"""Discovery at OPT-175B's file count: 8 model parts x 124 FSDP shards = 992 files.

    .venv/bin/python bench/discovery_scale.py [--parts 8] [--shards 124] [--world 4] [--optimizer]

Writes a small metaseq model (8 heads) with the package's own writers: a singleton from
``bench/_synth.py`` (with ``--optimizer``, with Adam state, which ``convert`` carries into
every shard, as a training run's files hold it), then ``metaseq_oneload.convert`` to parts x
shards flat files, which leaves its index (``ckpt.oneload-index.json``) beside them. Then,
each in a fresh process (imports before the clock starts):

* ``inspect`` with the index, and with the index moved away (every header unpickled);
* every header read in turn in one thread (``read_header``): milliseconds a file;
* a collective load on ``--world`` gloo ranks (``flat=False``: every rank needs every
  file), with and without the index: per rank, how many files were unpickled and how many
  headers' identities checked, and the seconds from the call to the first byte of weights.

Prints one table. Not a timed test: the machine may be shared.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_INSPECT = (
    "import time, torch, numpy, metaseq_oneload as o, metaseq_oneload.formats; "
    "t = time.perf_counter(); lay = o.inspect({path!r}); dt = time.perf_counter() - t; "
    "print(dt, len(lay.all_files), lay.index is not None)"
)

_HEADERS = (  # the first read warms what a process does once (lazy imports, allowlists), then the caches go
    "import glob, time, torch, numpy; from metaseq_oneload import _header, _reading, _zip; "
    "ps = sorted(glob.glob({folder!r} + '/*.pt')); _reading.read_header(ps[0]); "
    "_header._cached_header.cache_clear(); _zip.zip_index.cache_clear(); "
    "t = time.perf_counter(); [_reading.read_header(p) for p in ps]; print((time.perf_counter() - t) / len(ps) * 1e3)"
)

_LOAD = r'''
import datetime, json, os, sys, time
import torch.distributed as dist
import torch.multiprocessing as mp

def worker(rank, world, path, store, out):
    import metaseq_oneload as o
    from metaseq_oneload import _header
    from metaseq_oneload.formats import _index
    counts = {"unpickled": 0, "identities": 0}
    real_load, real_id = _header.torch_load, _index.file_identity
    def load(p, **kw):
        counts["unpickled"] += 1
        return real_load(p, **kw)
    def ident(p):
        counts["identities"] += 1
        return real_id(p)
    _header.torch_load, _index.file_identity = load, ident
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    dist.barrier()
    first = []
    t = time.perf_counter()
    o.load_state_dict(path, process_group=dist.group.WORLD,
                      progress=lambda done, total: first.append(time.perf_counter() - t) if not first else None)
    total = time.perf_counter() - t
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({**counts, "first_byte_s": first[0] if first else None, "total_s": total}, f)
    dist.destroy_process_group()

if __name__ == "__main__":
    path, world, tmp = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    mp.start_processes(worker, args=(world, path, os.path.join(tmp, "store"), tmp), nprocs=world, start_method="spawn")
    print(json.dumps([json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(world)]))
'''


def _inspect(path: str) -> tuple:
    out = subprocess.run([sys.executable, "-c", _INSPECT.format(path=path)], capture_output=True, text=True, check=True)
    dt, n, indexed = out.stdout.split()
    return float(dt), int(n), indexed == "True"


def _load(path: str, world: int) -> list:
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "load.py")
        with open(script, "w") as f:
            f.write(_LOAD)
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        out = subprocess.run([sys.executable, script, path, str(world), tmp], capture_output=True, text=True, env=env)
        if out.returncode:
            raise RuntimeError(out.stderr[-3000:])
        return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", type=int, default=8)
    ap.add_argument("--shards", type=int, default=124)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--optimizer", action="store_true", help="files carry Adam state, like a training run's")
    ap.add_argument("--keep", help="write the set here and keep it")
    a = ap.parse_args()

    import metaseq_oneload as mo
    from bench._synth import metaseq_lm, write_metaseq

    root = a.keep or tempfile.mkdtemp(prefix="oneload-scale-")
    try:
        single = os.path.join(root, "single", "ckpt")
        if not os.path.exists(single + ".pt"):
            write_metaseq(single, metaseq_lm(layers=2, dim=64, ffn=256, vocab=512, positions=64), optimizer=a.optimizer)
        dst = os.path.join(root, "scale", "ckpt")
        index = dst + ".oneload-index.json"
        if not os.path.exists(index):
            report = mo.convert(single + ".pt", dst, model_parallel=a.parts, shards=a.shards, flat=True, progress=False)
            print(f"wrote {len(report.files)} files in {report.seconds:.1f} s (optimizer state {report.optimizer})",
                  file=sys.stderr)
        folder = os.path.dirname(dst)
        rows = []
        t, n, used = _inspect(folder)
        rows.append(("inspect, index", f"{t:.2f} s", n, "0 (index)" if used else "?"))
        aside = index + ".aside"
        os.replace(index, aside)
        try:
            t, n, used = _inspect(folder)
            rows.append(("inspect, headers", f"{t:.2f} s", n, str(n)))
            out = subprocess.run([sys.executable, "-c", _HEADERS.format(folder=folder)], capture_output=True, text=True,
                                 check=True)
            rows.append(("header reads, 1 thread", f"{float(out.stdout):.2f} ms a file", n, str(n)))
            no_index = _load(folder, a.world)
        finally:
            os.replace(aside, index)
        with_index = _load(folder, a.world)
        for label, ranks in (("load, index", with_index), ("load, headers", no_index)):
            unp = [r["unpickled"] for r in ranks]
            ids = [r["identities"] for r in ranks]
            first = max(r["first_byte_s"] for r in ranks)
            rows.append((f"{label}, W={a.world}", f"first byte {first:.2f} s",
                         f"unpickled {sum(unp)} ({'/'.join(map(str, unp))})",
                         f"identities {sum(ids)} ({'/'.join(map(str, ids))})"))
        print(f"{a.parts} x {a.shards} = {a.parts * a.shards} files{', with optimizer state' * a.optimizer}")
        for r in rows:
            print("  " + " | ".join(str(x).ljust(22) for x in r))
    finally:
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
