"""A ``torch.distributed.checkpoint`` folder onto W ranks: ours against ``dcp.load``, side by side.

    .venv/bin/python bench/dcp_bench.py [--gib 1] [--world 4] [--sources fsdp2,single]
        [--storage local,s3] [--only KIND,...] [--repeat N] [--json] [--keep DIR]
    .venv/bin/python bench/dcp_bench.py --table ROWS.jsonl ...   # one table from earlier runs' rows

Every row is printed to stderr as one JSON line as it is measured.

The folder holds a synthetic fp32 decoder with metaseq's names (``bench/_synth.py``, the
shapes of ``tests/tiny_metaseq.py``'s model at width 2048) of about ``--gib`` GiB, written by
torch itself in two ways (``--sources``):

* ``fsdp2``: the model sharded with FSDP2 ``fully_shard`` on ``--world`` gloo ranks, every
  rank ``dcp.save(model.state_dict())``: one ``.distcp`` file per rank, row-block chunks (a
  training run's checkpoint);
* ``single``: ``dcp.save(state_dict, no_dist=True)`` in one process: one file, whole tensors
  (what ``torch_save_to_dcp`` or a rank-0 save gives).

Then, on ``--world`` ranks, each run in fresh processes (forked from a server that has only
imported the libraries), the targets:

* full weights on every rank: ours ``metaseq_oneload.load_state_dict(folder)`` against
  ``dcp.load`` into a state dict of empty full tensors;
* FSDP2 shards: ours ``metaseq_oneload.load_into(model, folder)`` on the model sharded on the
  meta device against ``dcp.load(get_model_state_dict(model))`` after ``to_empty``.

Storage (``--storage``): ``local`` (the folder under /tmp, its pages dropped from the page cache
before every run, as ``bench/storage_bytes.py`` does) and ``s3`` (the tests' S3 endpoint: moto on
127.0.0.1 behind the proxy of ``tests/s3_server.py``, which counts the body bytes it serves;
ours through its own fsspec storage, ``dcp.load`` through torch's ``FsspecReader``).

Columns, each over the checkpoint's bytes B (the ``.distcp`` files):

* ``served / B``: what the S3 proxy served during the run (its counters, reset before it),
  and ``GETs``, the requests it relayed (the JSON rows of ours also give ours' own count,
  ``requests``, stats and lists included, and ``retries``);
* ``rchar / B``: read-type calls of every rank (``/proc/self/io``), local storage: what a
  shared filesystem would serve;
* ``read_bytes / B``: what the block device served, cold (all ranks share this machine's page
  cache, so this is a lower bound where ranks read the same bytes);
* ``peak / B``: the sum over ranks of the peak RSS above the RSS before the load (and the
  largest rank's);
* ``wall s``: the slowest rank, between barriers.
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

from bench._report import drop_cache, measure_rank, print_table  # noqa: E402

_PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.fsdp",
            "torch.distributed.checkpoint.state_dict", "metaseq_oneload", "metaseq_oneload._loading"]

KINDS = {  # kind: (target, loader)
    "ours-full": ("full weights on every rank", "ours: load_state_dict"),
    "dcp-full": ("full weights on every rank", "dcp.load"),
    "ours-fsdp2": ("FSDP2 shards", "ours: load_into"),
    "dcp-fsdp2": ("FSDP2 shards", "dcp.load"),
}


# --------------------------------------------------------------------------- in a rank


def _fsdp2_model(dims):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from tests.tiny_metaseq import sharded_on_meta

    return sharded_on_meta(init_device_mesh("cpu", (dist.get_world_size(),)), **dims)


def _dcp_reader(path: str):
    """torch's reader for the folder: FileSystemReader, or FsspecReader at the S3 proxy."""
    import torch.distributed.checkpoint as dcp

    if not path.startswith("s3://"):
        return dcp.FileSystemReader(path)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    s3 = json.loads(os.environ["METASEQ_ONELOAD_STORAGE_OPTIONS"])["s3"]
    return FsspecReader(path, endpoint_url=s3["endpoint_url"], key=os.environ["AWS_ACCESS_KEY_ID"],
                        secret=os.environ["AWS_SECRET_ACCESS_KEY"])


