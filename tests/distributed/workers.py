"""Functions that run on every rank (spawned by harness.run_ranks). Module level so that
spawned processes can import them."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import metaseq_oneload as mo
from tests.conftest import FIXTURES, SETS, assert_matches_reference, raw_load, reference_part, reference_weights


def make_groups(rank: int, world: int, mp_size: int):
    """Megatron-style grid: model-parallel groups are consecutive ranks."""
    w = world // mp_size
    mp_groups = [dist.new_group(list(range(k * mp_size, (k + 1) * mp_size))) for k in range(w)]
    dp_groups = [dist.new_group([m + k * mp_size for k in range(w)]) for m in range(mp_size)]
    mp_group = mp_groups[rank // mp_size] if mp_size > 1 else None
    dp_group = dp_groups[rank % mp_size] if world > 1 else None
    return dp_group, mp_group, rank // mp_size, rank % mp_size, w


def fairscale_shard(flat: torch.Tensor, rank: int, world: int):
    """fairscale 0.4.13's FullyShardedDataParallel._get_shard, as the oracle."""
    chunks = list(torch.flatten(flat).chunk(world))
    while len(chunks) < world:
        chunks.append(chunks[0].new_empty(0))
    shard = chunks[rank].clone()
    pad = chunks[0].numel() - shard.numel()
    if pad > 0:
        shard = F.pad(shard, [0, pad])
    return shard, pad


def target_metadata(mp_size: int) -> dict:
    """A fairscale local_metadata_dict of the fixture model at this model-parallel size."""
    src = "fsdp_dp3/checkpoint_2-model_part-0-shard0.pt" if mp_size == 1 else "mp2_dp2/checkpoint_2-model_part-0-shard0.pt"
    return raw_load(FIXTURES / src)["shard_metadata"]


def check_flat(sd, meta, ref_part, dp_group, dp_rank, w) -> None:
    from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP

    for pm in meta["param_metadata"]:
        for flat_name, v in pm["params"].items():
            key = f"{pm['fsdp_path']}.{flat_name}" if pm["fsdp_path"] else flat_name
            names = [f"{pm['fsdp_path']}.{n}" if pm["fsdp_path"] else n for n in v["names"]]
            full = torch.cat([ref_part[n].flatten() for n in names])
            want, pad = fairscale_shard(full, dp_rank, w)
            assert v["padding"] == pad, (key, v["padding"], pad)
            diff = (sd[key] - want).abs()
            assert diff.max() <= 1e-4 if diff.numel() else True, (key, float(diff.max()))
    # Gathered and unpadded, by fairscale's own consolidation, they are the full weights.
    keys = list(sd)
    gathered = [dict() for _ in range(w)]
    metas = [None] * w
    for k in keys:
        parts = [torch.empty_like(sd[k]) for _ in range(w)]
        if dp_group is not None and w > 1:
            dist.all_gather(parts, sd[k].contiguous(), group=dp_group)
        else:
            parts = [sd[k]]
        for r in range(w):
            gathered[r][k] = parts[r]
    if dp_group is not None and w > 1:
        dist.all_gather_object(metas, meta, group=dp_group)
    else:
        metas = [meta]
    full = FSDP.consolidate_shard_weights(gathered, metas)
    expected = {k: v for k, v in ref_part.items() if k != "decoder.output_projection.weight"}
    assert_matches_reference(full, expected)


def load_matrix(rank: int, world: int, mp_size: int, strategies, sets=SETS, flats=(False, True)) -> list:
    dp, mpg, dp_rank, mp_rank, w = make_groups(rank, world, mp_size)
    ref = reference_weights()
    ref_part = reference_part(ref, mp_rank, mp_size)
    out = []
    for name in sets:
        for flat in flats:
            for strategy in strategies:
                layout = mo.inspect(FIXTURES / name)
                md = None if layout.flat else target_metadata(mp_size)
                lc = mo.load_checkpoint(FIXTURES / name, process_group=dp, model_parallel_group=mpg, flat=flat,
                                        strategy=strategy, shard_metadata=md if flat else None, verify=True)
                try:
                    if flat:
                        check_flat(lc.model, lc.shard_metadata, ref_part, dp, dp_rank, w)
                    else:
                        assert_matches_reference(lc.model, ref_part)
                        out_proj = lc.model["decoder.output_projection.weight"]
                        assert out_proj is lc.model["decoder.embed_tokens.weight"]
                except AssertionError as e:
                    raise AssertionError(f"{name} flat={flat} strategy={strategy} (world {world}, mp {mp_size}): {e}") from e
                out.append([name, flat, strategy, lc.report.strategy, lc.report.bytes_read, lc.report.verified])
    return out


