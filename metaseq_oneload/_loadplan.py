"""A load's plan before the load: for a topology you describe (W ranks, M model-parallel parts
of it, on N nodes, some of which may not see the files, on storage of some kind), the
:class:`~._planner.LoadPlan` a load would execute. Nothing but metadata is read.

The plan is made by the planner a load calls (``_planner.plan_part``), from the same inputs
the engine gathers: the same per-part targets (``plan_part`` of ``_plan``), each rank's wants
as :func:`metaseq_oneload.load_state_dict` builds them (on the meta device), and a
:class:`~._planner.Topology` built from the description instead of from the ranks' reports.
So the plan is the load's by construction; tests/distributed/test_load_plan.py holds the two
equal, value for value, on real gloo ranks and simulated nodes.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional, Sequence

import torch

from ._engine import resolve_aliases
from ._errors import OptionError
from ._nodes import page_cache_view
from ._layout import CheckpointLayout
from ._loading import state_dict_wants
from ._options import Options, check_option
from ._conversion import wrapping_metadata
from ._plan import flat_structure, plan_part as plan_targets
from ._planner import LoadPlan, RankPlan, PartPlan, Topology, plan_part, want_ranges
from .formats import discover

__all__ = ["RankPlan", "PartPlan", "LoadPlan", "plan_load", "STORAGE"]

# What a described node's storage is (``storage=``): the cache view each of its ranks reports.
STORAGE = {
    "page_cache": {"shared": True, "private": False, "fs": "shared storage, cached (described)", "why": "", "avail": -1},
    "private": {"shared": True, "private": True, "fs": "a local disk (described)", "why": "", "avail": -1},
    "shared": {"shared": False, "private": False, "fs": "shared storage (described)", "avail": -1,
               "why": "the files lie on storage without a shared page cache (as described)"},
}


def _node_of(world: int, nodes: Optional[int], ranks_per_node: Optional[int]) -> list:
    """Each global rank's node index, torchrun's way: consecutive ranks share a node."""
    check_option("nodes", nodes)
    check_option("ranks_per_node", ranks_per_node)
    if nodes is not None and ranks_per_node is not None and nodes * ranks_per_node != world:
        raise OptionError(f"nodes={nodes} x ranks_per_node={ranks_per_node} != world={world}: give one of them, or "
                          "both with their product the world.")
    if nodes is not None:
        if world % nodes:
            raise OptionError(f"world={world}, nodes={nodes}: every node runs as many ranks (the world must be a "
                              "multiple of the node count).")
        ranks_per_node = world // nodes
    per = ranks_per_node or world
    return [g // per for g in range(world)]


def topology(world: int, model_parallel: int, m: int, node_of: Sequence[int], blind_nodes: Sequence[int],
             views: Sequence, shm: bool) -> Topology:
    """(local) The topology of model-parallel part ``m``'s data-parallel group, described."""
    ranks = tuple(d * model_parallel + m for d in range(world // model_parallel))
    return Topology(model_parallel=model_parallel, ranks=ranks, nodes=tuple(f"node{node_of[g]}" for g in ranks),
                    readers=tuple(d for d, g in enumerate(ranks) if node_of[g] not in blind_nodes),
                    caches=tuple(views[g] for g in ranks), shm=shm,
                    why_blind="CheckpointNotFoundError: its node does not see the files (as described)")


def _structure(layout, targets, flat: bool, shard_metadata, wrapping, trust_pickle: bool) -> tuple:
    """(the flat structure or None, what the plan assumed about it)."""
    if not flat:
        return None, ""
    if shard_metadata is None and wrapping is not None:
        shard_metadata = wrapping_metadata(wrapping, trust_pickle)
    assumed = shard_metadata is None and not layout.flat and layout.flavor != "pytorch"
    structure = flat_structure(layout, targets, shard_metadata, assume_metaseq=assumed)
    return structure, ("; flat shards as metaseq wraps its models (each *.layers.N its own FSDP instance; "
                       "wrapping=SHARD.pt (CLI: --wrapping SHARD.pt) plans another model's)" if assumed else "")


def plan_load(
    path: "str | os.PathLike | CheckpointLayout",
    *,
    world: int,
    model_parallel: int = 1,
    nodes: Optional[int] = None,
    ranks_per_node: Optional[int] = None,
    blind_nodes: Sequence[int] = (),
    storage: Optional[str] = None,
    flat: bool = False,
    strategy: str = "auto",
    shard_metadata: Optional[Mapping] = None,
    bucket_mb: float = 256,
    chunk_mb: float = 64,
    qkv: str = "auto",
    dtype: Optional[torch.dtype] = None,
    trust_pickle: bool = False,
    wrapping: "Mapping | str | os.PathLike | None" = None,
) -> LoadPlan:
    """(local, metadata only) The plan ``load_state_dict(path, flat=..., strategy=...)`` would
    execute on the topology described.

    Args:
        path: anything :func:`metaseq_oneload.inspect` takes, or its layout.
        world: the total number of ranks; a multiple of ``model_parallel``.
        model_parallel: the target model-parallel size.
        nodes, ranks_per_node: how the ranks sit on nodes (consecutive ranks share one, as
            torchrun places them); default one node.
        blind_nodes: indices of nodes whose ranks cannot see the files (they receive).
        storage: what the files lie on, for every node: "shared" (network or object
            storage, no page cache shared by a node's ranks), "page_cache" (shared storage
            read through each node's page cache), "private" (each node's own copy on a
            local disk); default: as this machine sees ``path``.
        flat, strategy, shard_metadata, bucket_mb, chunk_mb, qkv, dtype, trust_pickle: as
            for :func:`metaseq_oneload.load_state_dict`.
        wrapping: instead of ``shard_metadata``, a flat shard file whose FSDP wrapping the
            model follows (as :func:`metaseq_oneload.convert`'s). With ``flat=True`` on
            unflattened metaseq weights and neither given, the plan assumes metaseq's wrapping
            (each ``*.layers.N`` its own FSDP instance) and its reason says so.

    Raises:
        OptionError: ``world`` is not a positive multiple of ``model_parallel`` (or of
            ``nodes``), or ``storage`` is not one of the kinds above.
        CheckpointLayoutError: the strategy cannot load this layout (as the load would say).
    """
    check_option("world", world)
    check_option("model_parallel", model_parallel)
    if world % model_parallel:
        raise OptionError(f"world={world}, model_parallel={model_parallel}: the world must be a positive multiple "
                          "of the model-parallel size (each model-parallel part has as many data-parallel ranks).")
    if storage is not None and storage not in STORAGE:
        raise OptionError(f"storage={storage!r}: expected one of {', '.join(STORAGE)} (or None: as this machine "
                          "sees the files).")
    node_of = _node_of(world, nodes, ranks_per_node)
    opts = Options(strategy=strategy, bucket_mb=bucket_mb, chunk_mb=chunk_mb, trust_pickle=trust_pickle, qkv=qkv,
                   dtype=dtype)
    layout = path if isinstance(path, CheckpointLayout) else discover(path, trust_pickle=trust_pickle)
    view = STORAGE[storage] if storage else page_cache_view([f.path for f in layout.all_files])
    views = [view] * world
    dp_size = world // model_parallel
    parts, note = [], ""
    for m in range(model_parallel):
        topo = topology(world, model_parallel, m, node_of, set(blind_nodes), views, opts.settings.shm)
        targets = plan_targets(layout, model_parallel, m, qkv=qkv, dtype=dtype)
        structure, note = _structure(layout, targets, flat, shard_metadata, wrapping, trust_pickle)
        ranges, direct = [], []
        for d in range(dp_size):
            wants = resolve_aliases(state_dict_wants(targets, structure, flat, d, dp_size, "meta")[0], targets)
            ranges.append(want_ranges(wants))
            # outputs are CPU tensors of the targets' dtype (load_state_dict's default device)
            direct.append([w.out.dtype == targets[w.name].dtype and w.out.is_contiguous() for w in wants])
        parts.append(plan_part(layout, targets, ranges, direct, topo, opts, flat, m))
    return LoadPlan(path=layout.display_name, kind=layout.kind, saved_model_parallel=layout.model_parallel_size,
                    saved_shards=layout.shards_per_part, saved_flat=layout.flat, world=world,
                    model_parallel=model_parallel, flat=flat, model_bytes=layout.total_bytes, parts=tuple(parts),
                    note=note)
