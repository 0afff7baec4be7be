"""Every fixture set onto every world size 1..4 and model-parallel 1 and 2, on real gloo
ranks: the loaded tensors equal the singleton's weights; flat shards equal fairscale's own
sharding and consolidate back (with fairscale) to the full weights."""

from __future__ import annotations

import pytest

from tests.conftest import SETS, needs_fixtures
from tests.distributed.harness import run_ranks
from tests.distributed.workers import load_matrix

pytestmark = needs_fixtures


@pytest.mark.parametrize("world,mp_size", [(1, 1), (2, 1), (3, 1), (4, 1), (2, 2), (4, 2)])
def test_any_layout_onto_any_world(tmp_path, world, mp_size):
    results = run_ranks(world, load_matrix, mp_size, ("auto", "broadcast"), tmp_path=tmp_path, timeout=240)
    rows = results[0]
    assert len(rows) == len(SETS) * 2 * 2
    assert all(r[5] for r in rows)  # verify=True passed everywhere
    chosen = {(r[0], r[1], r[2]): r[3] for r in rows}
    w = world // mp_size
    for name in SETS:
        assert chosen[(name, True, "broadcast")] == "broadcast"
    if (world, mp_size) == (3, 1):
        assert chosen[("fsdp_dp3", True, "auto")] == "own_shard"
        assert chosen[("shard_only", True, "auto")] == "reshard"
    if (world, mp_size) == (4, 2):
        assert chosen[("mp2_dp2", True, "auto")] == "own_shard"
    if w == 1 and mp_size == 1:
        assert chosen[("singleton", False, "auto")] == "own_shard"
