"""``from_pretrained`` on 2 real gloo ranks where rank 1 builds its model slower than rank 0
waits at the load's check-in (``arrival_timeout``): rank 1's call began before rank 0 gave
up, so rank 1 is told at once that it came too late, as for ``load_state_dict`` after an
integration's slow discovery (tests/distributed/test_late_rank.py). Before, its check-in
counted from where ``load_into`` began, after rank 0 had given up: rank 1 waited its own
whole arrival_timeout at a check-in no one came to. Then both load again, and it works."""

from __future__ import annotations

import re

import pytest

from tests.distributed.harness import run_ranks
from tests.hf_tiny import save_tiny_t5

pytest.importorskip("transformers")

GIVE_UP = 1.5  # rank 0's arrival_timeout
WAIT = 20.0  # rank 1's: long enough that waiting it out cannot pass for "at once"
AT_ONCE = 5.0


def _late(rank: int, world: int, folder: str) -> dict:
    import os
    import time

    import torch.distributed as dist
    from transformers import T5ForConditionalGeneration

    from metaseq_oneload import from_pretrained

    out: dict = {}

    def slow_build(model):  # what a large model's build and fully_shard take on a slow rank
        time.sleep(GIVE_UP + 1.0)

    dist.barrier()
    os.environ["METASEQ_ONELOAD_ARRIVAL_TIMEOUT"] = str(GIVE_UP if rank == 0 else WAIT)
    t0 = time.perf_counter()
    try:
        from_pretrained(T5ForConditionalGeneration, folder, fsdp=slow_build if rank == 1 else None)
        out["given_up"] = {"ok": True}
    except Exception as e:  # noqa: BLE001  (what each rank saw is the result)
        out["given_up"] = {"ok": False, "type": type(e).__name__, "message": str(e)[:3000]}
    out["given_up"]["seconds"] = time.perf_counter() - t0
    dist.barrier()
    os.environ["METASEQ_ONELOAD_ARRIVAL_TIMEOUT"] = str(WAIT)
    try:
        from_pretrained(T5ForConditionalGeneration, folder)
        out["then_loads"] = {"ok": True}
    except Exception as e:  # noqa: BLE001
        out["then_loads"] = {"ok": False, "message": str(e)[:3000]}
    return out


def test_a_rank_whose_from_pretrained_began_before_the_others_gave_up_is_told_at_once(tmp_path):
    save_tiny_t5(tmp_path / "t5")
    late = run_ranks(2, _late, str(tmp_path / "t5"), tmp_path=tmp_path, timeout=3 * WAIT + 60)
    got = late[1]["given_up"]
    print(f"given_up: rank 1 told in {got['seconds']:.2f}s (its arrival_timeout={WAIT:g}s)")
    assert not got["ok"] and got["type"] == "DistributedLoadError", got
    assert re.search(rf"rank 1 arrived after the other ranks of the data-parallel group \[0, 1\] had stopped "
                     rf"waiting for it \(arrival_timeout={GIVE_UP:g}s\)", got["message"]), got
    assert got["seconds"] < GIVE_UP + 1.0 + AT_ONCE, got  # not its own arrival_timeout
    assert not late[0]["given_up"]["ok"] and "did not arrive" in late[0]["given_up"]["message"], late[0]
    for rank, c in enumerate(late):
        assert c["then_loads"]["ok"], (rank, c["then_loads"])
