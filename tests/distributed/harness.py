"""Real gloo ranks on CPU for tests: fresh processes, a FileStore in tmp_path.

``run_ranks(world, fn, *args)`` runs ``fn(rank, world, *args)`` on every rank and returns
the per-rank results (JSON-able). Any rank's exception fails the test with every rank's
traceback; a rank still alive after ``timeout`` seconds fails it as a hang. Ranks in
``may_die`` (a test that kills them) may end without a result: theirs is None.

Ranks are forked from a forkserver that imported torch once for the whole session: a rank
started by spawn imports torch itself (about 2 s of CPU each, and the suite starts over a
hundred ranks), which was most of the cost of a distributed test. The forkserver holds no
threads and no process group; each rank still starts its own group, with the environment
and working directory the test has when it calls run_ranks (a forkserver's children
would otherwise inherit the environment of its own start), before ``fn`` and its
arguments are unpickled, as spawn did.
"""

from __future__ import annotations

import datetime
import json
import os
import pickle
import traceback

import pytest
import torch.multiprocessing as mp

# Only torch, which no test configures: modules that may read the environment when imported
# (metaseq_oneload's settings, transformers) are imported by each rank, after its environment
# is set. torch.distributed.checkpoint brings DTensor, FSDP2 and the device mesh, which many
# ranks use, and costs about as much as torch itself.
_PRELOAD = ["torch", "torch.distributed", "torch.multiprocessing", "torch.distributed.checkpoint"]


def _worker(rank, world, init_file, out_dir, payload, timeout, env):
    os.environ.clear()
    os.environ.update(env)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    # torch read OMP_NUM_THREADS when the forkserver imported it: set what the rank's says
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 1))

    result = {"ok": False}
    try:
        fn, args = pickle.loads(payload)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout))
        result = {"ok": True, "value": fn(rank, world, *args)}
    except BaseException:
        result = {"ok": False, "error": traceback.format_exc()}
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        if dist.is_initialized():
            dist.destroy_process_group()


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # read when the server starts: once per session
    return ctx


def run_ranks(world: int, fn, *args, tmp_path, timeout: float = 120, may_die=()) -> list:
    out_dir = tmp_path / f"ranks-{world}-{fn.__name__}"
    out_dir.mkdir(parents=True, exist_ok=True)
    init_file = out_dir / "store"
    ctx = _context()
    payload = pickle.dumps((fn, args))
    env = dict(os.environ)
    procs = [ctx.Process(target=_worker, args=(r, world, str(init_file), str(out_dir), payload, timeout, env))
             for r in range(world)]
    for p in procs:
        p.start()
    hung = []
    for r, p in enumerate(procs):
        p.join(timeout + 30)
        if p.is_alive():
            hung.append(r)
            p.kill()
    if hung:
        pytest.fail(f"ranks {hung} of {world} still running after {timeout + 30}s: a hang")
    results, errors = [], []
    for r in range(world):
        path = out_dir / f"rank{r}.json"
        if not path.exists():
            if r in may_die:
                results.append(None)
            else:
                errors.append(f"rank {r}: exited with code {procs[r].exitcode} without a result")
            continue
        res = json.loads(path.read_text())
        if not res["ok"]:
            errors.append(f"rank {r}:\n{res['error']}")
        results.append(res.get("value"))
    if errors:
        pytest.fail("\n".join(errors))
    return results
