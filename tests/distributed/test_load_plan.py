"""The plan is the load: on real gloo ranks, the plan each load executed (``LoadReport.plan``)
equals, value for value (strategy, reason, every rank's reads, transfers by round and
channel, memory), what ``plan_load`` (``metaseq-oneload plan``) said before for the topology
described; and every rank's bytes read are what the plan stated. One node of 2 or 3 ranks;
ranks on simulated nodes (``METASEQ_ONELOAD_NODE``), each with its own copy on a local disk;
a node that cannot see the files."""

import os
import shutil

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
# Two simulated nodes of two ranks, each node's copy on this machine's disk.
NODES = [
    ("fsdp_dp3", 1, False, "auto"),      # each node reads its own copy, through its page cache
    ("singleton", 1, False, "parallel"),  # strict: read once in all, sent across nodes
    ("fsdp_dp3", 1, True, "auto"),
    ("mp2_dp2", 2, False, "auto"),       # two parts of two data-parallel ranks, one per node
]
# Rank 1, a node of its own, sees no files.
BLIND = [
    ("singleton", 1, False, "auto"),     # parallel: rank 0 reads and sends
    ("fsdp_dp3", 1, True, "auto"),
    ("singleton", 1, False, "broadcast"),
]


def load_cases(rank: int, world: int, cases, root=None, per_node=None, blind=()) -> list:
    import metaseq_oneload as mo
    from metaseq_oneload._planner import to_wire

    if per_node:  # this rank's node, as torchrun's GROUP_RANK would tell nodes apart
        os.environ["METASEQ_ONELOAD_NODE"] = f"sim{rank // per_node}"
    everyone = dist.new_group(list(range(world)))
    out = []
    for name, mp_size, flat, strategy in cases:
        if mp_size == 1:
            dp, mp = everyone, None
        elif mp_size == world:
            dp, mp = None, everyone
        else:  # Megatron's grid: rank = dp_rank * M + mp_rank
            dps = [dist.new_group([d * mp_size + m for d in range(world // mp_size)]) for m in range(mp_size)]
            mps = [dist.new_group([d * mp_size + m for m in range(mp_size)]) for d in range(world // mp_size)]
            dp, mp = dps[rank % mp_size], mps[rank // mp_size]
        where = FIXTURES if root is None else os.path.join(root, "unseen" if rank in blind else "seen")
        lc = mo.load_checkpoint(os.path.join(where, name), process_group=dp, model_parallel_group=mp, flat=flat,
                                strategy=strategy)
        r = lc.report
        out.append([r.strategy, r.bytes_read, r.bytes_out, to_wire(r.plan.parts[0]).decode()])
    return out


def _check(results, plans, cases, world):
    from metaseq_oneload._planner import from_wire

    for k, case in enumerate(cases):
        plan = plans[k]
        mp_size = case[1]
        for rank in range(world):
            strategy, bytes_read, bytes_out, executed = results[rank][k]
            r = plan.ranks[rank]
            assert (strategy, bytes_read, bytes_out) == (plan.part(rank % mp_size).strategy, r.bytes_read,
                                                         r.bytes_out), (case, rank)
            # the value itself: the plan this rank's group executed is the plan stated before
            assert from_wire(executed.encode()) == plan.part(rank % mp_size), (case, rank)
        assert plan.bytes_read > 0


@pytest.mark.parametrize("world,cases", [(2, WORLD2), (3, WORLD3)], ids=["world2", "world3"])
def test_the_plan_is_the_load_on_one_node(tmp_path, world, cases):
    from metaseq_oneload._loadplan import plan_load

    plans = [plan_load(FIXTURES / name, world=world, model_parallel=mp_size, flat=flat, strategy=strategy)
             for name, mp_size, flat, strategy in cases]
    results = run_ranks(world, load_cases, cases, tmp_path=tmp_path)
    _check(results, plans, cases, world)


def test_the_plan_is_the_load_on_two_nodes(tmp_path):
    from metaseq_oneload._loadplan import plan_load

    plans = [plan_load(FIXTURES / name, world=4, model_parallel=mp_size, ranks_per_node=2, flat=flat,
                       strategy=strategy) for name, mp_size, flat, strategy in NODES]
    assert plans[1].network_bytes > 0 and {r.node for r in plans[1].ranks} == {0, 1}
    assert any(t.channel == "network" for t in plans[1].parts[0].transfers)  # across nodes: the network
    results = run_ranks(4, load_cases, NODES, None, 2, tmp_path=tmp_path)
    _check(results, plans, NODES, 4)


def test_the_plan_is_the_load_with_a_node_that_sees_nothing(tmp_path):
    from metaseq_oneload._loadplan import plan_load

    (tmp_path / "seen").mkdir()
    for name in {c[0] for c in BLIND}:
        shutil.copytree(FIXTURES / name, tmp_path / "seen" / name)
    plans = [plan_load(tmp_path / "seen" / name, world=2, model_parallel=mp_size, ranks_per_node=1, blind_nodes=(1,),
                       flat=flat, strategy=strategy) for name, mp_size, flat, strategy in BLIND]
    assert plans[0].ranks[1].bytes_read == 0 and plans[0].ranks[1].bytes_received > 0
    results = run_ranks(2, load_cases, BLIND, str(tmp_path), 1, (1,), tmp_path=tmp_path)
    _check(results, plans, BLIND, 2)
