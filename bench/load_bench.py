"""Peak CPU memory and wall time of every loading path, against the peers.

    .venv/bin/python bench/load_bench.py [--gib 1.0] [--bucket-mb 256] [--keep DIR] [--only WORDS,...] [--cold]

Writes a synthetic ~1 GiB fp32 model with metaseq's names as a singleton and as 4 flat
FSDP shards (metaseq's format, with shard_metadata), then loads it on 4 and on 3 gloo ranks,
each run in a fresh process group: full weights on every rank (``flat=False``) with every
named strategy, FSDP shards (``flat=True`` and ``load_into`` an FSDP2 module). Per rank it
records the peak RSS above the RSS just before the call (the peak is reset with
/proc/self/clear_refs; a shared-memory page counts in every process that touched it); the
table shows the sum over ranks and the largest rank as ratios to the model's bytes, beside
the floor (each rank's output: ``W`` for full weights, 1 for shards) and the target (the
floor plus one bucket in all), and the wall time (slowest rank, after a barrier).

Peers measured in the same run: every rank ``torch.load``s the whole checkpoint (naive), and
torch FSDP2 ``set_model_state_dict(..., StateDictOptions(full_state_dict=True,
broadcast_from_rank0=True))`` into the same FSDP2-sharded module.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._report import measure_rank, print_table  # noqa: E402

from bench._synth import metaseq_lm, model_shape, write_metaseq  # noqa: E402


def _measure(fn) -> tuple:
    """(bytes of peak RSS above the RSS before, seconds) of ``fn()`` on this rank."""
    m = measure_rank(fn)
    return m["extra"], m["seconds"]


def _fsdp2_model(dims):
    from torch.distributed.device_mesh import init_device_mesh

    from tests.tiny_metaseq import sharded_on_meta

    return sharded_on_meta(init_device_mesh("cpu", (dist.get_world_size(),)), **dims)


_SHARD0 = "-model_part-0-shard0.pt"
# A first call in a process pays once for what it imports and sets up (some MiB per rank,
# whatever the model): a load of this tiny model first leaves the measured one with its buffers.
_TINY = dict(layers=1, dim=64, ffn=256, vocab=256, positions=64)


def _run(kind: str, path: str, dims: dict, bucket_mb: float):
    import metaseq_oneload as oneload

    group = dist.group.WORLD
    if kind.startswith("ours-full"):
        strategy = kind.split(":")[1]
        return lambda: oneload.load_state_dict(path, process_group=group, flat=False, strategy=strategy,
                                               bucket_mb=bucket_mb)
    if kind.startswith("ours-flat"):
        strategy = kind.split(":")[1]
        # An unflattened source needs the target wrapping, as a fairscale model would give it.
        shards = path if path.endswith(_SHARD0) else path[: -len(".pt")] + "4" + _SHARD0
        wrapping = None if path == shards else oneload.inspect(shards).header()["shard_metadata"]
        return lambda: oneload.load_state_dict(path, process_group=group, flat=True, strategy=strategy,
                                               bucket_mb=bucket_mb, shard_metadata=wrapping)
    if kind.startswith("ours-fsdp2"):
        strategy = kind.split(":")[1]
        model = _fsdp2_model(dims)
        return lambda: (oneload.load_into(model, path, strategy=strategy, bucket_mb=bucket_mb), model)
    if kind == "naive":
        return lambda: torch.load(path, map_location="cpu", weights_only=False)
    if kind == "fsdp2-broadcast":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        model = _fsdp2_model(dims)

        def go():
            model.to_empty(device="cpu")
            full = torch.load(path, map_location="cpu", mmap=True, weights_only=False)["model"] if dist.get_rank() == 0 else {}
            set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
            return model

        return go
    raise ValueError(kind)


def _worker(rank, world, store, kind, path, dims, bucket_mb, out, warm):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=900))
    try:
        if warm is not None:  # the same call on the tiny model: imports, the group's connections
            _run(kind, warm[0], warm[1], bucket_mb)()
            dist.barrier()
        fn = _run(kind, path, dims, bucket_mb)
        extra, seconds = _measure(fn)
        with open(f"{out}.{rank}", "w") as f:
            json.dump({"extra": extra, "seconds": seconds}, f)
    finally:
        dist.destroy_process_group()


def _cache(path: str) -> None:
    """Read the checkpoint's files once, so every run starts from a warm page cache (as the
    table's times assume; another process may have pushed them out since the last run)."""
    prefix = path[: -len(_SHARD0)] + "-model_part-" if path.endswith(_SHARD0) else path
    folder = os.path.dirname(path)
    for name in sorted(os.listdir(folder)):
        f = os.path.join(folder, name)
        if f == path or f.startswith(prefix):
            with open(f, "rb", buffering=0) as fh:
                while fh.read(64 << 20):
                    pass


