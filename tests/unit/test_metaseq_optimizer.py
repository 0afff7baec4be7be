"""Resuming on another data-parallel size: the flat optimizer state that install()'s
Trainer.load_checkpoint hands to metaseq, checked against fairscale's own sharding of the
saved state (metaseq itself is not needed)."""

import pytest
import torch

import metaseq_oneload as mo
from metaseq_oneload._metaseq import _reshard_flat_optimizer, _saved_shards_fit
from tests.conftest import FIXTURES, needs_fixtures, raw_load
from tests.distributed.workers import fairscale_shard

pytestmark = needs_fixtures


def saved_state(layout, part: int) -> list:
    """Per shard file: [(per flat parameter) (its optimizer entry, its padding)]."""
    out = []
    for f in layout.files[part]:
        obj = raw_load(f.path)
        paddings = [v["padding"] for pm in obj["shard_metadata"]["param_metadata"] for v in pm["params"].values()]
        state = obj["last_optimizer_state"]["state"]
        out.append(list(zip([state[k] for k in sorted(state)], paddings)))
    return out


@pytest.mark.parametrize("name,world", [("fsdp_dp3", 2), ("fsdp_dp3", 1), ("fsdp_dp3", 4), ("fsdp_dp3", 3),
                                        ("mp2_dp2", 1), ("mp2_dp2", 3), ("shard_only", 3)])
def test_flat_optimizer_state_resharded_like_fairscale(name, world):
    layout = mo.inspect(FIXTURES / name)
    for part in range(layout.model_parallel_size):
        shards = saved_state(layout, part)
        skeleton = raw_load(layout.files[part][0].path)["last_optimizer_state"]
        for rank in range(world):
            got = _reshard_flat_optimizer(layout, part, rank, world, skeleton)
            assert got["param_groups"] == skeleton["param_groups"]
            for i, key in enumerate(sorted(skeleton["state"])):
                for field, value in skeleton["state"][key].items():
                    new = got["state"][key][field]
                    if not torch.is_tensor(value) or value.dim() == 0:
                        assert new == value  # step: the same on every shard
                        continue
                    # fairscale: the real elements of all shards in order, chunked for the new world
                    full = torch.cat([s[i][0][field][: s[i][0][field].numel() - s[i][1]] for s in shards])
                    if name == "shard_only":  # reshard_fsdp kept the old padding inside the state
                        full = torch.cat([s[i][0][field] for s in shards])[: layout.parts[part].flat_params[i].total_numel]
                    want, _ = fairscale_shard(full, rank, world)
                    assert torch.equal(new, want), (name, world, part, rank, key, field)


def test_which_saved_layouts_fit_a_world_as_they_are():
    assert _saved_shards_fit(mo.inspect(FIXTURES / "fsdp_dp3"), 0, 3)
    assert not _saved_shards_fit(mo.inspect(FIXTURES / "fsdp_dp3"), 0, 2)
    assert _saved_shards_fit(mo.inspect(FIXTURES / "mp2_dp2"), 1, 2)
    shard_only = mo.inspect(FIXTURES / "shard_only")
    opt = raw_load(shard_only.files[0][0].path)["last_optimizer_state"]
    # The weights fit 2 ranks, but reshard_fsdp's optimizer state is 4674 per shard, not 4673.
    assert _saved_shards_fit(shard_only, 0, 2) and not _saved_shards_fit(shard_only, 0, 2, opt)


def test_state_that_does_not_belong_to_the_weights_is_refused():
    layout = mo.inspect(FIXTURES / "fsdp_dp3")
    skeleton = raw_load(layout.files[0][0].path)["last_optimizer_state"]
    wrong = dict(skeleton, state={k: v for k, v in skeleton["state"].items() if k != max(skeleton["state"])})
    with pytest.raises(mo.CheckpointLayoutError, match=r"the optimizer state has 2 entries but model part 0 has 3 flat parameters"):
        _reshard_flat_optimizer(layout, 0, 0, 2, wrong)
