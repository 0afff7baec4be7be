"""load_into on real gloo ranks: FSDP2 (DTensor shards), meta-device modules, blind ranks."""

from __future__ import annotations

import pytest

from tests.conftest import needs_fixtures
from tests.distributed.harness import run_ranks
from tests.distributed.workers import load_into_fsdp2, load_into_meta

pytestmark = needs_fixtures


@pytest.mark.parametrize("name,world,strategy,blind,expected", [
    ("fsdp_dp3", 3, "auto", (), "reshard"),
    ("mp2_dp2", 2, "auto", (), "reshard"),
    ("singleton", 2, "broadcast", (), "broadcast"),
    ("shard_only", 3, "auto", (1, 2), "parallel"),
])
def test_fsdp2_each_rank_gets_only_its_shard(tmp_path, name, world, strategy, blind, expected):
    results = run_ranks(world, load_into_fsdp2, name, strategy, blind, tmp_path=tmp_path, timeout=120)
    assert {r["strategy"] for r in results} == {expected}
    # The ranks' local shards add up to the model once (21548 params + nothing duplicated).
    assert sum(r["local_numel"] for r in results) == 21548


def test_meta_module_materialises_on_every_rank(tmp_path):
    results = run_ranks(2, load_into_meta, "mp2_ddp", tmp_path=tmp_path, timeout=120)
    assert [r["strategy"] for r in results] == ["broadcast", "broadcast"]