def run(kind: str, path: str, world: int, dims: dict, bucket_mb: float, tmp: str, warm=None) -> dict:
    _cache(path)
    store = os.path.join(tmp, f"store-{kind.replace(':', '_')}-{world}-{time.time_ns()}")
    out = store + ".out"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, world, store, kind, path, dims, bucket_mb, out, warm))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise RuntimeError(f"{kind} on {world} ranks failed (exit codes {[p.exitcode for p in procs]})")
    res = [json.load(open(f"{out}.{r}")) for r in range(world)]
    return {"extra": [r["extra"] for r in res], "seconds": max(r["seconds"] for r in res)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="model size in GiB (fp32)")
    ap.add_argument("--bucket-mb", type=float, default=256, help="bucket_mb (the library's default: 256)")
    ap.add_argument("--keep", help="write the checkpoints here and keep them")
    ap.add_argument("--cold", action="store_true",
                    help="no tiny load first: the measured call also pays the process's first-call setup")
    ap.add_argument("--only", help="run only the rows whose label, kind and 'W=n' contain all the words of one of "
                                   "these comma-separated alternatives")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    shape = model_shape(args.gib)
    # The module the FSDP2 runs load into: TinyMetaseqLM's table has metaseq's 2 extra rows.
    dims = dict(dim=shape["dim"], ffn=shape["ffn"], vocab=shape["vocab"], layers=shape["layers"],
                positions=shape["positions"] + 2)
    tmp = args.keep or tempfile.mkdtemp(prefix="oneload-bench-")
    os.makedirs(tmp, exist_ok=True)
    try:
        full = metaseq_lm(shape["layers"], shape["dim"], shape["ffn"], shape["vocab"], shape["positions"])
        model_bytes = sum(t.numel * 4 for t in full.values())
        single = os.path.join(tmp, "synth.pt")
        if not os.path.exists(single):
            write_metaseq(os.path.join(tmp, "synth"), full)
            write_metaseq(os.path.join(tmp, "synth4"), full, shards=4)
        shards = os.path.join(tmp, "synth4" + _SHARD0)
        tiny = os.path.join(tmp, "tiny.pt")
        if not os.path.exists(tiny):
            small = metaseq_lm(_TINY["layers"], _TINY["dim"], _TINY["ffn"], _TINY["vocab"], _TINY["positions"])
            write_metaseq(os.path.join(tmp, "tiny"), small)
            write_metaseq(os.path.join(tmp, "tiny4"), small, shards=4)
        tiny_dims = dict(_TINY, positions=_TINY["positions"] + 2)
        full_w = [("ours, full weights (flat=False)", f"ours-full:{st}", single, w)
                  for w in (4, 3) for st in ("auto", "reshard", "parallel", "broadcast")]
        plan = full_w + [
            ("naive: every rank torch.load", "naive", single, 4),
            ("naive: every rank torch.load", "naive", single, 3),
            ("ours, flat=True", "ours-flat:auto", shards, 4),
            ("ours, flat=True", "ours-flat:own_shard", shards, 4),
            ("ours, flat=True", "ours-flat:auto", shards, 3),
            ("ours, flat=True", "ours-flat:parallel", shards, 3),
            ("ours, flat=True", "ours-flat:broadcast", single, 4),
            ("ours, flat=True", "ours-flat:broadcast", shards, 3),
            ("ours, load_into FSDP2", "ours-fsdp2:auto", shards, 4),
            ("ours, load_into FSDP2", "ours-fsdp2:auto", single, 3),
            ("ours, load_into FSDP2", "ours-fsdp2:broadcast", single, 4),
            ("FSDP2 set_model_state_dict broadcast_from_rank0", "fsdp2-broadcast", single, 4),
            ("FSDP2 set_model_state_dict broadcast_from_rank0", "fsdp2-broadcast", single, 3),
        ]
        if args.only:
            plan = [p for p in plan if any(all(word in f"{p[0]} {p[1]} W={p[3]}" for word in alt.split())
                                           for alt in args.only.split(","))]
        rows = []
        for label, kind, path, world in plan:
            warm = None if args.cold else (tiny if path == single else os.path.join(tmp, "tiny4" + _SHARD0), tiny_dims)
            r = run(kind, path, world, dims, args.bucket_mb, tmp, warm)
            strategy = kind.split(":")[1] if ":" in kind else "-"
            source = "singleton" if path == single else "4 flat shards"
            floor = float(world) if kind.startswith(("ours-full", "naive")) else 1.0
            rows.append({
                "run": label, "source": source, "world": world, "strategy": strategy,
                "per_rank_mib": [round(x / 2**20) for x in r["extra"]],
                "sum_over_model": round(sum(r["extra"]) / model_bytes, 3),
                "max_over_model": round(max(r["extra"]) / model_bytes, 3),
                "floor": floor, "target": round(floor + args.bucket_mb * 2**20 / model_bytes, 3),
                "seconds": round(r["seconds"], 2),
            })
            print(f"  done: {label} {source} W={world} {strategy}: {rows[-1]['sum_over_model']}x, {rows[-1]['seconds']}s",
                  file=sys.stderr)
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        print(json.dumps({"model_bytes": model_bytes, "bucket_mb": args.bucket_mb, "rows": rows}, indent=2))
        return 0
    print(f"model: {model_bytes / 2**30:.2f} GiB fp32 ({model_bytes // 4:,} params, {shape['layers']} layers of width "
          f"{shape['dim']}), bucket {args.bucket_mb:g} MiB, "
          f"torch {torch.__version__}, {os.cpu_count()} CPUs, "
          f"{'first call in each process' if args.cold else 'after a load of a tiny model in each process'}")
    header = ["run", "source", "W", "strategy", "peak above baseline per rank (MiB)", "sum / model", "max rank / model",
              "floor + 1 bucket", "wall s"]
    body = [[r["run"], r["source"], r["world"], r["strategy"], " ".join(map(str, r["per_rank_mib"])),
             f"{r['sum_over_model']:.3f}x", f"{r['max_over_model']:.3f}x", f"{r['target']:.3f}x", f"{r['seconds']:.2f}"]
            for r in rows]
    print_table(header, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
