"""The two-node simulation: two torchrun agents on this machine (``--nnodes 2
--nproc-per-node 2``, a c10d rendezvous on 127.0.0.1), each node seeing its own copy of a
synthetic metaseq checkpoint (or node 1 seeing none, or both one object store: the tests'
S3 endpoint on 127.0.0.1), full weights on every rank.

    .venv/bin/python bench/two_nodes.py [--gib 0.25 0.5] [--cold] [--no-s3] [--repeat N] [--json]

Per run: storage bytes read summed over the 4 ranks / model bytes, by the engine's count
(``LoadReport.bytes_read``) and by the kernel's (``/proc/self/io`` ``rchar``, which counts
gloo's socket reads as well: the column beside it takes off what crossed between the nodes),
bytes that crossed into each node / model bytes, the sum of peak RSS above the baseline /
model bytes, what the object store served (counted by the proxy) / model bytes, and the wall
time of the slowest rank. ``oneload`` is ``strategy="auto"`` (a node with its own copy on
its own disk reads it there through its page cache; nodes on one store read each byte once
between them and exchange; a node that sees nothing receives); ``oneload, strict`` is
``strategy="parallel"`` (every byte read once in all, handed on inside a node through shared
memory); ``oneload, broadcast`` the one-reader alternative. Beside them, in the same run,
every rank loading alone (``no_dist=True``: each rank reads the whole model, as
``torch.load`` on every rank would).
``--cold``: before every run both copies' pages are dropped from the page cache
(``posix_fadvise(DONTNEED)``, the files fsync-ed), and ``read_bytes`` (what the disk served,
summed over ranks) is reported too.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._report import drop_cache, print_table, proc_io, proc_status  # noqa: E402


def worker(out: str, root: str, scenario: str, mode: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    import metaseq_oneload as mo

    node = int(os.environ["GROUP_RANK"])
    folder = f"node{node}" if scenario == "own copies" or node == 0 else "nowhere"
    path = os.path.join(root, folder, "synth.pt")
    proxy = os.environ.get("ONELOAD_BENCH_S3_PROXY", "")
    if scenario == "one object store":
        path = os.environ["ONELOAD_BENCH_S3"] + "/synth.pt"
    mo.inspect(path if scenario == "one object store" else os.path.join(root, "node0", "synth.pt"))
    # (imports, botocore's first use, the header: off the clock, alike for every mode)
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    rank = dist.get_rank()
    if proxy:
        from tests.s3_server import proxy_control
    if proxy and rank == 0:
        proxy_control(proxy, "reset")
    dist.barrier()
    base, rchar, t0 = proc_status("VmRSS"), proc_io()["rchar"], time.perf_counter()
    disk = proc_io()["read_bytes"]
    lc = mo.load_checkpoint(path, no_dist=mode == "every rank alone", strategy=MODES.get(mode, "auto"))
    seconds = time.perf_counter() - t0
    read_sys, disk = proc_io()["rchar"] - rchar, proc_io()["read_bytes"] - disk
    dist.barrier()
    served = -1
    if proxy and scenario == "one object store":
        served = proxy_control(proxy, "counters")["body_bytes"]
    peak = proc_status("VmHWM") - base
    r = lc.report
    row = {"rank": rank, "node": node, "seconds": seconds, "rchar": read_sys, "peak": peak, "read": r.bytes_read,
           "crossed": r.bytes_from_other_nodes, "strategy": r.strategy, "disk": disk, "served": served}
    with open(os.path.join(out, f"{_slug(scenario, mode)}-{rank}.json"), "w") as f:
        json.dump(row, f)
    del lc
    dist.destroy_process_group()


MODES = {"oneload": "auto", "oneload, strict": "parallel", "oneload, broadcast": "broadcast"}


def _slug(scenario: str, mode: str) -> str:
    return f"{scenario}-{mode}".replace(" ", "_").replace(",", "")


def _agents(out: str, root: str, scenario: str, mode: str, extra_env: dict) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), **extra_env)
    import torch.distributed as dist

    # The rendezvous store lives here (an agent hosting it may leave before the other's exit barrier).
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # noqa: F841
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"bench-{port}",
           "--rdzv-conf", "is_host=false",
           "--max-restarts", "0", os.path.abspath(__file__), "--worker", out, root, scenario, mode]
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for _ in range(2)]
    errs = [p.communicate()[1] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{scenario}/{mode} failed:\n" + "\n".join(e.decode()[-3000:] for e in errs))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, nargs="+", default=[0.25, 0.5])
    ap.add_argument("--cold", action="store_true", help="drop the files' pages before every run")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--no-s3", action="store_true", help="leave out the object-store runs (they need moto)")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each kind; the fastest is reported")
    ap.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return 0
    from bench._synth import metaseq_lm, model_shape, write_metaseq

    runs = [("own copies", "oneload"), ("own copies", "oneload, strict"), ("own copies", "every rank alone"),
            ("node 1 sees none", "oneload"), ("node 1 sees none", "oneload, broadcast")]
    if not args.no_s3:
        runs += [("one object store", "oneload"), ("one object store", "every rank alone")]
    rows = []
    for gib in args.gib:
        tmp = tempfile.mkdtemp(prefix="oneload-two-nodes-")
        endpoint, env = None, {}
        try:
            sh = model_shape(gib)
            write_metaseq(os.path.join(tmp, "node0", "synth"),
                          metaseq_lm(sh["layers"], sh["dim"], sh["ffn"], sh["vocab"], sh["positions"]))
            shutil.copytree(os.path.join(tmp, "node0"), os.path.join(tmp, "node1"))
            size = os.path.getsize(os.path.join(tmp, "node0", "synth.pt"))
            if not args.no_s3:
                # One storage behind both nodes: the tests' S3 endpoint (moto on 127.0.0.1
                # behind a proxy that counts what it serves), in a process of its own.
                from tests.s3_server import S3Endpoint

                endpoint = S3Endpoint()
                url = endpoint.upload(os.path.join(tmp, "node0", "synth.pt"), "bench", "two-nodes/synth.pt")
                env = dict(endpoint.env(), ONELOAD_BENCH_S3=url.rsplit("/", 1)[0], ONELOAD_BENCH_S3_PROXY=endpoint.url)
            for scenario, mode in runs:
                out = os.path.join(tmp, "out")
                os.makedirs(out, exist_ok=True)
                # Best of --repeat runs by wall time (each cold with --cold): the first run
                # after the files are written also pays for their write-back.
                tries = []
                for _ in range(args.repeat):
                    if args.cold:
                        drop_cache([os.path.join(tmp, n, "synth.pt") for n in ("node0", "node1")])
                    _agents(out, tmp, scenario, mode, env if scenario == "one object store" else {})
                    tries.append([json.load(open(os.path.join(out, f"{_slug(scenario, mode)}-{r}.json")))
                                  for r in range(4)])
                per = min(tries, key=lambda p: max(x["seconds"] for x in p))
                rows.append({"gib": gib, "scenario": scenario, "mode": mode, "strategy": per[0]["strategy"],
                             "read_over_model": round(sum(p["read"] for p in per) / size, 3),
                             "crossed_per_node_over_model": [
                                 round(sum(p["crossed"] for p in per if p["node"] == n) / size, 3) for n in (0, 1)],
                             "rchar_over_model": round(sum(p["rchar"] for p in per) / size, 2),
                             "read_bytes_over_model": round(sum(p["disk"] for p in per) / size, 2),
                             "peak_over_model": round(sum(p["peak"] for p in per) / size, 2),
                             "served_over_model": round(per[0]["served"] / size, 3) if per[0]["served"] >= 0 else None,
                             "seconds": round(max(p["seconds"] for p in per), 2)})
                print(f"  done: {gib} GiB {scenario} {mode}: {rows[-1]}", file=sys.stderr)
        finally:
            if endpoint is not None:
                endpoint.stop()
            shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    header = ["GiB", "files", "how", "strategy", "read / model", "crossed into node 0, 1 / model",
              "rchar / model (incl. sockets)"] + (["read_bytes / model"] if args.cold else []) + [
              "store served / model", "sum of peaks / model", "wall s"]
    body = [[r["gib"], r["scenario"], r["mode"], r["strategy"], f"{r['read_over_model']:.2f}x",
             " ".join(f"{x:.2f}x" for x in r["crossed_per_node_over_model"]), f"{r['rchar_over_model']:.2f}x"]
            + ([f"{r['read_bytes_over_model']:.2f}x"] if args.cold else [])
            + [f"{r['served_over_model']:.2f}x" if r["served_over_model"] is not None else "-"]
            + [f"{r['peak_over_model']:.2f}x", f"{r['seconds']:.2f}"] for r in rows]
    print_table(header, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
