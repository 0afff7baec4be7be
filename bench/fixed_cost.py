"""The fixed cost of a small load: what one ``load_state_dict`` costs beyond reading its bytes.

    .venv/bin/python bench/fixed_cost.py [--runs 5] [--mib 8] [--kinds singleton,flat,dcp] [--keep DIR]
                                         [--baseline DIR] [--json]

Writes a tiny synthetic fp32 model with metaseq's names (``bench/_synth.py``, about ``--mib``
MiB) three ways: a metaseq singleton (``torch.save``), one flat FSDP shard with its
``shard_metadata``, and a ``torch.distributed.checkpoint`` folder (``dcp.save(no_dist=True)``).
For each, in a fresh process per run that has already imported torch, ``metaseq_oneload``
and ``torch.distributed.checkpoint`` (imports before the clock, as ``bench/read_bandwidth.py``
does), it times:

* ``load_state_dict(path, no_dist=True)``, and its stages, read from timers put around the
  engine's own steps (``_engine``'s module-level names; nothing the load computes changes):
  ``discover`` (find the files, read the headers), ``agree`` (the check-in and the agreement
  steps, no collectives here), ``targets`` (plan the targets, build the wants), ``plan`` (who
  reads what), ``execute`` (the reads), and ``other`` (the rest of the call);
* ``torch.load(path, mmap=False)`` of the same file (``dcp.load(no_dist=True)`` into a
  state dict of empty tensors for the folder);
* ``preadv`` of the checkpoint's bytes (every file of it) into one freshly allocated buffer:
  the read limit. ``fixed`` = the load's median minus this median;
* ``first``: the load again in a process that has imported torch only, the clock started
  before ``import metaseq_oneload``: what a script's first load costs, imports included
  (from bytecode, as an installed wheel has it: the runs share a ``PYTHONPYCACHEPREFIX``
  folder, filled by a run before the rounds).

``--baseline DIR`` also times the load with the package found in ``DIR`` (``DIR/metaseq_oneload``,
e.g. ``git archive HEAD metaseq_oneload | tar -x -C DIR``), in the same rounds: before and
after a change, on the same machine at the same time. Modes alternate within each round; the table gives the median and the best of the runs, in
milliseconds. The files stay in the page cache (warm): the fixed cost is what a load pays
whatever the storage.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.append(os.path.dirname(HERE))  # after PYTHONPATH: --baseline puts its package first

from bench._report import print_table  # noqa: E402

KINDS = ("singleton", "flat", "dcp")
MODES = ("engine", "torch", "preadv", "first")
STAGES = {"discover": ("discover", "_discover_once"), "agree": ("arrive", "_agree_options", "_agree_checkpoint"),
          "targets": ("_targets_and_wants",), "plan": ("_plan",), "execute": ("execute",)}


def _files(path: str) -> list:
    if os.path.isdir(path):
        return sorted(os.path.join(path, n) for n in os.listdir(path) if not n.startswith("."))
    return [path]


def _timed_stages(engine) -> dict:
    """Timers around the engine's steps, by stage; returns the dict they add to."""
    spent = {s: 0.0 for s in STAGES}

    def wrap(stage, f):
        @functools.wraps(f)
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                spent[stage] += time.perf_counter() - t0
        return timed

    for stage, names in STAGES.items():
        for name in names:
            setattr(engine, name, wrap(stage, getattr(engine, name)))
    return spent


