"""Peak CPU memory and wall time of every loading path, against the peers.

    .venv/bin/python bench/load_bench.py [--gib 1.0] [--bucket-mb 64] [--keep DIR]

Writes a synthetic ~1 GiB fp32 model with metaseq's names as a singleton and as 4 flat
FSDP shards (metaseq's format, with shard_metadata), then loads it on 4 and on 3 gloo ranks,
each run in a fresh process group. Per rank it records the peak RSS above the RSS just
before the call (the peak is reset with /proc/self/clear_refs); the table shows the sum over
ranks as a ratio to the model's bytes, and the wall time (slowest rank, after a barrier).

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


def _run(kind: str, path: str, dims: dict, bucket_mb: float):
    import metaseq_oneload as oneload

    group = dist.group.WORLD
    if kind.startswith("ours-flat"):
        strategy = kind.split(":")[1]
        # An unflattened source needs the target wrapping, as a fairscale model would give it.
        shards = os.path.join(os.path.dirname(path), "synth4-model_part-0-shard0.pt")
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


def _worker(rank, world, store, kind, path, dims, bucket_mb, out):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=900))
    try:
        fn = _run(kind, path, dims, bucket_mb)
        extra, seconds = _measure(fn)
        with open(f"{out}.{rank}", "w") as f:
            json.dump({"extra": extra, "seconds": seconds}, f)
    finally:
        dist.destroy_process_group()


def run(kind: str, path: str, world: int, dims: dict, bucket_mb: float, tmp: str) -> dict:
    store = os.path.join(tmp, f"store-{kind.replace(':', '_')}-{world}-{time.time_ns()}")
    out = store + ".out"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, world, store, kind, path, dims, bucket_mb, out)) for r in range(world)]
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
    ap.add_argument("--bucket-mb", type=float, default=64, help="broadcast bucket size")
    ap.add_argument("--keep", help="write the checkpoints here and keep them")
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
        shards = os.path.join(tmp, "synth4-model_part-0-shard0.pt")
        plan = [
            ("ours, flat=True", "ours-flat:auto", shards, 4),
            ("ours, flat=True", "ours-flat:auto", shards, 3),
            ("ours, flat=True", "ours-flat:broadcast", single, 4),
            ("ours, flat=True", "ours-flat:broadcast", shards, 3),
            ("ours, load_into FSDP2", "ours-fsdp2:auto", shards, 4),
            ("ours, load_into FSDP2", "ours-fsdp2:auto", single, 3),
            ("ours, load_into FSDP2", "ours-fsdp2:broadcast", single, 4),
            ("FSDP2 set_model_state_dict broadcast_from_rank0", "fsdp2-broadcast", single, 4),
            ("FSDP2 set_model_state_dict broadcast_from_rank0", "fsdp2-broadcast", single, 3),
            ("naive: every rank torch.load", "naive", single, 4),
            ("naive: every rank torch.load", "naive", single, 3),
        ]
        rows = []
        for label, kind, path, world in plan:
            r = run(kind, path, world, dims, args.bucket_mb, tmp)
            strategy = kind.split(":")[1] if ":" in kind else "-"
            source = "singleton" if path == single else "4 flat shards"
            rows.append({
                "run": label, "source": source, "world": world, "strategy": strategy,
                "per_rank_mib": [round(x / 2**20) for x in r["extra"]],
                "sum_over_model": round(sum(r["extra"]) / model_bytes, 3),
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
          f"torch {torch.__version__}, {os.cpu_count()} CPUs")
    header = ["run", "source", "W", "strategy", "peak above baseline per rank (MiB)", "sum / model", "wall s"]
    body = [[r["run"], r["source"], r["world"], r["strategy"], " ".join(map(str, r["per_rank_mib"])),
             f"{r['sum_over_model']:.2f}x", f"{r['seconds']:.2f}"] for r in rows]
    print_table(header, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
