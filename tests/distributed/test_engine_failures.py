"""Failure never hangs and never lies: whatever goes wrong on one rank, every rank raises
a clear error within a bounded time (the harness fails a test as a hang after its timeout)."""

from __future__ import annotations

import pytest

from tests.conftest import needs_fixtures
from tests.distributed.harness import run_ranks
from tests.distributed.workers import expect_failure

pytestmark = needs_fixtures


@pytest.mark.parametrize("scenario,world,needle", [
    ("different_files", 2, r"the ranks see different checkpoint files \(rank 0: .*fsdp_dp3/checkpoint_2 1x3; rank 1: .*mp2_dp2/checkpoint_2 2x2\)"),
    ("truncate_while_reading", 3, r"reading failed on 1 rank\(s\) \(1\).*rank 1: CheckpointLayoutError: .*truncated: needed bytes"),
    ("reader_dies_mid_broadcast", 3, r"reading failed on 1 rank\(s\) \(0\).*rank 0: CheckpointLayoutError: .*truncated: needed bytes"),
    ("reader_dies_mid_scatter", 3, r"reading failed on 1 rank\(s\) \(0\).*rank 0: CheckpointLayoutError: .*truncated: needed bytes"),
    ("wrong_shape_on_one_rank", 2, r"matching the target failed on 1 rank\(s\) \(1\).*decoder\.layers\.0\.fc1\.weight: checkpoint \(64, 34\) vs module \(48, 34\)"),
])
def test_every_rank_raises(tmp_path, scenario, world, needle):
    import re

    messages = run_ranks(world, expect_failure, scenario, str(tmp_path), tmp_path=tmp_path, timeout=60)
    assert len(messages) == world
    for m in messages:
        assert re.search(needle, m, re.S), m