def _child(mode: str, kind: str, path: str) -> dict:
    """(in a fresh process) One timed run; milliseconds."""
    import ctypes
    import gc

    import torch

    # Importing torch leaves a full collection due (about 90 ms here, tens of thousands of
    # objects young enough to count): whatever allocates next pays it, the package's import,
    # a load or torch.load alike. A script has long paid it by its first load; so do these.
    gc.collect()
    if mode == "first":  # the clock before the package's import
        t0 = time.perf_counter()
        import metaseq_oneload as oneload

        sd = oneload.load_state_dict(path, no_dist=True)
        return {"ms": (time.perf_counter() - t0) * 1e3}
    import metaseq_oneload as oneload
    from metaseq_oneload import _engine

    oneload.load_state_dict  # imports before the clock starts (the engine's modules)
    if kind == "dcp" and mode == "torch":
        import torch.distributed.checkpoint as dcp
    gc.collect()
    out: dict = {}
    if mode == "engine":
        spent = _timed_stages(_engine)
        t0 = time.perf_counter()
        sd = oneload.load_state_dict(path, no_dist=True)
        out["ms"] = (time.perf_counter() - t0) * 1e3
        out.update({k: v * 1e3 for k, v in spent.items()})
        out["other"] = out["ms"] - sum(spent.values()) * 1e3
        out["bytes"] = sum(t.numel() * t.element_size() for t in sd.values())
    elif mode == "torch" and kind == "dcp":
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        t0 = time.perf_counter()
        meta = dcp.FileSystemReader(path).read_metadata()
        sd = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.state_dict_metadata.items()
              if isinstance(m, TensorStorageMetadata)}
        dcp.load(sd, checkpoint_id=path, no_dist=True)
        out["ms"] = (time.perf_counter() - t0) * 1e3
    elif mode == "torch":
        t0 = time.perf_counter()
        sd = torch.load(path, map_location="cpu", weights_only=False, mmap=False)  # our own file
        out["ms"] = (time.perf_counter() - t0) * 1e3
    elif mode == "preadv":
        files = _files(path)
        t0 = time.perf_counter()
        size = sum(os.path.getsize(f) for f in files)
        buf = torch.empty(size, dtype=torch.uint8)
        view = memoryview((ctypes.c_char * size).from_address(buf.data_ptr())).cast("B")
        base = 0
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            try:
                end, done = base + os.fstat(fd).st_size, 0
                while base + done < end:
                    n = os.preadv(fd, [view[base + done:end]], done)
                    if n <= 0:
                        raise RuntimeError(f"short read of {f}")
                    done += n
                base = end
            finally:
                os.close(fd)
        out["ms"] = (time.perf_counter() - t0) * 1e3
    else:
        raise ValueError(mode)
    return out


