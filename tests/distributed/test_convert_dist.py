"""A converted checkpoint loads on the world it was written for: 2 model-parallel parts x 2
FSDP shards on 4 real gloo ranks, each rank reading its own file (strategy own_shard), the
shards equal to fairscale's sharding of the reference weights."""

from __future__ import annotations

import torch

import metaseq_oneload as mo
from metaseq_oneload._convert import convert
from tests.conftest import FIXTURES, assert_matches_reference, needs_fixtures, raw_load, reference_part, reference_weights
from tests.distributed.harness import run_ranks
from tests.distributed.workers import check_flat, make_groups

pytestmark = needs_fixtures


def load_converted(rank: int, world: int, prefixes: list) -> list:
    dp, mpg, dp_rank, mp_rank, w = make_groups(rank, world, 2)
    ref_part = reference_part(reference_weights(), mp_rank, 2)
    strategies = []
    for prefix in prefixes:
        path = f"{prefix}-model_part-0-shard0.pt"
        loaded = mo.load_checkpoint(path, process_group=dp, model_parallel_group=mpg, flat=True, verify=True)
        check_flat(loaded.model, loaded.shard_metadata, ref_part, dp, dp_rank, w)
        # What this rank loads is exactly its own file, as metaseq would read it.
        own = raw_load(f"{prefix}-model_part-{mp_rank}-shard{dp_rank}.pt")
        assert set(loaded.model) == set(own["model"])
        for k, v in own["model"].items():
            assert torch.equal(loaded.model[k], v), k
        assert loaded.shard_metadata == own["shard_metadata"]
        sd = mo.load_state_dict(path, process_group=dp, model_parallel_group=mpg)
        assert_matches_reference(sd, ref_part)
        strategies.append(loaded.report.strategy)
    return strategies


def test_converted_2x2_loads_on_4_ranks(tmp_path):
    prefixes = []
    for name in ("fsdp_dp3", "mp2_ddp"):  # flat source; unflattened source (metaseq's wrapping)
        r = convert(FIXTURES / name, tmp_path / name / "ck", model_parallel=2, shards=2)
        assert len(r.files) == 4
        prefixes.append(str(tmp_path / name / "ck"))
    results = run_ranks(4, load_converted, prefixes, tmp_path=tmp_path, timeout=240)
    assert results == [["own_shard", "own_shard"]] * 4
