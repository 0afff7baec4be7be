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
    ("same_group_twice", 2, r"rank \d: the data-parallel group \[0, 1\] and the model-parallel group \[0, 1\] share ranks \[0, 1\]"),
    ("options_differ", 2, r"ranks of one data-parallel group called with different options: rank 0 \['auto', False, 256, 64, True"),
    ("bucket_cannot_be_allocated", 2, r"reading failed on 2 rank\(s\) \(0, 1\)"),
    ("reader_fails_while_verifying", 2, r"verifying failed on 1 rank\(s\) \(0\).*rank 0: CheckpointLayoutError: .*truncated"),
    ("wrong_shape_on_one_rank", 2, r"matching the target failed on 1 rank\(s\) \(1\).*decoder\.layers\.0\.fc1\.weight: checkpoint \(64, 34\) vs module \(48, 34\)"),
])
def test_every_rank_raises(tmp_path, scenario, world, needle):
    import re

    messages = run_ranks(world, expect_failure, scenario, str(tmp_path), tmp_path=tmp_path, timeout=60)
    assert len(messages) == world
    for m in messages:
        assert re.search(needle, m, re.S), m


def test_tied_name_wanted_by_an_untied_module_arrives_by_every_strategy(tmp_path):
    from tests.distributed.workers import untied_module_broadcast

    for strategy in ("broadcast", "auto"):
        diffs = run_ranks(2, untied_module_broadcast, strategy, tmp_path=tmp_path / strategy, timeout=60)
        assert max(diffs) == 0.0, (strategy, diffs)


def test_an_empty_folder_is_a_rank_that_cannot_see_the_files(tmp_path):
    from tests.distributed.workers import blind_empty_folder

    assert run_ranks(2, blind_empty_folder, str(tmp_path), tmp_path=tmp_path, timeout=60) == ["broadcast", "broadcast"]
