"""Each named strategy's memory, as the plan states it (the formula a load executes, held
equal to the executed plan by tests/distributed/test_load_plan.py): full weights on every
rank hold their outputs plus ONE bucket summed over the ranks, not one per rank; flat shards
broadcast from one reader hold its one bucket."""

from __future__ import annotations

import pytest

import metaseq_oneload as mo
from metaseq_oneload._options import ALIGN

from tests.conftest import FIXTURES


def _bucket(mb: float) -> int:
    return max(ALIGN, int(mb * (1 << 20)) // ALIGN * ALIGN)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("strategy", ["parallel", "broadcast", "reshard", "auto"])
@pytest.mark.parametrize("bucket_mb", [0.01, 0.03])
def test_full_weights_hold_one_bucket_in_all(strategy, world, bucket_mb):
    part = mo.plan_load(FIXTURES / "singleton", world=world, strategy=strategy, bucket_mb=bucket_mb).parts[0]
    extra = [r.peak_extra_bytes for r in part.ranks]
    assert sum(extra) <= _bucket(bucket_mb), (part.strategy, extra, _bucket(bucket_mb))
    if strategy in ("parallel", "broadcast"):
        assert part.strategy == strategy and part.transfers  # bytes do move: not a trivial plan
        assert all(r.bytes_out == part.ranks[0].bytes_out > 2 * _bucket(bucket_mb) for r in part.ranks)


@pytest.mark.parametrize("world", [2, 3])
def test_shards_broadcast_hold_the_readers_bucket(world):
    part = mo.plan_load(FIXTURES / "singleton", world=world, strategy="broadcast", flat=True,
                        shard_metadata=mo.inspect(FIXTURES / "fsdp_dp3").header()["shard_metadata"],
                        bucket_mb=0.01).parts[0]
    extra = [r.peak_extra_bytes for r in part.ranks]
    assert extra[1:] == [0] * (world - 1) and 0 < extra[0] <= _bucket(0.01), extra
