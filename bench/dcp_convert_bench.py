"""Benchmark: a consolidated fp32 metaseq checkpoint (one ``.pt``) to a
``torch.distributed.checkpoint`` folder.

Compares, each in a fresh process, peak resident memory and wall time of

* ``oneload convert --format dcp`` (streaming: each item's archive laid out with holes, its
  data streamed in chunk by chunk), one file (1 job) and 4 files (4 jobs);
* torch's own converter, ``torch.distributed.checkpoint.format_utils.torch_save_to_dcp``
  (``torch.load`` of the whole checkpoint, then ``dcp.save`` without a process group).

Peak RSS is ``VmHWM`` from ``/proc/self/status`` after resetting it through
``/proc/self/clear_refs`` once torch and the package are imported, so "above start" is what
the conversion itself added. The source file is in the page cache (written just before).
Afterwards every output is read back with ``dcp.load`` and compared with the source's weights.

    python bench/dcp_convert_bench.py              # ~0.5 GiB model, prints the table
    python bench/dcp_convert_bench.py --gib 1      # larger
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from bench._report import proc_status, reset_peak  # noqa: E402


def _measure(method: str, src: str, dst: str, files: int) -> dict:
    """Runs in a fresh process: one conversion, its time and peak RSS."""
    import torch  # noqa: F401
    import torch.distributed.checkpoint.format_utils as fu
    import metaseq_oneload._convert  # noqa: F401

    warnings.simplefilter("ignore")
    start = reset_peak()
    t0 = time.perf_counter()
    if method == "oneload":
        from metaseq_oneload._convert import convert

        convert(src, dst, format="dcp", shards=files, jobs=files, progress=False)
    else:
        fu.torch_save_to_dcp(src, dst)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "start": start, "peak": proc_status("VmHWM")}


def _run(method: str, src: str, dst: str, files: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--measure", method, "--src", src, "--dst", dst,
           "--files", str(files)]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"{method} failed:\n{r.stderr}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _check(folder: str, want: dict, prefix: str) -> bool:
    """torch's dcp.load of ``folder`` equals ``want`` (the source's weights) bit for bit."""
    import torch
    import torch.distributed.checkpoint as dcp

    sd = {prefix + k: torch.empty_like(v) for k, v in want.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, checkpoint_id=folder)
    return all(torch.equal(sd[prefix + k], v) for k, v in want.items())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=0.5, help="model size in GiB of fp32 weights (default 0.5)")
    ap.add_argument("--out", default=os.path.join(HERE, "out", "dcp_convert"), help="scratch folder")
    ap.add_argument("--repeat", type=int, default=2, help="runs of each method; the table shows the fastest")
    ap.add_argument("--keep", action="store_true", help="keep the files afterwards")
    ap.add_argument("--measure", help=argparse.SUPPRESS)
    ap.add_argument("--src", help=argparse.SUPPRESS)
    ap.add_argument("--dst", help=argparse.SUPPRESS)
    ap.add_argument("--files", type=int, default=1, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.measure:
        print(json.dumps(_measure(a.measure, a.src, a.dst, a.files)))
        return

    import torch

    from bench._synth import materialize, metaseq_lm, model_shape, write_metaseq
    from metaseq_oneload.cli import human_bytes, table

    shape = model_shape(a.gib)
    os.makedirs(a.out, exist_ok=True)
    src = os.path.join(a.out, "src", "checkpoint_last")
    os.makedirs(os.path.dirname(src), exist_ok=True)
    full = metaseq_lm(shape["layers"], shape["dim"], shape["ffn"], shape["vocab"], shape["positions"])
    numel = sum(t.numel for t in full.values())
    t0 = time.perf_counter()
    write_metaseq(src, full, shards=1, flat=False)
    print(f"model: {shape['layers']} layers, dim {shape['dim']}: {numel:,} fp32 params = {human_bytes(numel * 4)}; "
          f"one consolidated file written in {time.perf_counter() - t0:.1f} s", flush=True)

    runs = [("oneload convert --format dcp", "oneload", 1), ("oneload convert --format dcp", "oneload", 4),
            ("torch_save_to_dcp", "torch", 1)]
    best: dict = {}
    outs = {}
    for rep in range(a.repeat):  # interleaved, best of: the machine may be shared
        for label, method, files in runs:
            dst = os.path.join(a.out, f"{method}-{files}")
            shutil.rmtree(dst, ignore_errors=True)
            r = _run(method, src + ".pt", dst, files)
            outs[(method, files)] = dst
            key = (label, method, files)
            if key not in best or r["seconds"] < best[key]["seconds"]:
                best[key] = dict(r, peak=max(r["peak"], best.get(key, r)["peak"]))
            print(f"  run {rep + 1}: {label} ({files} file(s)): {r['seconds']:.1f} s, peak {human_bytes(r['peak'])}",
                  flush=True)
    rows = [[label, files if method == "oneload" else "1 (1 rank)", human_bytes(r["peak"]),
             human_bytes(r["peak"] - r["start"]), f"{r['seconds']:.1f} s"]
            for (label, method, files), r in best.items()]
    want = materialize(full)
    ok = {k: _check(d, want, "model." if k[0] == "torch" else "") for k, d in outs.items()}
    print()
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, source file in the page cache, "
          f"torch {torch.__version__}")
    print(table(rows, header=[f"{human_bytes(numel * 4)} .pt -> DCP", ".distcp files", "peak RSS", "above start",
                              f"time (best of {a.repeat})"]))
    print()
    print("check (dcp.load of each output vs the source's weights): "
          + ", ".join(f"{m}-{f}: {'bit-identical' if v else 'DIFFERENT'}" for (m, f), v in ok.items()))
    if not a.keep:
        shutil.rmtree(a.out, ignore_errors=True)


if __name__ == "__main__":
    main()
