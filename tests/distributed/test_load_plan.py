"""The plan states what the load does: on real gloo ranks, every rank's bytes read and the
strategy equal what ``plan_load`` (``metaseq-oneload plan``) said before, for own-shard,
reshard (shard count and model-parallel size changes, flat and not) and broadcast loads."""

import pytest
import torch.distributed as dist

from tests.conftest import FIXTURES, needs_fixtures
from tests.distributed.harness import run_ranks

pytestmark = needs_fixtures

# (set, model-parallel size, flat, strategy)
WORLD2 = [
    ("fsdp_dp3", 1, False, "auto"),      # 3 shards -> 2 ranks, full weights: parallel
    ("fsdp_dp3", 1, True, "auto"),       # flat 3 -> 2
    ("shard_only", 1, True, "auto"),     # 2 shards onto 2 ranks: own_shard
    ("mp2_dp2", 1, False, "auto"),       # model-parallel 2 -> 1, read once between the ranks
    ("mp2_ddp", 2, False, "auto"),       # model-parallel 2 onto 2 parts
    ("singleton", 1, False, "broadcast"),
    ("fsdp_dp3", 1, True, "broadcast"),  # flat pieces, point to point
]
WORLD3 = [
    ("fsdp_dp3", 1, True, "auto"),       # own_shard
    ("singleton", 1, False, "auto"),     # every rank wants the one file: parallel
    ("mp2_dp2", 1, False, "reshard"),    # explicit: shared bytes still read once
    ("fsdp_dp3", 1, True, "parallel"),   # disjoint flat shards: each reads its own
]


def load_cases(rank: int, world: int, cases) -> list:
    import metaseq_oneload as mo

    everyone = dist.new_group(list(range(world)))
    out = []
    for name, mp_size, flat, strategy in cases:
        dp, mp = (everyone, None) if mp_size == 1 else (None, everyone)
        lc = mo.load_checkpoint(FIXTURES / name, process_group=dp, model_parallel_group=mp, flat=flat,
                                strategy=strategy)
        out.append([lc.report.strategy, lc.report.bytes_read, lc.report.bytes_out])
    return out


@pytest.mark.parametrize("world,cases", [(2, WORLD2), (3, WORLD3)], ids=["world2", "world3"])
def test_the_plan_states_the_bytes_the_load_reads(tmp_path, world, cases):
    from metaseq_oneload._loadplan import plan_load

    plans = [plan_load(FIXTURES / name, world=world, model_parallel=mp_size, flat=flat, strategy=strategy)
             for name, mp_size, flat, strategy in cases]
    results = run_ranks(world, load_cases, cases, tmp_path=tmp_path)
    for k, case in enumerate(cases):
        plan = plans[k]
        for rank in range(world):
            strategy, bytes_read, bytes_out = results[rank][k]
            r = plan.ranks[rank]
            assert (strategy, bytes_read, bytes_out) == (plan.strategy, r.bytes_read, r.bytes_out), (case, rank)
        assert plan.bytes_read > 0