def load_into_fsdp2(rank: int, world: int, name: str, strategy: str, blind_ranks=()) -> dict:
    """A meta-built model, sharded with FSDP2, filled in place; blind ranks get a path
    that does not exist on them."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from tests.tiny_metaseq import sharded_on_meta

    model = sharded_on_meta(init_device_mesh("cpu", (world,)))
    path = FIXTURES / name if rank not in blind_ranks else f"/nonexistent-on-rank-{rank}/checkpoint_last.pt"
    report = mo.load_into(model, path, strategy=strategy, verify=True)
    ref = reference_weights()
    local_numel = sum(p.to_local().numel() for p in model.parameters())  # unique: ties once
    full = {n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in model.state_dict().items()}
    assert_matches_reference(full, ref)
    assert model.decoder.output_projection.weight is model.decoder.embed_tokens.weight
    return {"strategy": report.strategy, "local_numel": local_numel}


def load_into_meta(rank: int, world: int, name: str) -> dict:
    """Unwrapped meta-built model on every rank: materialised as it loads."""
    from tests.tiny_metaseq import TinyMetaseqLM

    with torch.device("meta"):
        model = TinyMetaseqLM()
    report = mo.load_into(model, FIXTURES / name, process_group=dist.group.WORLD, strategy="broadcast", verify=True)
    assert_matches_reference(model.state_dict(), reference_weights())
    assert model.decoder.output_projection.weight is model.decoder.embed_tokens.weight
    assert all(p.device.type == "cpu" for p in model.parameters())
    return {"strategy": report.strategy}


def expect_failure(rank: int, world: int, scenario: str, tmp: str) -> str:
    """Run a load that must fail on every rank; return the message each rank saw."""
    import shutil

    from tests.tiny_metaseq import TinyMetaseqLM

    group = dist.group.WORLD
    own = os.path.join(tmp, f"rank{rank}")
    if scenario in ("truncate_while_reading", "reader_dies_mid_broadcast", "reader_dies_mid_scatter",
                    "reader_fails_while_verifying"):
        shutil.copytree(FIXTURES / "fsdp_dp3", own, symlinks=True)
    calls = {"n": 0}

    def truncate_after_first_piece(done, total):
        calls["n"] += 1
        if calls["n"] == 1:
            for f in sorted(os.listdir(own)):
                if f.startswith("checkpoint_2-"):
                    os.chmod(os.path.join(own, f), 0o644)
                    os.truncate(os.path.join(own, f), 2000)

    try:
        if scenario == "different_files":
            path = FIXTURES / ("fsdp_dp3" if rank == 0 else "mp2_dp2")
            mo.load_state_dict(path, process_group=group)
        elif scenario == "truncate_while_reading":
            # small buckets: rank 1's share of the reading spans many rounds (read once and
            # exchanged: reading its own wants through the page cache, a few at a time, it
            # could be done before the first progress call)
            mo.load_state_dict(own, process_group=group, strategy="parallel", bucket_mb=0.001,
                               progress=truncate_after_first_piece if rank == 1 else None)
        elif scenario == "reader_dies_mid_broadcast":
            mo.load_state_dict(own, process_group=group, strategy="broadcast", bucket_mb=0.001,
                               progress=truncate_after_first_piece if rank == 0 else None)
        elif scenario == "reader_dies_mid_scatter":
            mo.load_state_dict(own, process_group=group, strategy="broadcast", bucket_mb=0.001, flat=True,
                               progress=truncate_after_first_piece if rank == 0 else None)
        elif scenario == "same_group_twice":
            mo.load_state_dict(FIXTURES / "mp2_dp2", process_group=group, model_parallel_group=group,
                               strategy="broadcast")
        elif scenario == "options_differ":
            mo.load_state_dict(FIXTURES / "fsdp_dp3", process_group=group, verify=rank == 0)
        elif scenario == "reader_fails_while_verifying":
            def truncate_when_done(done, total):
                if done >= 86196:  # every model byte arrived: now spoil the files
                    truncate_after_first_piece(done, total)

            mo.load_state_dict(own, process_group=group, strategy="broadcast", verify=True,
                               progress=truncate_when_done if rank == 0 else None)
        elif scenario == "wrong_shape_on_one_rank":
            torch.manual_seed(0)
            model = TinyMetaseqLM(ffn=64 if rank == 0 else 48)
            before = {k: v.clone() for k, v in model.state_dict().items()}
            try:
                mo.load_into(model, FIXTURES / "singleton", process_group=group)
            finally:
                for k, v in model.state_dict().items():
                    assert torch.equal(v, before[k]), f"{k} was written although the load failed"
        else:
            raise ValueError(scenario)
    except mo.DistributedLoadError as e:
        return str(e)
    raise AssertionError(f"rank {rank}: {scenario} did not raise")


def untied_module_broadcast(rank: int, world: int, strategy: str) -> float:
    """A module whose output projection is its own tensor, while the checkpoint ties it to
    embed_tokens: every strategy must fill it (from embed_tokens' bytes)."""
    from tests.tiny_metaseq import TinyMetaseqLM

    torch.manual_seed(1)
    model = TinyMetaseqLM()
    model.decoder.output_projection.weight = torch.nn.Parameter(torch.full((64, 34), 7.0))
    path = FIXTURES / "fsdp_dp3" if rank == 0 else "/nowhere/checkpoint_last.pt"
    mo.load_into(model, path, process_group=dist.group.WORLD, strategy=strategy, verify=True)
    ref = reference_weights()
    assert model.decoder.output_projection.weight is not model.decoder.embed_tokens.weight
    return float((model.decoder.output_projection.weight - ref["decoder.embed_tokens.weight"]).abs().max())


def blind_empty_folder(rank: int, world: int, tmp: str) -> str:
    """A rank whose checkpoint folder exists but is empty (a missing mount) receives."""
    empty = os.path.join(tmp, f"mount{rank}")
    os.makedirs(empty, exist_ok=True)
    path = FIXTURES / "singleton" if rank == 0 else empty
    lc = mo.load_checkpoint(path, process_group=dist.group.WORLD)
    assert_matches_reference(lc.model, reference_weights())
    return lc.report.strategy


def load_corpus(rank: int, world: int, mp_size: int, ids, flat_ids=(), node_per_rank: bool = False) -> list:
    """Every named corpus set onto this world and model-parallel size: the rank's part
    equals Megatron's split of an independent reading of the set (tests/corpus.py), and,
    for ``flat_ids``, its FSDP flat shard equals fairscale's own sharding.
    ``node_per_rank``: each rank tells the engine it is a node of its own (a cluster of
    one-GPU machines) and asks for ``parallel``, so ranks that want the same bytes read them
    once between them and exchange (``auto`` would have each "node" read its own copy, the
    files lying on a local disk)."""
    from tests.corpus import assert_same, by_id, canonical, full_weights, fused, split

    if node_per_rank:
        os.environ["METASEQ_ONELOAD_NODE"] = f"node{rank}"

    dp, mpg, dp_rank, mp_rank, w = make_groups(rank, world, mp_size)
    out = []
    for ident in ids:
        e = by_id(ident)
        want = split(full_weights(e), mp_rank, mp_size)
        for flat in (False, True) if ident in flat_ids else (False,):
            what = f"{ident} flat={flat} (world {world}, mp {mp_size}, rank {rank})"
            md = None if (not flat or e.expect["flat"]) else target_metadata(mp_size)
            lc = mo.load_checkpoint(e.path, process_group=dp, model_parallel_group=mpg, flat=flat,
                                    shard_metadata=md, verify=True,
                                    strategy="parallel" if node_per_rank and not flat else "auto")
            try:
                if flat:
                    check_flat(lc.model, lc.shard_metadata, fused(want), dp, dp_rank, w)
                else:
                    assert_same(canonical(lc.model), want, what=what)
            except AssertionError as err:
                raise AssertionError(f"{what}: {err}") from err
            out.append([ident, flat, lc.report.strategy, lc.report.bytes_read, lc.report.verified, lc.report.bytes_out,
                        lc.report.reason])
    return out


def absurd_set_error(rank: int, world: int, folder: str) -> dict:
    """Every rank loads a folder whose names claim a million shards: all must fail fast,
    with a short message. ``baseline``: the seconds of a successful load of the genuine set
    on the same ranks just before (after one to warm up), what "fast" is measured against."""
    import time

    for timed in (False, True):
        dist.barrier()
        t0 = time.perf_counter()
        mo.load_state_dict(FIXTURES / "fsdp_dp3", process_group=dist.group.WORLD)
        baseline = time.perf_counter() - t0
    dist.barrier()
    t0 = time.perf_counter()
    try:
        mo.load_state_dict(folder, process_group=dist.group.WORLD)
    except mo.OneloadError as e:
        return {"type": type(e).__name__, "message": str(e), "seconds": time.perf_counter() - t0,
                "baseline": baseline}
    raise AssertionError(f"rank {rank}: the load did not fail")


def count_discovery(rank: int, world: int, paths) -> dict:
    """Load each path collectively; per load, how many files this rank unpickled and how
    many index identities it checked, and whether the layout it worked from equals what it
    discovers on its own."""
    from metaseq_oneload import _engine, _header, _zip
    from metaseq_oneload.formats import _index

    counts = {"unpickled": 0, "identities": 0}
    real_load, real_id = _header.torch_load, _index.file_identity

    def load(p, **kw):
        counts["unpickled"] += 1
        return real_load(p, **kw)

    def ident(p):
        counts["identities"] += 1
        return real_id(p)

    _header.torch_load, _index.file_identity = load, ident
    seen = []
    real_once = _engine._discover_once

    def once(*a, **kw):
        out = real_once(*a, **kw)
        seen.append(out[0])
        return out

    _engine._discover_once = once
    out = []
    try:
        for p in paths:
            _header._cached_header.cache_clear()
            _zip.zip_index.cache_clear()
            counts.update(unpickled=0, identities=0)
            sd = mo.load_state_dict(p, process_group=dist.group.WORLD)
            row = dict(counts)
            _header.torch_load, _index.file_identity = real_load, real_id
            local = mo.inspect(p)
            _header.torch_load, _index.file_identity = load, ident
            row["same_layout"] = seen[-1] == local and seen[-1].fingerprint() == local.fingerprint()
            row["paths_here"] = all(f.path.startswith(local.directory) for f in seen[-1].all_files)
            row["tensors"] = len(sd)
            out.append(row)
    finally:
        _header.torch_load, _index.file_identity = real_load, real_id
        _engine._discover_once = real_once
    return out


def default_group_load(rank: int, world: int) -> dict:
    """load_state_dict(path) with no group under an initialized torch.distributed: collective
    over the default group (one rank reads the headers); no_dist=True: each rank alone."""
    from metaseq_oneload import _header

    calls = {"n": 0}
    real = _header.torch_load

    def counting(p, **kw):
        calls["n"] += 1
        return real(p, **kw)

    _header.torch_load = counting
    try:
        _header._cached_header.cache_clear()
        lc = mo.load_checkpoint(FIXTURES / "fsdp_dp3")
        collective = {"headers": calls["n"], "strategy": lc.report.strategy}
        _header._cached_header.cache_clear()
        calls["n"] = 0
        local = mo.load_checkpoint(FIXTURES / "fsdp_dp3", no_dist=True)
        alone = {"headers": calls["n"], "strategy": local.report.strategy}
    finally:
        _header.torch_load = real
    assert_matches_reference(lc.model, reference_weights())
    assert_matches_reference(local.model, reference_weights())
    try:
        mo.load_state_dict(FIXTURES / "fsdp_dp3", process_group=dist.group.WORLD, no_dist=True)
        refused = ""
    except ValueError as e:
        refused = str(e)
    return {"collective": collective, "alone": alone, "refused": refused}