def _run(mode: str, kind: str, path: str, baseline: Optional[str] = None) -> dict:
    env = {**os.environ, "PYTHONWARNINGS": "ignore",
           "PYTHONPYCACHEPREFIX": os.path.join(tempfile.gettempdir(), "oneload-bench-pyc")}
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # an installed package imports from bytecode
    if mode.startswith("baseline"):
        mode = "first" if mode == "baseline_first" else "engine"
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [baseline, env.get("PYTHONPATH")]))
    res = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", mode, kind, path],
                         capture_output=True, text=True, env=env)
    if res.returncode:
        raise RuntimeError(f"{mode} {kind} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def _write(tmp: str, kinds, mib: float) -> dict:
    """The checkpoints, by kind (written once; reused from ``--keep``)."""
    import torch  # noqa: F401
    import torch.distributed.checkpoint as dcp

    from bench._synth import materialize, metaseq_lm, write_metaseq

    # 2 layers of width 256 (ffn 1024, 512 positions) and a vocabulary that makes up the size.
    dim, layers = 256, 2
    per_layer = (4 * dim * dim + 2 * dim * 1024 + 9 * dim + 1024) * 4
    vocab = max(64, int((mib * 2**20 - layers * per_layer) / (4 * dim)) - 514)
    full = metaseq_lm(layers, dim, 1024, vocab, 512)
    paths = {"singleton": os.path.join(tmp, "single.pt"), "flat": os.path.join(tmp, "flat-model_part-0-shard0.pt"),
             "dcp": os.path.join(tmp, "dcp")}
    if "singleton" in kinds and not os.path.exists(paths["singleton"]):
        write_metaseq(os.path.join(tmp, "single"), full)
    if "flat" in kinds and not os.path.exists(paths["flat"]):
        write_metaseq(os.path.join(tmp, "flat"), full, shards=1, flat=True)
    if "dcp" in kinds and not os.path.exists(paths["dcp"]):
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
            dcp.save(dict(materialize(full)), checkpoint_id=paths["dcp"], no_dist=True)
    return {k: paths[k] for k in kinds}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5, help="fresh processes per mode and kind")
    ap.add_argument("--mib", type=float, default=8.0, help="checkpoint size in MiB (fp32)")
    ap.add_argument("--kinds", default=",".join(KINDS), help="singleton, flat, dcp")
    ap.add_argument("--keep", help="write the checkpoints here and keep them")
    ap.add_argument("--baseline", help="a folder holding another metaseq_oneload package to time beside this one")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(_child(*args.child)))
        return 0
    import torch

    kinds = [k for k in args.kinds.split(",") if k]
    modes = MODES + (("baseline", "baseline_first") if args.baseline else ())
    tmp = args.keep or tempfile.mkdtemp(prefix="oneload-fixed-", dir="/tmp")
    os.makedirs(tmp, exist_ok=True)
    results: dict = {}
    try:
        paths = _write(tmp, kinds, args.mib)
        for kind, path in paths.items():
            _run("preadv", kind, path)  # the files in the page cache
            for mode in ("first", "baseline_first")[:1 + bool(args.baseline)]:
                _run(mode, kind, path, args.baseline)  # the bytecode written
        for rnd in range(args.runs):
            for kind, path in paths.items():
                for mode in modes:
                    results.setdefault((kind, mode), []).append(_run(mode, kind, path, args.baseline))
            print(f"  round {rnd + 1} of {args.runs}", file=sys.stderr)
        sizes = {k: sum(os.path.getsize(f) for f in _files(p)) for k, p in paths.items()}
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)

    def med(kind, mode, key="ms"):
        return statistics.median(r[key] for r in results[(kind, mode)])

    def best(kind, mode):
        return min(r["ms"] for r in results[(kind, mode)])

    rows = []
    for kind in kinds:
        row = {"kind": kind, "mib": round(sizes[kind] / 2**20, 1)}
        for mode in modes:
            row[mode] = round(med(kind, mode), 1)
            row[mode + "_best"] = round(best(kind, mode), 1)
        row["fixed"] = round(row["engine"] - row["preadv"], 1)
        row["stages"] = {s: round(med(kind, "engine", s), 1) for s in list(STAGES) + ["other"]}
        row["first_fixed"] = round(row["first"] - row["preadv"], 1)
        if args.baseline:
            row["baseline_first_fixed"] = round(row["baseline_first"] - row["preadv"], 1)
            row["baseline_fixed"] = round(row["baseline"] - row["preadv"], 1)
            row["baseline_stages"] = {s: round(med(kind, "baseline", s), 1) for s in list(STAGES) + ["other"]}
        rows.append(row)
    meta = {"runs": args.runs, "torch": torch.__version__, "cpus": os.cpu_count()}
    if args.json:
        print(json.dumps({**meta, "rows": rows}, indent=2))
        return 0
    print(f"warm page cache, median (best) of {args.runs} fresh processes each, ms; torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs; fixed = load - preadv (medians); stages: medians of the load's steps")
    header = ["checkpoint", "MiB", "load", "torch", "preadv", "fixed"] + list(STAGES) + ["other", "first", "first fixed"]
    body = [[r["kind"], f"{r['mib']:.1f}"] + [f"{r[m]:.1f} ({r[m + '_best']:.1f})" for m in ("engine", "torch", "preadv")]
            + [f"{r['fixed']:.1f}"] + [f"{r['stages'][s]:.1f}" for s in list(STAGES) + ["other"]]
            + [f"{r['first']:.1f} ({r['first_best']:.1f})", f"{r['first_fixed']:.1f}"] for r in rows]
    if args.baseline:
        header += ["baseline load", "baseline fixed", "baseline first", "baseline first fixed"]
        for b, r in zip(body, rows):
            b += [f"{r['baseline']:.1f} ({r['baseline_best']:.1f})", f"{r['baseline_fixed']:.1f}",
                  f"{r['baseline_first']:.1f} ({r['baseline_first_best']:.1f})", f"{r['baseline_first_fixed']:.1f}"]
    print_table(header, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
