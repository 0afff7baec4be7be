"""The optimizer state that install()'s Trainer.load_checkpoint hands to metaseq
(``integrations._optimizer.rank_optimizer_state``), checked against fairscale's own sharding of the saved
state, and against what the offline conversion writes for the same rank: one planning path
(``_optim.plan_optimizer`` + ``rank_state``), the same bytes (metaseq itself is not needed)."""

import pytest
import torch

import metaseq_oneload as mo
from metaseq_oneload._convert import convert
from metaseq_oneload.integrations._optimizer import _state_sizes_fit, rank_optimizer_state
from metaseq_oneload._optim import rest_source, same_weights_layout
from tests.conftest import FIXTURES, copy_set, needs_fixtures, raw_load
from tests.distributed.workers import fairscale_shard
from tests.unit.test_convert import _equal

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


def skeleton_for(layout, part: int, parts: int, shard: int, shards: int) -> dict:
    """The saved optimizer state install() starts from for that rank (the file of
    rest_source, as the metaseq patch reads it)."""
    return raw_load(rest_source(layout, part, parts, shard, shards))["last_optimizer_state"]


@pytest.mark.parametrize("name,world", [("fsdp_dp3", 2), ("fsdp_dp3", 1), ("fsdp_dp3", 4), ("fsdp_dp3", 3),
                                        ("mp2_dp2", 1), ("mp2_dp2", 3), ("shard_only", 3), ("shard_only", 2)])
def test_flat_optimizer_state_resharded_like_fairscale(name, world):
    layout = mo.inspect(FIXTURES / name)
    M = layout.model_parallel_size
    for part in range(M):
        shards = saved_state(layout, part)
        for rank in range(world):
            skeleton = skeleton_for(layout, part, M, rank, world)
            got, why = rank_optimizer_state(layout, skeleton, part=part, parts=M, shard=rank, shards=world, flat=True)
            assert got is not None, why
            assert got["param_groups"] == skeleton["param_groups"]
            for i, key in enumerate(sorted(skeleton["state"])):
                for field, value in skeleton["state"][key].items():
                    new = got["state"][i][field]
                    if not torch.is_tensor(value) or value.dim() == 0:
                        assert new == value  # step: the same on every shard
                        continue
                    # fairscale: the real elements of all shards in order, chunked for the new world
                    full = torch.cat([s[i][0][field][: s[i][0][field].numel() - s[i][1]] for s in shards])
                    if name == "shard_only":  # reshard_fsdp kept the old padding inside the state
                        full = torch.cat([s[i][0][field] for s in shards])[: layout.parts[part].flat_params[i].total_numel]
                    want, _ = fairscale_shard(full, rank, world)
                    assert torch.equal(new, want), (name, world, part, rank, key, field)


def test_which_saved_layouts_are_taken_as_they_are():
    fsdp = mo.inspect(FIXTURES / "fsdp_dp3")
    assert same_weights_layout(fsdp, parts=1, shards=3, flat=True)
    assert not same_weights_layout(fsdp, parts=1, shards=2, flat=True)
    assert not same_weights_layout(fsdp, parts=2, shards=3, flat=True)
    assert not same_weights_layout(fsdp, parts=1, shards=3, flat=False)
    assert same_weights_layout(mo.inspect(FIXTURES / "mp2_dp2"), parts=2, shards=2, flat=True)
    assert same_weights_layout(mo.inspect(FIXTURES / "mp2_ddp"), parts=2, shards=4, flat=False)
    shard_only = mo.inspect(FIXTURES / "shard_only")
    opt = raw_load(shard_only.files[0][0].path)["last_optimizer_state"]
    # The weights fit 2 ranks, but reshard_fsdp's optimizer state is 4674 per shard, not 4673.
    assert same_weights_layout(shard_only, parts=1, shards=2, flat=True) and not _state_sizes_fit(opt, shard_only, 0, 0, 2)


def test_state_that_does_not_belong_to_the_weights_is_refused(tmp_path):
    src = copy_set("fsdp_dp3", tmp_path)
    for f in sorted(src.glob("checkpoint_2-*.pt")):
        obj = raw_load(f)
        state = obj["last_optimizer_state"]["state"]
        del state[max(state)]
        torch.save(obj, f)
    layout = mo.inspect(src / "checkpoint_2.pt")
    skeleton = raw_load(layout.files[0][0].path)["last_optimizer_state"]
    got, why = rank_optimizer_state(layout, skeleton, part=0, parts=1, shard=0, shards=2, flat=True)
    assert got is None
    assert "optimizer state for 2 parameters but the file holds 3 flat parameters" in why


@pytest.mark.parametrize("name", ["fsdp_dp3", "shard_only", "mp2_dp2"])
def test_install_and_convert_give_the_same_optimizer_state(tmp_path, name):
    """Regression: the metaseq patch (materialised now) and the conversion (streamed to
    disk) lay out the optimizer state of every rank the same way, bit for bit, onto 1..4
    data-parallel ranks and model-parallel 1 and 2."""
    layout = mo.inspect(FIXTURES / name)
    for M in (1, 2):
        for W in (1, 2, 3, 4):
            r = convert(FIXTURES / name, tmp_path / f"{M}x{W}" / "ck", model_parallel=M, shards=W, flat=True,
                        jobs=1, progress=False)
            assert r.optimizer == "carried", r.notes
            for m in range(M):
                for d in range(W):
                    written = raw_load(r.files[m * W + d])["last_optimizer_state"]
                    got, why = rank_optimizer_state(layout, skeleton_for(layout, m, M, d, W), part=m, parts=M,
                                                    shard=d, shards=W, flat=True)
                    assert got is not None, why
                    _equal(got, written, f"{name} {M}x{W} part {m} shard {d}")


def test_unflattened_state_is_the_same_both_ways(tmp_path):
    layout = mo.inspect(FIXTURES / "mp2_ddp")
    for M in (1, 2):
        r = convert(FIXTURES / "mp2_ddp", tmp_path / f"{M}" / "ck", model_parallel=M, progress=False)
        for m in range(M):
            written = raw_load(r.files[m])["last_optimizer_state"]
            got, why = rank_optimizer_state(layout, skeleton_for(layout, m, M, 0, 1), part=m, parts=M, shard=0,
                                            shards=1, flat=False)
            assert got is not None, why
            _equal(got, written, f"mp2_ddp -> {M} part {m}")
