"""Real gloo ranks on CPU for tests: spawned processes, a FileStore in tmp_path.

``run_ranks(world, fn, *args)`` runs ``fn(rank, world, *args)`` on every rank and returns
the per-rank results (JSON-able). Any rank's exception fails the test with every rank's
traceback; a rank still alive after ``timeout`` seconds fails it as a hang. Ranks in
``may_die`` (a test that kills them) may end without a result: theirs is None.
"""

from __future__ import annotations

import datetime
import json
import os
import traceback

import pytest
import torch.multiprocessing as mp


def _worker(rank, world, init_file, out_dir, fn, args, timeout):
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    result = {"ok": False}
    try:
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


def run_ranks(world: int, fn, *args, tmp_path, timeout: float = 120, may_die=()) -> list:
    out_dir = tmp_path / f"ranks-{world}-{fn.__name__}"
    out_dir.mkdir(parents=True, exist_ok=True)
    init_file = out_dir / "store"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, world, str(init_file), str(out_dir), fn, args, timeout))
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
