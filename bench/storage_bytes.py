"""Bytes read from storage, memory and time of every strategy and of the peers, per rank.

    .venv/bin/python bench/storage_bytes.py [--gib 0.25 0.5 1 2] [--worlds 1 3 4] [--json]
        [--strategies auto,parallel,...] [--sources single,shards4] [--no-peers] [--keep DIR] [--repeat N]

For each model size (a synthetic fp32 decoder with metaseq's names, bench/_synth.py) it writes
the model as a metaseq singleton (unflattened), as 4 flat FSDP shards, as one safetensors file
and as a ``torch.distributed.checkpoint`` folder, all under /tmp (deleted afterwards unless
``--keep``). Then, for each world size, every run in a fresh process group (fresh processes,
forked from a server that has only imported the libraries, so no cache of a previous run
survives):

* ours: ``load_checkpoint`` for every strategy of ``metaseq_oneload._options.STRATEGIES``
  (``own_shard`` only where the saved files match the world), ``flat`` True and False,
  from the singleton and from the 4 shards;
* the peers: every rank ``torch.load`` (``mmap=False``; ``mmap=True`` then a copy of every
  tensor, as loading it into a model does), FSDP2 ``set_model_state_dict(...,
  StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))`` into an FSDP2-sharded
  module of the same shapes (rank 0 reads the file memory-mapped), ``torch.distributed.checkpoint``
  loading its own folder into full tensors on every rank and into the FSDP2 module's shards,
  every rank ``safetensors.torch.load_file`` (then a copy of every tensor: its tensors are
  views of a mapping), and Run:ai Model Streamer on every rank and in
  its distributed mode (``RUNAI_STREAMER_DIST=1`` over gloo).

Per rank, around the load only (imports done before): the deltas of ``rchar`` and
``read_bytes`` of /proc/self/io, measured by the kernel, independently of the code under
test; the peak RSS above the RSS before (``malloc_trim``, then the peak is reset through
/proc/self/clear_refs); the wall time (slowest rank, between barriers). Before every run the
files' pages are dropped from the page cache (``posix_fadvise(DONTNEED)``; they were
fsync-ed), so every run starts cold.

What the columns mean:

* ``rchar / B``: bytes the processes asked the kernel for through read-type calls
  (read/pread/preadv), summed over ranks, over the model's bytes B. This is what each rank
  pulls from storage, page cache or not, and what a shared filesystem or object store would
  serve to ranks on different machines. gloo receives with ``recv``, which rchar does not count;
  sends (writev) land in wchar, not here. Memory-mapped reads (torch.load mmap=True,
  safetensors, FSDP2's rank 0) are page faults, which rchar does not see.
* ``read_bytes / B``: bytes actually fetched from the block device, summed over ranks. It sees
  page faults of mmap too, but all ranks here share one page cache: the first rank to touch a
  page pays for it and the others find it cached, so for several ranks reading the same bytes
  this is a lower bound (about 1x where the cluster would read W x).
* ``peak / B``: the sum over ranks of the peak RSS above the RSS before the call (mapped file
  pages that a rank touches count in its RSS).
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from bench._report import drop_cache, measure_rank  # noqa: E402

_PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.fsdp",
            "torch.distributed.checkpoint.state_dict", "safetensors.torch", "metaseq_oneload",
            "metaseq_oneload._loading"]


# --------------------------------------------------------------------------- measuring (in a rank)


_measure = measure_rank


def _fsdp2_model(dims):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from tests.tiny_metaseq import sharded_on_meta

    return sharded_on_meta(init_device_mesh("cpu", (dist.get_world_size(),)), **dims)


def _touch_all(sd) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values() if hasattr(t, "numel"))


def _prepare(kind: str, files: dict, dims: dict):
    """The load to time, as a function of nothing: everything it needs that is not loading
    (a module on meta, imports) is done here, before the clock starts."""
    import torch
    import torch.distributed as dist

    import metaseq_oneload as oneload
    from metaseq_oneload._allowlist import safe_globals

    safe_globals()  # imports omegaconf (the allowlist), as any earlier load in the process would have
    group = dist.group.WORLD
    if kind.startswith("ours:"):
        _, source, strategy, flat = kind.split(":")
        flat = flat == "flat"
        path = files[source]
        wrapping = None
        if flat and source != "shards4":  # an unflattened source needs the target wrapping (fairscale's)
            wrapping = oneload.inspect(files["shards4"]).header()["shard_metadata"]

        def go():
            r = oneload.load_checkpoint(path, process_group=group, flat=flat, strategy=strategy,
                                        shard_metadata=wrapping)
            rep = r.report
            return {"sd": r.model, "report": {"strategy": rep.strategy, "bytes_read": rep.bytes_read,
                                              "bytes_received": getattr(rep, "bytes_received", 0)}}

        return go
    if kind in ("torch.load", "torch.load-mmap"):
        mmap = kind.endswith("mmap")

        def go():
            sd = torch.load(files["single"], map_location="cpu", weights_only=False, mmap=mmap)["model"]
            if mmap:  # what loading it into a model costs: every tensor copied out of the mapping
                sd = {k: v.clone() for k, v in sd.items()}
            return {"sd": sd}

        return go
    if kind == "fsdp2-broadcast":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        model = _fsdp2_model(dims)

        def go():
            model.to_empty(device="cpu")
            full = (torch.load(files["single"], map_location="cpu", mmap=True, weights_only=False)["model"]
                    if dist.get_rank() == 0 else {})
            set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
            return {"model": model}

        return go
    if kind == "dcp-full":
        import torch.distributed.checkpoint as dcp

        meta = json.load(open(files["dcp"] + ".shapes.json"))

        def go():
            sd = {k: torch.empty(shape, dtype=getattr(torch, dt)) for k, (shape, dt) in meta.items()}
            dcp.load(sd, checkpoint_id=files["dcp"], process_group=group)
            return {"sd": sd}

        return go
    if kind == "dcp-fsdp2":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        model = _fsdp2_model(dims)

        def go():
            model.to_empty(device="cpu")
            sd = get_model_state_dict(model)
            dcp.load(sd, checkpoint_id=files["dcp"], process_group=group)
            return {"model": model}

        return go
    if kind == "safetensors":
        from safetensors.torch import load_file

        # load_file's tensors are views of a mapping, read when touched: copied out, as loading
        # them into a model does (the same as torch.load(mmap=True) above)
        return lambda: {"sd": {k: v.clone() for k, v in load_file(files["safetensors"]).items()}}
    if kind in ("runai", "runai-dist"):
        from runai_model_streamer import SafetensorsStreamer

        def go():
            sd = {}
            with SafetensorsStreamer() as streamer:
                streamer.stream_file(files["safetensors"], device="cpu", is_distributed=kind == "runai-dist")
                for name, t in streamer.get_tensors():
                    sd[name] = t
            return {"sd": sd}

        return go
    raise ValueError(kind)


def _worker(rank: int, world: int, store: str, kind: str, files: dict, dims: dict, out: str, env: dict) -> None:
    os.environ.update(env)
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=900))
    try:
        try:
            res = _measure(_prepare(kind, files, dims))
        except Exception as e:
            res = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:400],
                   "trace": traceback.format_exc()[-2000:]}
        with open(f"{out}.{rank}", "w") as f:
            json.dump(res, f)
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------- driving (the parent)


def _files_of(kind: str, files: dict) -> list:
    if kind.startswith("ours:"):
        src = kind.split(":")[1]
        return [files[src]] + (files["shards4_all"] if src == "shards4" else [])
    return {"dcp-full": [files["dcp"]], "dcp-fsdp2": [files["dcp"]], "safetensors": [files["safetensors"]],
            "runai": [files["safetensors"]], "runai-dist": [files["safetensors"]]}.get(kind, [files["single"]])


def run(ctx, kind: str, world: int, files: dict, dims: dict, tmp: str, env: dict) -> dict:
    drop_cache(_files_of(kind, files))
    store = os.path.join(tmp, f"store-{kind.replace(':', '_')}-{world}-{time.time_ns()}")
    out = store + ".out"
    procs = [ctx.Process(target=_worker, args=(r, world, store, kind, files, dims, out, env)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=1800)
    if any(p.exitcode for p in procs):
        for p in procs:
            if p.is_alive():
                p.kill()
        return {"error": f"exit codes {[p.exitcode for p in procs]}"}
    res = [json.load(open(f"{out}.{r}")) for r in range(world)]
    for r in range(world):
        os.remove(f"{out}.{r}")
    errors = [r["error"] for r in res if "error" in r]
    if errors:
        return {"error": errors[0], "trace": next(r["trace"] for r in res if "error" in r)}
    return {k: [r[k] for r in res] for k in ("extra", "seconds", "rchar", "read_bytes", "report")}


def _write_sources(tmp: str, gib: float) -> tuple:
    """(files, dims, model bytes) of one model size, written once."""
    import torch

    from bench._synth import metaseq_lm, model_shape, write_metaseq

    shape = model_shape(gib, dim=2048 if gib >= 0.25 else 512)  # width 2048 makes at least 0.27 GiB
    dims = dict(dim=shape["dim"], ffn=shape["ffn"], vocab=shape["vocab"], layers=shape["layers"],
                positions=shape["positions"] + 2)
    full = metaseq_lm(shape["layers"], shape["dim"], shape["ffn"], shape["vocab"], shape["positions"])
    model_bytes = sum(t.numel * 4 for t in full.values())
    single = os.path.join(tmp, "synth.pt")
    shards = [os.path.join(tmp, f"synth4-model_part-0-shard{d}.pt") for d in range(4)]
    files = {"single": single, "shards4": shards[0], "shards4_all": shards,
             "safetensors": os.path.join(tmp, "synth.safetensors"), "dcp": os.path.join(tmp, "synth_dcp")}
    if not os.path.exists(single):
        write_metaseq(os.path.join(tmp, "synth"), full)
        write_metaseq(os.path.join(tmp, "synth4"), full, shards=4)
    if not os.path.exists(files["safetensors"]) or not os.path.exists(files["dcp"] + ".shapes.json"):
        import torch.distributed.checkpoint as dcp
        from safetensors.torch import save_file

        sd = torch.load(single, map_location="cpu", mmap=True, weights_only=False)["model"]
        seen, unique = set(), {}
        for k, v in sd.items():  # safetensors refuses tensors that share memory: the tied copy goes
            if v.untyped_storage().data_ptr() not in seen:
                seen.add(v.untyped_storage().data_ptr())
                unique[k] = v.contiguous()
        save_file(unique, files["safetensors"])
        dcp.save(dict(sd), checkpoint_id=files["dcp"], no_dist=True)
        with open(files["dcp"] + ".shapes.json", "w") as f:
            json.dump({k: [list(v.shape), str(v.dtype).replace("torch.", "")] for k, v in sd.items()}, f)
        del sd, unique
    return files, dims, model_bytes


def _plan(strategies, sources, world: int, peers: bool) -> list:
    """(label, kind, env) of every run on ``world`` ranks."""
    plan = []
    for source in sources:
        for strategy in strategies:
            for flat in (True, False):
                # own_shard reads each rank's own saved file: only where the files match the world
                # (4 flat shards onto 4 flat ranks; a singleton on 1 rank), else it refuses
                if strategy == "own_shard" and not (source == "shards4" and world == 4 and flat) and \
                        not (source == "single" and world == 1):
                    continue
                plan.append((f"ours {strategy}", f"ours:{source}:{strategy}:{'flat' if flat else 'full'}", {}))
    if peers:
        plan += [
            ("every rank torch.load(mmap=False)", "torch.load", {}),
            ("every rank torch.load(mmap=True) + copy", "torch.load-mmap", {}),
            ("FSDP2 set_model_state_dict broadcast_from_rank0", "fsdp2-broadcast", {}),
            ("DCP load, full tensors on every rank", "dcp-full", {}),
            ("DCP load into FSDP2 shards", "dcp-fsdp2", {}),
            ("every rank safetensors load_file + copy", "safetensors", {}),
            ("Run:ai streamer, every rank", "runai", {"RUNAI_STREAMER_DIST": "0"}),
            ("Run:ai streamer, distributed (gloo)", "runai-dist", {"RUNAI_STREAMER_DIST": "1"}),
        ]
    return plan


def _source_of(kind: str) -> str:
    if kind.startswith("ours:"):
        src, flat = kind.split(":")[1], kind.split(":")[3]
        return {"single": "singleton", "shards4": "4 flat shards"}[src] + (", flat" if flat == "flat" else ", full")
    return {"dcp-full": "DCP folder", "dcp-fsdp2": "DCP folder", "safetensors": "safetensors",
            "runai": "safetensors", "runai-dist": "safetensors", "fsdp2-broadcast": "singleton -> FSDP2"}.get(kind, "singleton")


def _wants_whole(kind: str) -> bool:
    """Whether every rank ends up holding the whole model (memory W x B)."""
    if kind.startswith("ours:"):
        return kind.endswith(":full")
    return kind in ("torch.load", "torch.load-mmap", "dcp-full", "safetensors", "runai", "runai-dist")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, nargs="+", default=[0.25, 0.5, 1, 2], help="model sizes in GiB (fp32)")
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 3, 4])
    ap.add_argument("--strategies", help="comma-separated; default: every one in metaseq_oneload._options.STRATEGIES")
    ap.add_argument("--sources", default="single,shards4", help="comma-separated: single, shards4")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--only", help="comma-separated run kinds (e.g. torch.load,runai-dist,ours:single:parallel:full)")
    ap.add_argument("--mem-budget-gib", type=float, default=9.0,
                    help="skip runs whose peaks would sum to more (predicted from the same run at a smaller size)")
    ap.add_argument("--keep", help="write the checkpoints under this folder and keep them")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each kind; the fastest is reported")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--jsonl", help="also append every row to this file as it is measured")
    args = ap.parse_args(argv)

    from metaseq_oneload._options import STRATEGIES

    strategies = args.strategies.split(",") if args.strategies else list(STRATEGIES)
    sources = args.sources.split(",")
    only = set(args.only.split(",")) if args.only else None
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([m for m in _PRELOAD])
    rows, peaks = [], {}
    log = open(args.jsonl, "a") if args.jsonl else None
    root = args.keep or tempfile.mkdtemp(prefix="oneload-storage-", dir="/tmp")
    try:
        for gib in args.gib:
            tmp = os.path.join(root, f"{gib:g}gib")
            os.makedirs(tmp, exist_ok=True)
            t0 = time.perf_counter()
            files, dims, model_bytes = _write_sources(tmp, gib)
            print(f"  {gib:g} GiB: sources ready in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
            for world in args.worlds:
                for label, kind, env in _plan(strategies, sources, world, not args.no_peers):
                    if only and kind not in only:
                        continue
                    row = {"gib": gib, "model_bytes": model_bytes, "world": world, "run": label, "kind": kind,
                           "source": _source_of(kind)}
                    # The sum of peaks this run will reach, from what it reached at a smaller size
                    # (mapped pages and a streamer's buffers count too), else from what it must hold.
                    seen = peaks.get((kind, world))
                    predicted = model_bytes * (seen if seen is not None else (world if _wants_whole(kind) else 1.5))
                    if predicted > args.mem_budget_gib * 2**30:
                        row["error"] = (f"skipped: its peaks would sum to about {predicted / 2**30:.1f} GiB, over "
                                        f"--mem-budget-gib {args.mem_budget_gib:g}")
                    else:
                        # Best of --repeat runs by wall time (each cold): the first run after the
                        # files are written pays the disk's write-back on this machine.
                        tries = [run(ctx, kind, world, files, dims, root, env) for _ in range(args.repeat)]
                        ok = [t for t in tries if "error" not in t]
                        r = min(ok, key=lambda t: max(t["seconds"])) if ok else tries[0]
                        if ok:
                            row["walls"] = [round(max(t["seconds"]), 2) for t in ok]
                        if "error" in r:
                            row["error"] = r["error"]
                            print(r.get("trace", ""), file=sys.stderr)
                        else:
                            reps = [x for x in r["report"] if x]
                            row.update({
                                "rchar_x": round(sum(r["rchar"]) / model_bytes, 3),
                                "read_bytes_x": round(sum(r["read_bytes"]) / model_bytes, 3),
                                "peak_x": round(sum(r["extra"]) / model_bytes, 3),
                                "seconds": round(max(r["seconds"]), 2),
                                "rchar_per_rank_mib": [round(x / 2**20) for x in r["rchar"]],
                                "peak_per_rank_mib": [round(x / 2**20) for x in r["extra"]],
                            })
                            # the latest (largest) size: fixed costs (a bucket) weigh less as models grow
                            peaks[(kind, world)] = row["peak_x"]
                            if reps:
                                row["chose"] = reps[0]["strategy"]
                                row["engine_bytes_read_x"] = round(sum(x["bytes_read"] for x in reps) / model_bytes, 3)
                    rows.append(row)
                    if log:
                        log.write(json.dumps(row) + "\n")
                        log.flush()
                    print(f"  {gib:g} GiB W={world} {label} [{row['source']}]: "
                          + (row["error"] if "error" in row else
                             f"rchar {row['rchar_x']}x, read_bytes {row['read_bytes_x']}x, peak {row['peak_x']}x, "
                             f"{row['seconds']} s" + (f" (runs: {row['walls']})" if len(row.get("walls", ())) > 1
                                                      else "")), file=sys.stderr, flush=True)
            if not args.keep:
                shutil.rmtree(tmp, ignore_errors=True)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    import torch

    if args.json:
        print(json.dumps({"torch": torch.__version__, "cpus": os.cpu_count(), "rows": rows}, indent=2))
        return 0
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs; every run cold (page cache of its files dropped); "
          "rchar, read_bytes, peak: sums over ranks / model bytes; wall: slowest rank")
    header = ["GiB", "W", "run", "source", "chose", "rchar/B", "read_bytes/B", "peak/B", "wall s"]
    body = []
    for r in rows:
        if "error" in r:
            body.append([f"{r['gib']:g}", r["world"], r["run"], r["source"], "-", r["error"][:70], "", "", ""])
            continue
        body.append([f"{r['gib']:g}", r["world"], r["run"], r["source"], r.get("chose", "-"), f"{r['rchar_x']:.2f}x",
                     f"{r['read_bytes_x']:.2f}x", f"{r['peak_x']:.2f}x", f"{r['seconds']:.2f}"])
    widths = [max(len(str(x)) for x in col) for col in zip(header, *body)]
    for i, line in enumerate([header] + body):
        print("  ".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
