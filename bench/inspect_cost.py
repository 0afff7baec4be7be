"""Discovery reads metadata, not tensor data: inspecting ~2 GB of shards costs about what
~2 MB does.

    .venv/bin/python bench/inspect_cost.py [--big-gib 2.0] [--repeat 5]

Writes two sets of 4 flat FSDP shards in metaseq's format (~2 MB and ~2 GB in all), then
times ``metaseq_oneload.inspect`` on each in fresh processes (no warm header cache; imports
done before the clock starts) and prints the medians and their ratio.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._synth import metaseq_lm, model_shape, write_metaseq  # noqa: E402

# Imports first (torch alone takes seconds): the timing is of the inspection itself.
_PROBE = (
    "import time, torch, numpy, omegaconf, metaseq_oneload as o, metaseq_oneload._layout, metaseq_oneload._plan; "
    "t = time.perf_counter(); lay = o.inspect({path!r}); n = lay.num_params; "
    "dt = time.perf_counter() - t; print(dt, lay.file_bytes, n)"
)


def _time(path: str, repeat: int) -> tuple:
    runs = []
    for _ in range(repeat):
        out = subprocess.run([sys.executable, "-c", _PROBE.format(path=path)], capture_output=True, text=True, check=True)
        dt, size, params = out.stdout.split()
        runs.append(float(dt))
    return statistics.median(runs), int(size), int(params)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--big-gib", type=float, default=2.0)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="oneload-inspect-")
    try:
        rows = []
        for label, gib in (("small", 0.002), ("big", args.big_gib)):
            shape = model_shape(gib, dim=64 if gib < 0.01 else 2048)
            prefix = os.path.join(tmp, label, "checkpoint_1")
            os.makedirs(os.path.dirname(prefix))
            full = metaseq_lm(shape["layers"], shape["dim"], shape["ffn"], shape["vocab"], shape["positions"])
            write_metaseq(prefix, full, shards=4)
            median, size, params = _time(os.path.join(tmp, label), args.repeat)
            rows.append((label, size, params, median))
        print(f"{'set':6s}  {'bytes on disk':>15s}  {'params':>13s}  {'inspect (median of %d)' % args.repeat:>24s}" % ())
        for label, size, params, median in rows:
            print(f"{label:6s}  {size:15,d}  {params:13,d}  {median * 1000:21.1f} ms")
        (_, s_size, _, s_t), (_, b_size, _, b_t) = rows
        print(f"size ratio {b_size / s_size:,.0f}x, time ratio {b_t / s_t:.2f}x")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
