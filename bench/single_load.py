"""One process loads a singleton, warm and cold: the engine, its peers, and the read limit, in one run.

    .venv/bin/python bench/single_load.py [--gib 0.25 0.5 1 2] [--repeat 3] [--json] [--keep DIR]
                                          [--cache warm|cold|both] [--only ours,cache,direct,...]
                                          [--baseline DIR] [--memory primed|fresh]
                                          [--threads N [N ...]] [--order shuffled|fixed] [--seed N]

For each size, a synthetic fp32 metaseq singleton (``bench/_synth.py``; the same weights
also saved as .safetensors beside it, each storage once) is loaded in a fresh process per
run (imports before the clock, as in ``bench/read_bandwidth.py``, whose child runs these):

* the limit: ``preadv`` of the .pt file into one freshly allocated buffer of its size, on a
  pool of 2 and of 4 threads (16 MiB pieces); the best of the two is the limit of the row's
  cache state, and ``x limit`` is each row's time over it;
* fresh memory alone: a buffer of the file's size whose pages the kernel maps in one call
  (``MADV_POPULATE_WRITE``), nothing read: the share of every row that is the destination's
  pages, which no loader that returns fresh tensors avoids;
* ``load_state_dict(path, no_dist=True)`` as shipped (``$METASEQ_ONELOAD_O_DIRECT`` unset,
  i.e. ``auto``: O_DIRECT for the pieces the page cache lacks, ``preadv`` for the ones it
  holds), with ``=0`` (every piece through the page cache) and with ``=1`` (every piece with
  O_DIRECT straight into the destination);
* ``torch.load(mmap=False)``; ``torch.load(mmap=True)`` then a copy of every storage into
  fresh memory; safetensors' ``load_file`` (which maps the file: nothing is read until
  touched) then a copy of every tensor into fresh memory; fastsafetensors' ``fastsafe_open``
  on CPU (``nogds``), where it is installed (``pip install fastsafetensors``; not a
  requirement: the row is left out without it, and a run that fails shows its error);
* with ``--threads N ...``, the engine again with ``$METASEQ_ONELOAD_READ_THREADS=N`` for each N;
* with ``--baseline DIR``, the engine again from the package in ``DIR`` (say
  ``git archive REV metaseq_oneload | tar -x -C DIR``): a change's effect, in the same rounds.

Warm: the files are in the page cache, read again (``cat``) right before each run: the VM this
was measured on pages out memory left untouched for a minute (DAMON), and a warm run that
went to the device is not one (``read_bytes`` shows it). Before the first warm round both
files are dropped and read whole (``_report.recache``): a cached file is held in the folios
its last cold reader's reads built, and a .pt left by a mapped copy sat mostly in 4-16 KiB
folios, which ``preadv`` copied out 1.2-1.3x slower than the 2 MiB folios the .safetensors
beside it sat in (``bench/cache_folios.py``): a warm row of one against the other compared the
files' histories, as every warm table of this bench before this step did. The table
says what the cache held then (``_report.folio_line``; root only). Cold: ``posix_fadvise(DONTNEED)`` on the files before
each run (``read_bytes`` shows each run fetched the file from the device). Rows alternate
within a round; the table gives the best and the median of ``--repeat`` rounds, and each
row's time over the limit's twice: best over best (``x limit``), and median over the lower
of the limit rows' medians (``x limit, medians``): on a shared machine one lucky run decides a
best, and the limit, with two rows, has twice the chances of one.

Memory: by default (``--memory primed``) each run maps, fills and frees as much memory as the
file before its clock starts (``bench/read_bandwidth.py``'s ``_prime``): on a VM whose host
takes free memory back, the first touch of a page waits on the host, 3-12 s per GiB in one
hour here against 0.4-0.6 s for a page the host still backs, and that wait, the same for every
row, would decide the table. ``--memory fresh`` keeps it in.

Round by round: under each size's table, ``ours`` against every other row but "fresh memory
alone" in the same rounds (its time over the row's, the median and range of those ratios, the
rounds it won, and a two-sided sign test of that split). Whether a peer is faster is read
there: this VM's runs spread by 20-40% between rounds, more than the differences between the
fast rows, and the rows of one round share what disturbed it. The test is weak with few
rounds (of 10, only a 9-1 split or more gives p < 0.05): a large p says "not shown faster",
not "level". Each round runs its rows in a new random order (``--order shuffled``, the
default; ``--seed``): in a fixed order a row always follows the same one, and what the one
before leaves (the host's cache of the device file, memory just freed) is a position effect
the pairing does not remove. ``--order fixed`` keeps the table's order.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from bench._report import drop_cache, folio_line, print_table, recache  # noqa: E402
from bench.read_bandwidth import run_mode, with_safetensors  # noqa: E402

MiB = 1 << 20
LIMIT = ("preadv2", "preadv4")


# key -> (label, mode, threads, env), in the table's order (each round's with --order fixed); --only takes keys
_ALL = {
    "limit2": ("limit: preadv, 2 threads, fresh memory", "preadv2", 2, {}),
    "limit4": ("limit: preadv, 4 threads, fresh memory", "preadv4", 4, {}),
    "pages": ("fresh memory alone: its pages mapped, nothing read", "populate", 1, {}),
    "ours": ("oneload load_state_dict", "engine", 8, {}),
    "cache": ("oneload, O_DIRECT=0 (the cache)", "engine", 8, {"METASEQ_ONELOAD_O_DIRECT": "0"}),
    "direct": ("oneload, O_DIRECT=1", "engine", 8, {"METASEQ_ONELOAD_O_DIRECT": "1"}),
    "torch": ("torch.load(mmap=False)", "torch.load", 1, {}),
    "mmap-copy": ("torch.load(mmap=True) + copy", "torch.load-mmap-copy", 1, {}),
    "st-copy": ("safetensors load_file + copy", "safetensors-copy", 1, {}),
    "fastst": ("fastsafetensors (cpu, nogds)", "fastsafetensors", 1, {}),
}
_ONLY: tuple = ()


def _beside_ours(extra: list) -> None:
    """``extra`` rows (key, row) put right after ``ours``, the row they are compared with."""
    rows = list(_ALL.items())
    at = [k for k, _ in rows].index("ours") + 1
    _ALL.clear()
    _ALL.update(rows[:at] + extra + rows[at:])


def _baseline(folder: str) -> None:
    """A row for the package in ``folder`` (``folder/metaseq_oneload``), first on the child's
    path: another version of the engine, timed in the same rounds as this one."""
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [folder, os.environ.get("PYTHONPATH")]))}
    _beside_ours([("baseline", (f"oneload, the package in {folder}", "engine", 8, env))])


def _thread_rows(counts: list) -> None:
    """A row per count: the engine with ``$METASEQ_ONELOAD_READ_THREADS`` set to it (a count
    the user sets is kept whatever the page cache holds)."""
    _beside_ours([(f"threads{n}", (f"oneload, READ_THREADS={n}", "engine", n, {"METASEQ_ONELOAD_READ_THREADS": str(n)}))
                  for n in counts])


def _modes() -> list:
    """(label, mode, threads, env) of the rows asked for (the limit's always), in the table's order."""
    import importlib.util

    keys = [k for k in _ALL if not _ONLY or k in _ONLY or k in ("limit2", "limit4", "pages")]
    if importlib.util.find_spec("fastsafetensors") is None:  # not a requirement: installed by hand
        keys = [k for k in keys if k != "fastst"]
    return [_ALL[k] for k in keys]


def _prepare(gib: float, folder: str) -> str:
    from bench._synth import metaseq_lm, model_shape, write_metaseq

    shape = model_shape(gib)
    path = os.path.join(folder, f"synth-{gib:g}.pt")
    if not os.path.exists(path):
        write_metaseq(path[:-3], metaseq_lm(shape["layers"], shape["dim"], shape["ffn"], shape["vocab"],
                                            shape["positions"]))
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)  # clean pages: DONTNEED can drop them
        os.close(fd)
    with_safetensors(path)
    return path


def _measure(path: str, repeat: int, states=("warm", "cold"), memory: str = "primed",
             order: Optional[random.Random] = None) -> dict:
    """Every row once per round, ``repeat`` rounds per cache state; with ``order``, each
    round's rows in an order drawn from it (else the fixed order of ``_ALL``). Keyed by
    (state, label), and ``folios``: what the cache held before the warm rounds."""
    results: dict = {}
    files = [path, os.path.splitext(path)[0] + ".safetensors"]
    for state in states:
        if state == "warm":  # both files in a sequential read's folios, whatever read them last
            recache(files)
            results["folios"] = folio_line(files)
            print(f"  page cache before the warm rounds: {results['folios']}", file=sys.stderr)
        for rnd in range(repeat):
            modes = _modes()
            for label, mode, n, env in (order.sample(modes, len(modes)) if order is not None else modes):
                if state == "cold":
                    drop_cache(files)
                else:  # read again right before: this VM pages out what sat untouched for a minute
                    for f in files:
                        run_mode("cat", f, 1, {})
                try:
                    r = run_mode(mode, path, n, {**env, "ONELOAD_BENCH_MEMORY": memory})
                except RuntimeError as e:
                    r = {"error": str(e).strip().splitlines()[-1][:160]}
                results.setdefault((state, label), []).append(r)
                print(f"  {os.path.basename(path)} {state} round {rnd + 1}: {label}: "
                      f"{r.get('seconds', float('nan')):.2f} s", file=sys.stderr)
    return results


def _rows(results: dict, size: int, states=("warm", "cold")) -> list:
    rows = []
    for state in states:
        ok = {label: [r for r in results.get((state, label), []) if "seconds" in r] for label, *_ in _modes()}
        limit = min(min(r["seconds"] for r in ok[label]) for label, mode, *_ in _modes() if mode in LIMIT)
        limit_median = min(statistics.median(r["seconds"] for r in ok[label])
                           for label, mode, *_ in _modes() if mode in LIMIT)
        for label, mode, *_ in _modes():
            runs = ok[label]
            if not runs:
                errs = [r["error"] for r in results.get((state, label), []) if "error" in r]
                rows.append({"cache": state, "run": label, "error": errs[0] if errs else "not run"})
                continue
            best, median = min(r["seconds"] for r in runs), statistics.median(r["seconds"] for r in runs)
            rows.append({"cache": state, "run": label, "best_s": round(best, 3), "median_s": round(median, 3),
                         "gib_per_s": round(size / best / 2**30, 2), "x_limit": round(best / limit, 2),
                         "x_limit_median": round(median / limit_median, 2),
                         "read_bytes_mib": round(max(r["read_bytes"] or 0 for r in runs) / MiB),
                         "delivered_mib": round(runs[0]["delivered"] / MiB)})
    return rows


def sign_test(wins: int, n: int) -> float:
    """Two-sided exact sign test: the chance of a split at least as uneven as ``wins`` of ``n``
    where either side is as likely to win a round (no difference)."""
    from math import comb

    if n == 0:
        return 1.0
    k = min(wins, n - wins)
    return min(1.0, 2 * sum(comb(n, i) for i in range(k + 1)) / 2 ** n)


def _paired(results: dict, states=("warm", "cold")) -> list:
    """``ours`` against every other row, round by round: the rows of a round run back to back,
    so what disturbs a round (the host, a neighbour) disturbs both, where a row's median
    carries it alone. A peer is faster only where ours lost a lopsided share of the rounds."""
    rows = []
    ours = _ALL["ours"][0]
    for state in states:
        mine = results.get((state, ours), [])
        for label, mode, *_ in _modes():
            if label == ours or mode == "populate":
                continue
            theirs = results.get((state, label), [])
            ratios = [a["seconds"] / b["seconds"] for a, b in zip(mine, theirs)
                      if "seconds" in a and "seconds" in b]
            if not ratios:
                continue
            wins = sum(r < 1 for r in ratios)
            rows.append({"cache": state, "against": label, "rounds": len(ratios),
                         "ratio_median": round(statistics.median(ratios), 3),
                         "ratio_range": [round(min(ratios), 3), round(max(ratios), 3)],
                         "ours_faster": wins, "sign_p": round(sign_test(wins, len(ratios)), 4)})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, nargs="+", default=[0.25, 0.5, 1.0, 2.0], help="model sizes, GiB (fp32)")
    ap.add_argument("--repeat", type=int, default=3, help="rounds per cache state")
    ap.add_argument("--keep", help="write the checkpoints into this folder and keep them (reused when there)")
    ap.add_argument("--cache", choices=("warm", "cold", "both"), default="both", help="which cache states")
    ap.add_argument("--only", help=f"comma-separated rows besides the limit's: {', '.join(_ALL)}")
    ap.add_argument("--baseline", metavar="DIR",
                    help="also time the package in DIR (DIR/metaseq_oneload, e.g. from git archive) in the same rounds")
    ap.add_argument("--memory", choices=("primed", "fresh"), default="primed",
                    help="primed: each run first maps and frees as much memory as the file, before the "
                         "clock (the host backs its pages: read_bandwidth._prime); fresh: it does not")
    ap.add_argument("--threads", type=int, nargs="+", default=[],
                    help="also time the engine with $METASEQ_ONELOAD_READ_THREADS set to each count (rows threadsN)")
    ap.add_argument("--order", choices=("shuffled", "fixed"), default="shuffled",
                    help="shuffled: each round runs its rows in a new random order (--seed); fixed: in the "
                         "order of the table, as before commit 9cf9507")
    ap.add_argument("--seed", type=int, default=0, help="the shuffled order's seed")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    global _ONLY
    if any(n < 1 for n in args.threads):
        ap.error(f"--threads: {args.threads}: each count must be at least 1")
    args.threads = list(dict.fromkeys(args.threads))  # a count given twice is one row
    if args.threads:
        _thread_rows(args.threads)
        if args.only:
            args.only += "," + ",".join(f"threads{n}" for n in args.threads)
    if args.baseline:
        if not os.path.isfile(os.path.join(args.baseline, "metaseq_oneload", "__init__.py")):
            ap.error(f"--baseline: {args.baseline} holds no metaseq_oneload package")
        _baseline(os.path.abspath(args.baseline))
        if args.only:
            args.only += ",baseline"
    if args.only:
        _ONLY = tuple(k.strip() for k in args.only.split(","))
        unknown = [k for k in _ONLY if k not in _ALL]
        if unknown:
            ap.error(f"--only: unknown rows {unknown}; choose from {', '.join(_ALL)}")
    states = ("warm", "cold") if args.cache == "both" else (args.cache,)

    import torch

    folder = args.keep or tempfile.mkdtemp(prefix="oneload-single-", dir="/tmp")
    os.makedirs(folder, exist_ok=True)
    tables = []
    try:
        for gib in args.gib:
            t0 = time.perf_counter()
            path = _prepare(gib, folder)
            print(f"  {path}: ready in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
            size = os.path.getsize(path)
            order = random.Random(f"{args.seed}:{gib}") if args.order == "shuffled" else None
            results = _measure(path, args.repeat, states, args.memory, order)
            tables.append({"gib": gib, "file_bytes": size, "rows": _rows(results, size, states),
                           "paired": _paired(results, states), "warm_folios": results.get("folios")})
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    meta = {"repeat": args.repeat, "memory": args.memory, "order": args.order, "seed": args.seed,
            "torch": torch.__version__, "cpus": os.cpu_count()}
    if args.json:
        print(json.dumps({**meta, "tables": tables}, indent=2))
        return 0
    for t in tables:
        print(f"\n{t['file_bytes'] / 2**30:.2f} GiB fp32 singleton, best and median of {args.repeat}, "
              f"torch {torch.__version__}, {os.cpu_count()} CPUs, memory {args.memory}, rows in "
              f"{'a shuffled order (seed ' + str(args.seed) + ')' if args.order == 'shuffled' else 'a fixed order'}; "
              "'x limit': best time over the best "
              "preadv-into-fresh-memory time of the same cache state (below 1: faster than the limit); "
              "'x limit, medians': the row's median over the limit rows' lower median")
        header = ["cache", "run", "best s", "median s", "GiB/s", "x limit", "x limit, medians", "read_bytes MiB"]
        body = [[r["cache"], r["run"], "-", "-", "-", "-", "-", r["error"]] if "error" in r else
                [r["cache"], r["run"], f"{r['best_s']:.3f}", f"{r['median_s']:.3f}", f"{r['gib_per_s']:.2f}",
                 f"{r['x_limit']:.2f}x", f"{r['x_limit_median']:.2f}x", str(r["read_bytes_mib"])]
                for r in t["rows"]]
        print_table(header, body)
        if t["warm_folios"]:
            print(f"page cache before the warm rounds (dropped, then read whole): {t['warm_folios']}")
        if t["paired"]:
            print(f"\n{t['file_bytes'] / 2**30:.2f} GiB, round by round: ours' time over the row's in the same round; "
                  "'sign p': two-sided sign test of 'ours faster' rounds (small: the split is not chance)")
            print_table(["cache", "against", "rounds", "ours / row, median", "range", "ours faster", "sign p"],
                        [[p["cache"], p["against"], str(p["rounds"]), f"{p['ratio_median']:.3f}",
                          f"{p['ratio_range'][0]:.2f}-{p['ratio_range'][1]:.2f}",
                          f"{p['ours_faster']} of {p['rounds']}", f"{p['sign_p']:.3f}"] for p in t["paired"]])
    return 0


if __name__ == "__main__":
    sys.exit(main())
