"""What checking digests costs a load, and what ``digest`` costs against reading (issue 24).

    .venv/bin/python bench/digest_bench.py [--gib 2.0] [--repeat 3] [--keep DIR] [--json]

Writes a synthetic fp32 model with metaseq's names (``bench/_synth.py``) and converts it with
``convert`` (which records the digests in the index beside its output) twice: one
unflattened file, and 4 flat FSDP shards. Then, each run in fresh processes, side by side
and alternating (best of ``--repeat``, the page cache warm: both read the same cached bytes;
wall seconds, and CPU seconds summed over the processes, steadier on a shared machine):

(a) one process: ``load_state_dict(file)`` vs ``load_state_dict(file, verify="digest")``;
(b) 4 gloo ranks: ``load_state_dict(shard, flat=True)`` (each rank reads its own shard) and
    ``load_state_dict(file)`` (every rank wants every byte: the read-once exchange), with and
    without ``verify="digest"`` (wall time of the slowest rank, between barriers);
(c) cold page cache (``posix_fadvise(DONTNEED)`` before each run): reading the file's bytes
    (8 threads, 16 MiB ``preadv`` each, as the loader reads), a plain load, the digest-checked
    load, and ``metaseq_oneload.digest(file)`` where it exists.

The targets (issue 24): (a) and (b) at most 1.10x, ``digest`` within 1.2x of the cold read.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._report import drop_cache, print_table  # noqa: E402
from bench._synth import metaseq_lm, model_shape, write_metaseq  # noqa: E402


def _child(spec: dict) -> dict:
    """(one process; or one rank of ``spec["world"]``) Time one verb, return the seconds."""
    import torch
    import torch.distributed as dist

    import metaseq_oneload as mo

    import resource

    torch.set_num_threads(1)
    world = spec["world"]
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{spec['store']}", rank=spec["rank"], world_size=world,
                                timeout=datetime.timedelta(seconds=900))
        dist.barrier()
    t0, r0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    kind, path = spec["kind"], spec["path"]
    extra = {}
    if kind == "read":  # the file's bytes, as the loader reads them: 8 threads of 16 MiB preadv
        from concurrent.futures import ThreadPoolExecutor

        size, piece = os.path.getsize(path), 16 << 20
        fd = os.open(path, os.O_RDONLY)

        def read(off: int) -> int:
            buf = bytearray(min(piece, size - off))
            return os.preadv(fd, [buf], off)

        try:
            with ThreadPoolExecutor(8) as pool:
                extra["bytes"] = sum(pool.map(read, range(0, size, piece)))
        finally:
            os.close(fd)
    elif kind == "digest":
        rep = mo.digest(path)
        extra["model"] = rep.model
    else:
        verify = "digest" if kind.endswith("+digest") else False
        got = mo.load_checkpoint(path, flat=kind.startswith("flat"), verify=verify,
                                 no_dist=world == 1)
        extra["checked"] = got.report.digests_checked
    if world > 1:
        dist.barrier()
    seconds, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    if world > 1:
        dist.destroy_process_group()
    cpu = r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime
    return {"seconds": seconds, "cpu": cpu, **extra}


def _run(kind: str, path: str, world: int, tmp: str, cold: bool) -> tuple:
    """(wall seconds of ``kind`` on ``world`` fresh processes (the slowest rank), CPU
    seconds summed over them)."""
    if cold:
        drop_cache([os.path.dirname(path)])
    store = os.path.join(tmp, f"store-{time.time_ns()}")
    procs = []
    for rank in range(world):
        spec = {"kind": kind, "path": path, "world": world, "rank": rank, "store": store}
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)],
                                      stdout=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"}))
    outs = [json.loads(p.communicate()[0].decode().strip().splitlines()[-1]) for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{kind} on {world} ranks failed (exit codes {[p.returncode for p in procs]})")
    return max(o["seconds"] for o in outs), sum(o["cpu"] for o in outs)


def _best(kinds, path: str, world: int, tmp: str, repeat: int, cold: bool = False) -> dict:
    """Best (wall, CPU) seconds of each kind, run alternately ``repeat`` times."""
    times = {k: [] for k in kinds}
    for _ in range(repeat):
        for k in kinds:
            times[k].append(_run(k, path, world, tmp, cold))
            print(f"  {k} W={world}{' cold' if cold else ''}: {times[k][-1][0]:.2f}s wall, {times[k][-1][1]:.2f}s CPU",
                  file=sys.stderr)
    return {k: (min(w for w, _ in v), min(c for _, c in v)) for k, v in times.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=2.0, help="model size in GiB (fp32)")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each kind (best is shown)")
    ap.add_argument("--keep", help="write the checkpoints here and keep them")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(_child(json.loads(args.child))))
        return 0

    import metaseq_oneload as mo

    shape = model_shape(args.gib)
    tmp = args.keep or tempfile.mkdtemp(prefix="oneload-digest-bench-")
    os.makedirs(tmp, exist_ok=True)
    os.environ.setdefault("METASEQ_ONELOAD_INDEX_KEY", os.path.join(tmp, "index-key"))
    try:
        full = metaseq_lm(shape["layers"], shape["dim"], shape["ffn"], shape["vocab"], shape["positions"])
        model_bytes = sum(t.numel * 4 for t in full.values())
        single = os.path.join(tmp, "one", "ck.pt")
        shards = os.path.join(tmp, "four", "ck-model_part-0-shard0.pt")
        if not os.path.exists(shards):
            write_metaseq(os.path.join(tmp, "synth"), full)
            mo.convert(os.path.join(tmp, "synth.pt"), os.path.join(tmp, "one", "ck"), progress=False)
            mo.convert(os.path.join(tmp, "synth.pt"), os.path.join(tmp, "four", "ck"), shards=4, progress=False)
            os.unlink(os.path.join(tmp, "synth.pt"))
        rows = []

        def pair(label, kind, path, world):
            r = _best([kind, kind + "+digest"], path, world, tmp, args.repeat)
            (w0, c0), (w1, c1) = r[kind], r[kind + "+digest"]
            rows.append([label, world, f"{w0:.2f}", f"{w1:.2f}", f"{w1 / w0:.3f}x", f"{c0:.2f}", f"{c1:.2f}",
                         f"{c1 / c0:.3f}x"])

        pair("(a) load_state_dict(file)", "load", single, 1)
        pair("(b) load_state_dict(shard, flat=True): own shards", "flat", shards, 4)
        pair("(b) load_state_dict(file): read-once exchange", "load", single, 4)
        kinds = ["read", "load", "load+digest"] + (["digest"] if hasattr(mo, "digest") else [])
        cold = _best(kinds, single, 1, tmp, args.repeat, cold=True)
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        print(json.dumps({"model_bytes": model_bytes, "warm": rows, "cold": cold}, indent=2))
        return 0
    import torch

    print(f"model: {model_bytes / 2**30:.2f} GiB fp32 ({shape['layers']} layers of width {shape['dim']}), "
          f"best of {args.repeat}, torch {torch.__version__}, {os.cpu_count()} CPUs")
    print("\nwarm page cache: a load with and without verify='digest' (target <= 1.10x)")
    print_table(["load", "W", "plain s", "digest s", "ratio", "plain CPU s", "digest CPU s", "CPU ratio"], rows)
    print("\ncold page cache, one process (target: digest <= 1.2x the cold read)")
    print_table(["run", "s", "vs cold read", "CPU s"],
                [[k, f"{w:.2f}", f"{w / cold['read'][0]:.3f}x", f"{c:.2f}"] for k, (w, c) in cold.items()])
    return 0


if __name__ == "__main__":
    sys.exit(main())
