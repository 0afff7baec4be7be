"""A rank whose call began before the others gave up waiting for it (``arrival_timeout``),
on 2 real gloo ranks: what it does next belongs to the load the others abandoned.

Its call begins with an integration's discovery of the set (``before_load``), slower on
rank 1 than the others' timeout (a cold file system). Then:

* the discovery fails: rank 1 raises its own error, and the next load of both works, rank 1
  coming well after rank 0 (longer than ranks wait for a failed rank's next call). Before,
  rank 1's failure settled the next check-in: rank 0 raised it in that good load, a load
  late, and rank 1 then waited out its own arrival_timeout for rank 0;
* the discovery succeeds and rank 1 reaches the load: it is told at once that it came too
  late, naming the timeout to raise. Before, it waited its own whole arrival_timeout at the
  check-in after, where no one came, and blamed rank 0.

One process group serves both cases.
"""

from __future__ import annotations

import re

import pytest

from tests.conftest import FIXTURES, needs_fixtures
from tests.distributed.harness import run_ranks

pytestmark = needs_fixtures

GIVE_UP = 1.5  # the abandoned load's arrival_timeout
WAIT = 20.0  # the next load's: long enough that waiting it out cannot pass for "at once"
AT_ONCE = 5.0


def _late(rank: int, world: int) -> dict:
    import time

    import torch.distributed as dist

    import metaseq_oneload as mo
    from metaseq_oneload.integrations import _checkpoint

    single = FIXTURES / "singleton"
    world_group = dist.group.WORLD
    out: dict = {}

    def attempt(case, fn):
        t0 = time.perf_counter()
        try:
            fn()
            out[case] = {"ok": True, "seconds": time.perf_counter() - t0}
        except Exception as e:  # noqa: BLE001  (what each rank saw is the result)
            out[case] = {"ok": False, "seconds": time.perf_counter() - t0, "type": type(e).__name__,
                         "message": str(e)[:3000]}

    def slow_discovery(then_fails: bool):
        with _checkpoint.before_load(world_group, None):
            _checkpoint.locate(single)
            time.sleep(GIVE_UP + 1.0)  # past the others' arrival_timeout
            if then_fails:
                raise ValueError("rank 1's discovery failed after the others gave up")

    # (a) rank 1's call fails after rank 0 gave up on it; then both load, rank 1 3 s later
    dist.barrier()
    if rank == 0:
        attempt("abandoned", lambda: mo.load_state_dict(single, arrival_timeout=GIVE_UP))
    else:
        attempt("abandoned", lambda: slow_discovery(then_fails=True))
        time.sleep(3.0)  # longer than the others wait for a failed rank's next call (2 s)
    attempt("next_load", lambda: mo.load_state_dict(single, arrival_timeout=WAIT))

    # (b) rank 1's slow discovery succeeds and it reaches the load after rank 0 gave up
    dist.barrier()
    if rank == 0:
        attempt("given_up", lambda: mo.load_state_dict(single, arrival_timeout=GIVE_UP))
    else:
        slow_discovery(then_fails=False)
        attempt("given_up", lambda: mo.load_state_dict(single, arrival_timeout=WAIT))
    dist.barrier()
    attempt("then_loads", lambda: mo.load_state_dict(single, arrival_timeout=WAIT))
    return out


@pytest.fixture(scope="module")
def late(tmp_path_factory):
    return run_ranks(2, _late, tmp_path=tmp_path_factory.mktemp("late_rank"), timeout=4 * WAIT + 60)


def test_a_failure_after_the_others_gave_up_is_not_handed_to_their_next_load(late):
    got = late[0]["abandoned"]
    assert not got["ok"] and got["type"] == "DistributedLoadError", got
    assert re.search(rf"rank 1 of the data-parallel group \[0, 1\] did not arrive within "
                     rf"arrival_timeout={GIVE_UP:g}s", got["message"]), got
    assert late[1]["abandoned"]["type"] == "ValueError", late[1]
    seconds = {r: round(c["next_load"]["seconds"], 2) for r, c in enumerate(late)}
    print(f"next_load: seconds per rank {seconds} (rank 1 came about 3 s after rank 0)")
    for rank, c in enumerate(late):
        assert c["next_load"]["ok"], (rank, c["next_load"])


def test_a_rank_that_arrives_after_the_others_gave_up_is_told_at_once(late):
    got = late[1]["given_up"]
    print(f"given_up: rank 1 told in {got['seconds']:.2f}s (its arrival_timeout={WAIT:g}s)")
    assert not got["ok"] and got["type"] == "DistributedLoadError", got
    assert re.search(rf"rank 1 arrived after the other ranks of the data-parallel group \[0, 1\] had stopped "
                     rf"waiting for it \(arrival_timeout={GIVE_UP:g}s\).*raise arrival_timeout=", got["message"]), got
    assert got["seconds"] < AT_ONCE, got  # not its own arrival_timeout
    assert not late[0]["given_up"]["ok"] and "did not arrive" in late[0]["given_up"]["message"], late[0]
    for rank, c in enumerate(late):
        assert c["then_loads"]["ok"], (rank, c["then_loads"])
