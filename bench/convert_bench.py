"""Benchmark: reshard a ~1 GiB fp32 metaseq checkpoint from 4 flat FSDP shards to 3.

Compares, each in a fresh process, peak resident memory and wall time of

* ``oneload convert`` (streaming: byte ranges in, ``pwrite`` out, one chunk per job), with
  1 job and with one job per CPU;
* metaseq-style "load everything": ``torch.load`` every shard, concatenate each flat
  parameter without its padding, ``torch.chunk`` it into 3, pad, ``torch.save`` (what
  ``metaseq.scripts.reshard_fsdp`` does, re-implemented here).

Peak RSS is ``VmHWM`` from ``/proc/self/status`` after resetting it through
``/proc/self/clear_refs`` once torch is imported, so the "above start" column is what the
operation itself added. The source files are in the page cache (written just before).

    python bench/convert_bench.py                 # ~1 GiB model, prints the table
    python bench/convert_bench.py --gib 0.25      # smaller, quicker
    python bench/convert_bench.py --repeat 3      # best of 3 runs of each (default 2)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from bench._report import proc_status, reset_peak  # noqa: E402


def _measure(method: str, src: str, dst: str, jobs: int) -> dict:
    """Runs in a fresh process: one conversion, its time and peak RSS."""
    # Imported before the reset, so that the baseline includes them.
    import torch  # noqa: F401
    import metaseq_oneload._convert  # noqa: F401

    start = reset_peak()
    t0 = time.perf_counter()
    if method in ("oneload", "oneload-nodigest"):
        from metaseq_oneload._convert import convert

        if method == "oneload-nodigest":  # what recording the digests costs: the same run, nothing hashed
            from metaseq_oneload._digest_record import WriteDigests

            WriteDigests.tap = lambda self, part, shard=0: (lambda item, data: None)
            WriteDigests.stored_digests = lambda self: {}
            WriteDigests.canonical_digests = lambda self: None
        convert(src, dst, shards=3, jobs=jobs, overwrite=True, progress=False)
    else:
        _metaseq_style(src, dst)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "start": start, "peak": proc_status("VmHWM")}


def _metaseq_style(src_prefix: str, dst_prefix: str, n: int = 3) -> None:
    """Load every shard, rebuild each flat param, re-chunk it into ``n`` padded shards."""
    import copy
    import glob

    import torch
    import torch.nn.functional as F

    files = sorted(glob.glob(src_prefix[: -len(".pt")] + "-model_part-0-shard*.pt"))
    shards = [torch.load(f, map_location="cpu", weights_only=False) for f in files]
    outs = [{k: v for k, v in shards[0].items() if k not in ("model", "shard_metadata", "last_optimizer_state")}
            for _ in range(n)]
    for o in outs:
        o["model"] = {}
        o["shard_metadata"] = copy.deepcopy(shards[0]["shard_metadata"])
    for i, pm in enumerate(shards[0]["shard_metadata"]["param_metadata"]):
        for flat_name in pm["params"]:
            key = f"{pm['fsdp_path']}.{flat_name}" if pm["fsdp_path"] else flat_name
            pieces = []
            for s in shards:
                pad = s["shard_metadata"]["param_metadata"][i]["params"][flat_name]["padding"]
                t = s["model"][key]
                pieces.append(t[: t.numel() - pad])
            full = torch.cat(pieces)
            chunks = [c.clone() for c in full.chunk(n)]
            while len(chunks) < n:
                chunks.append(full.new_empty(0))
            size = chunks[0].numel()
            for d, c in enumerate(chunks):
                outs[d]["model"][key] = F.pad(c, [0, size - c.numel()])
                outs[d]["shard_metadata"]["param_metadata"][i]["params"][flat_name]["padding"] = size - c.numel()
            del full, chunks, pieces
    for name in shards[0]["shard_metadata"]["buffer_names"]:
        for o in outs:
            o["model"][name] = shards[0]["model"][name]
    for d, o in enumerate(outs):
        torch.save(o, f"{dst_prefix}-model_part-0-shard{d}.pt")


def _run(method: str, src: str, dst: str, jobs: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--measure", method, "--src", src, "--dst", dst,
           "--jobs", str(jobs)]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"{method} failed:\n{r.stderr}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="model size in GiB of fp32 weights (default 1)")
    ap.add_argument("--out", default=os.path.join(HERE, "out", "convert"), help="scratch folder")
    ap.add_argument("--keep", action="store_true", help="keep the files afterwards")
    ap.add_argument("--repeat", type=int, default=2, help="runs of each method; the table shows the fastest")
    ap.add_argument("--digest-cost", action="store_true",
                    help="also run convert without hashing the digests it records (their cost)")
    ap.add_argument("--measure", help=argparse.SUPPRESS)
    ap.add_argument("--src", help=argparse.SUPPRESS)
    ap.add_argument("--dst", help=argparse.SUPPRESS)
    ap.add_argument("--jobs", type=int, default=1, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.measure:
        print(json.dumps(_measure(a.measure, a.src, a.dst, a.jobs)))
        return

    from bench._synth import metaseq_lm, model_shape, write_metaseq
    from metaseq_oneload._convert import verify
    from metaseq_oneload.cli import human_bytes, table

    shape = model_shape(a.gib)
    os.makedirs(a.out, exist_ok=True)
    src = os.path.join(a.out, "src", "checkpoint_last")
    os.makedirs(os.path.dirname(src), exist_ok=True)
    full = metaseq_lm(shape["layers"], shape["dim"], shape["ffn"], shape["vocab"], shape["positions"])
    numel = sum(t.numel for t in full.values())
    largest = max(sum(t.numel for n, t in full.items() if n.startswith(f"decoder.layers.{i}.")) for i in range(shape["layers"]))
    t0 = time.perf_counter()
    write_metaseq(src, full, shards=4)
    gen = time.perf_counter() - t0
    print(f"model: {shape['layers']} layers, dim {shape['dim']}, ffn {shape['ffn']}, vocab {shape['vocab']}: "
          f"{numel:,} fp32 params = {human_bytes(numel * 4)}; largest flat param (one layer) "
          f"{human_bytes(largest * 4)}; written as 4 flat shards in {gen:.1f} s", flush=True)

    cpus = os.cpu_count() or 1
    runs = [("oneload convert", "oneload", 1), ("oneload convert", "oneload", cpus),
            ("metaseq-style load-all", "metaseq", 1)]
    if a.digest_cost:
        runs[2:2] = [("oneload convert, no digests", "oneload-nodigest", 1),
                     ("oneload convert, no digests", "oneload-nodigest", cpus)]
    best: dict = {}
    results = {}
    for rep in range(a.repeat):  # interleaved, best of: the machine may be shared
        for label, method, jobs in runs:
            dst = os.path.join(a.out, f"{method}-j{jobs}", "checkpoint_last")
            shutil.rmtree(os.path.dirname(dst), ignore_errors=True)
            os.makedirs(os.path.dirname(dst))
            r = _run(method, src + ".pt", dst, jobs)
            results[(method, jobs)] = dst + ".pt"
            key = (label, method, jobs)
            if key not in best or r["seconds"] < best[key]["seconds"]:
                best[key] = dict(r, peak=max(r["peak"], best.get(key, r)["peak"]))
            print(f"  run {rep + 1}: {label} (jobs={jobs}): {r['seconds']:.1f} s, peak {human_bytes(r['peak'])}",
                  flush=True)
    rows = [[label, jobs if method.startswith("oneload") else "-", human_bytes(r["peak"]), human_bytes(r["peak"] - r["start"]),
             f"{r['seconds']:.1f} s"] for (label, method, jobs), r in best.items()]
    t0 = time.perf_counter()
    v1 = verify(results[("oneload", cpus)], src + ".pt", atol=0, rtol=0, progress=False)
    v2 = verify(results[("oneload", cpus)], results[("metaseq", 1)], atol=0, rtol=0, progress=False)
    check = time.perf_counter() - t0
    print()
    print(f"{cpus} CPUs, load average {os.getloadavg()[0]:.1f}, source files in the page cache")
    print(table(rows, header=["4 -> 3 shards", "jobs", "peak RSS", "above start", f"time (best of {a.repeat})"]))
    print()
    print(f"check (verify, {check:.1f} s): oneload output vs source: "
          f"{'bit-identical' if v1.identical else 'DIFFERENT'}; vs metaseq-style output: "
          f"{'bit-identical' if v2.identical else 'DIFFERENT'}")
    if not a.keep:
        shutil.rmtree(a.out, ignore_errors=True)


if __name__ == "__main__":
    main()