def _prepare(kind: str, path: str, shapes: dict, dims: dict):
    """The load to time, as a function of nothing: a module on meta, imports and the
    empty tensors' shapes are ready before the clock starts."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import metaseq_oneload as oneload

    group = dist.group.WORLD
    if kind == "ours-full":
        def go():
            r = oneload.load_checkpoint(path, process_group=group)
            return {"sd": r.model, "report": {"strategy": r.report.strategy, "bytes_read": r.report.bytes_read}}

        return go
    if kind == "dcp-full":
        def go():
            sd = {k: torch.empty(shape, dtype=getattr(torch, dt)) for k, (shape, dt) in shapes.items()}
            dcp.load(sd, storage_reader=_dcp_reader(path), process_group=group)
            return {"sd": sd}

        return go
    model = _fsdp2_model(dims)
    if kind == "ours-fsdp2":
        def go():
            r = oneload.load_into(model, path, process_group=group)
            return {"model": model, "report": {"strategy": r.strategy, "bytes_read": r.bytes_read}}

        return go
    if kind == "dcp-fsdp2":
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        def go():
            model.to_empty(device="cpu")
            dcp.load(get_model_state_dict(model), storage_reader=_dcp_reader(path), process_group=group)
            return {"model": model}

        return go
    raise ValueError(kind)


def _checksum(kind: str, keep) -> float:
    """A sum over what this rank holds (a DTensor's local shard), to compare the loaders."""
    import torch

    if kind.endswith("fsdp2"):
        tensors = [getattr(v, "_local_tensor", v) for v in keep["model"].state_dict().values()]
    else:
        tensors = list(keep["sd"].values())
    return float(sum(t.double().sum() for t in tensors if torch.is_tensor(t)))


def _worker(rank, world, store, kind, path, shapes, dims, out, env) -> None:
    os.environ.update(env)
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=1800))
    try:
        try:
            held = {}

            def timed(go=_prepare(kind, path, shapes, dims)):
                held["keep"] = go()
                return held["keep"]

            from metaseq_oneload import _storage

            _storage.reset_stats()
            res = measure_rank(timed)
            # ours only: its requests as it counts them (a retry is a request again)
            res["remote"] = _storage.stats() if kind.startswith("ours") else None
            res["checksum"] = _checksum(kind, held.pop("keep"))
        except Exception as e:
            res = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:400],
                   "trace": traceback.format_exc()[-2000:]}
        with open(f"{out}.{rank}", "w") as f:
            json.dump(res, f)
    finally:
        dist.destroy_process_group()


def _save_fsdp2(rank, world, store, single, folder, dims) -> None:
    """(every rank) The model sharded with FSDP2, filled from the singleton, ``dcp.save``-d."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        model = _fsdp2_model(dims)
        model.to_empty(device="cpu")
        full = torch.load(single, map_location="cpu", mmap=True, weights_only=False)["model"]
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True))
        del full
        dcp.save(model.state_dict(), checkpoint_id=folder)
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------- the parent


def _write_sources(tmp: str, gib: float, world: int, sources: list) -> tuple:
    """(folders by source, shapes, dims): the singleton first (bench/_synth.py), then each
    DCP folder written from it by torch."""
    import torch
    import torch.distributed.checkpoint as dcp

    from bench._synth import metaseq_lm, model_shape, write_metaseq

    shape = model_shape(gib, dim=2048 if gib >= 0.25 else 512)
    dims = dict(dim=shape["dim"], ffn=shape["ffn"], vocab=shape["vocab"], layers=shape["layers"],
                positions=shape["positions"] + 2)
    single = os.path.join(tmp, "synth.pt")
    if not os.path.exists(single):
        write_metaseq(os.path.join(tmp, "synth"),
                      metaseq_lm(shape["layers"], shape["dim"], shape["ffn"], shape["vocab"], shape["positions"]))
    sd = torch.load(single, map_location="cpu", mmap=True, weights_only=False)["model"]
    shapes = {k: [list(v.shape), str(v.dtype).replace("torch.", "")] for k, v in sd.items()}
    folders = {}
    for source in sources:
        folder = folders[source] = os.path.join(tmp, f"dcp_{source}")
        if os.path.exists(os.path.join(folder, ".metadata")):
            continue
        if source == "single":
            dcp.save(dict(sd), checkpoint_id=folder, no_dist=True)
        else:
            ctx = multiprocessing.get_context("spawn")
            store = os.path.join(tmp, f"store-save-{time.time_ns()}")
            procs = [ctx.Process(target=_save_fsdp2, args=(r, world, store, single, folder, dims)) for r in range(world)]
            for p in procs:
                p.start()
            for p in procs:
                p.join()
            if any(p.exitcode for p in procs):
                raise RuntimeError(f"writing the fsdp2 source failed: exit codes {[p.exitcode for p in procs]}")
    del sd
    os.remove(single)
    return folders, shapes, dims


def _bytes_of(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder) if n.endswith(".distcp"))


def run(ctx, kind, world, path, local, shapes, dims, tmp, env, proxy) -> dict:
    if proxy:
        from tests.s3_server import proxy_control

        proxy_control(proxy, "reset")
    else:
        drop_cache([local])
    store = os.path.join(tmp, f"store-{kind}-{world}-{time.time_ns()}")
    out = store + ".out"
    procs = [ctx.Process(target=_worker, args=(r, world, store, kind, path, shapes, dims, out, env))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=3600)
    served = proxy_control(proxy, "counters") if proxy else None
    if any(p.exitcode for p in procs):
        for p in procs:
            if p.is_alive():
                p.kill()
        return {"error": f"exit codes {[p.exitcode for p in procs]}"}
    res = [json.load(open(f"{out}.{r}")) for r in range(world)]
    for r in range(world):
        os.remove(f"{out}.{r}")
    errors = [r for r in res if "error" in r]
    if errors:
        return {"error": errors[0]["error"], "trace": errors[0]["trace"]}
    out = {k: [r[k] for r in res] for k in ("extra", "seconds", "rchar", "read_bytes", "report", "checksum", "remote")}
    out["served"] = served
    return out


def _row(r: dict, base: dict, nbytes: int, storage: str) -> dict:
    row = dict(base)
    if "error" in r:
        row["error"] = r["error"]
        return row
    row.update({"peak_x": round(sum(r["extra"]) / nbytes, 3), "max_peak_x": round(max(r["extra"]) / nbytes, 3),
                "seconds": round(max(r["seconds"]), 2), "checksums": r["checksum"]})
    if storage == "s3":
        row.update({"served_x": round(r["served"]["body_bytes"] / nbytes, 3), "gets": r["served"]["gets"]})
        if all(r["remote"]):
            row.update({k: sum(x[k] for x in r["remote"]) for k in ("requests", "retries")})
    else:
        row.update({"rchar_x": round(sum(r["rchar"]) / nbytes, 3), "read_bytes_x": round(sum(r["read_bytes"]) / nbytes, 3)})
    reps = [x for x in r["report"] if x]
    if reps:
        row["strategy"] = reps[0]["strategy"]
    return row


def _table(rows: list) -> None:
    """One line per (source, target, loader): local and S3 columns side by side."""
    merged = {}
    for r in rows:
        m = merged.setdefault((r["gib"], r["source"], r["kind"]), {**r})
        m.update({f"{k}@{r['storage']}": v for k, v in r.items() if k in ("seconds", "peak_x", "error", "max_peak_x")})
        m.update({k: v for k, v in r.items() if k in ("served_x", "gets", "rchar_x", "read_bytes_x")})
        if "strategy" in r:
            m[f"strategy@{r['storage']}"] = r["strategy"]

    def cell(m, k, fmt="{:.2f}x"):
        return fmt.format(m[k]) if k in m else "-"

    header = ["GiB", "saved by", "target", "loader", "S3 served / B", "S3 GETs", "rchar / B", "read_bytes / B (cold)",
              "sum of peaks / B", "max peak / B", "wall s local", "wall s S3"]
    body = []
    for (gib, source, kind), m in merged.items():
        target, loader = KINDS[kind]
        chose = [f"{m[f'strategy@{st}']}{' on S3' if st == 's3' else ''}" for st in ("local", "s3")
                 if f"strategy@{st}" in m]
        if chose:
            loader += f" ({', '.join(chose)})"
        err = m.get("error@local") or m.get("error@s3")
        peak_of = "local" if "peak_x@local" in m else "s3"
        body.append([f"{gib:g}", source, target, loader, cell(m, "served_x"), cell(m, "gets", "{}"), cell(m, "rchar_x"),
                     cell(m, "read_bytes_x"), cell(m, f"peak_x@{peak_of}"), cell(m, f"max_peak_x@{peak_of}"),
                     cell(m, "seconds@local", "{:.2f}"), cell(m, "seconds@s3", "{:.2f}")]
                    + ([f"error: {err}"] if err else []))
    print_table(header, body)
    for (gib, source, kind), m in merged.items():
        other = merged.get((gib, source, kind.replace("ours", "dcp")))
        if kind.startswith("ours") and other and "checksums" in m and "checksums" in other:
            same = m["checksums"] == other["checksums"]
            print(f"{gib:g} GiB {source} {KINDS[kind][0]}: per-rank checksums of ours and dcp.load "
                  + ("agree" if same else f"DIFFER: {m['checksums']} vs {other['checksums']}"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, nargs="+", default=[1.0], help="model sizes in GiB (fp32)")
    ap.add_argument("--world", type=int, default=4, help="ranks that load (and that write the fsdp2 source)")
    ap.add_argument("--sources", default="fsdp2,single", help="comma-separated: fsdp2, single")
    ap.add_argument("--storage", default="local,s3", help="comma-separated: local, s3 (needs moto[server], s3fs)")
    ap.add_argument("--only", help="comma-separated kinds: " + ",".join(KINDS))
    ap.add_argument("--repeat", type=int, default=1, help="runs of each kind; the fastest is reported")
    ap.add_argument("--keep", help="write the checkpoints under this folder and keep them")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--table", nargs="+", metavar="ROWS",
                    help="print the table of rows saved from earlier runs (their stderr JSON lines; a later "
                         "row of the same gib, source, storage and kind replaces an earlier one) and exit")
    args = ap.parse_args(argv)
    if args.table:
        rows = {}
        for name in args.table:
            for line in open(name):
                if line.strip().startswith('{"gib"'):
                    r = json.loads(line)
                    rows[(r["gib"], r["source"], r["storage"], r["kind"])] = r
        _table(sorted(rows.values(), key=lambda r: (r["gib"], r["source"] != "fsdp2", list(KINDS).index(r["kind"]))))
        return 0
    sources, storages = args.sources.split(","), args.storage.split(",")
    kinds = args.only.split(",") if args.only else list(KINDS)
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    root = args.keep or tempfile.mkdtemp(prefix="oneload-dcp-bench-", dir="/tmp")
    rows, endpoint = [], None
    try:
        if "s3" in storages:
            from tests.s3_server import S3Endpoint

            endpoint = S3Endpoint()
        for gib in args.gib:
            tmp = os.path.join(root, f"{gib:g}gib")
            os.makedirs(tmp, exist_ok=True)
            t0 = time.perf_counter()
            folders, shapes, dims = _write_sources(tmp, gib, args.world, sources)
            print(f"  {gib:g} GiB: sources ready in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
            for source, folder in folders.items():
                nbytes = _bytes_of(folder)
                for storage in storages:
                    path, env, proxy = folder, {}, None
                    if storage == "s3":
                        path = endpoint.upload(folder, "bench", f"{gib:g}gib/{source}")
                        env, proxy = endpoint.env(), endpoint.url
                    for kind in kinds:
                        base = {"gib": gib, "world": args.world, "source": source, "storage": storage, "kind": kind,
                                "checkpoint_bytes": nbytes}
                        tries = [run(ctx, kind, args.world, path, folder, shapes, dims, root, env, proxy)
                                 for _ in range(args.repeat)]
                        ok = [t for t in tries if "error" not in t]
                        if not ok:
                            print(tries[0].get("trace", ""), file=sys.stderr)
                        row = _row(min(ok, key=lambda t: max(t["seconds"])) if ok else tries[0], base, nbytes, storage)
                        rows.append(row)
                        print(f"  {json.dumps(row)}", file=sys.stderr, flush=True)
            if not args.keep:
                shutil.rmtree(tmp, ignore_errors=True)
    finally:
        if endpoint is not None:
            endpoint.stop()
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        _table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
