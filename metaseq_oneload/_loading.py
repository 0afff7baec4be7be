"""The verbs: :func:`load_state_dict`, :func:`load_checkpoint` and :func:`load_into`.

One engine serves them all. Each rank states what it wants as a list of :class:`Want`
(a target tensor, an element range of it, and the memory to fill); the engine agrees on
the layout with the other ranks, picks a strategy, and fills the wants:

``own_shard``
    The saved layout matches the world (same model-parallel size, one saved shard per
    data-parallel rank, same flattening): each rank reads only its own file.
    Peak extra CPU memory per rank = its output, ``B / (M' * W)`` for ``flat=True``
    (``B`` model bytes, ``M'`` target model-parallel size, ``W`` data-parallel size).
``reshard``
    Any saved shard count D onto any W, any saved model-parallel size onto any M': each
    rank reads exactly the byte ranges its wants cover, from whichever files hold them,
    with ``os.preadv`` straight into the destination (padding handled exactly).
    Peak extra = output + at most one staging chunk (``chunk_mb``, only for dtype/device
    conversion or a row-parallel weight whose model-parallel split changes).
``broadcast``
    On request (``auto`` sends ranks that cannot see the files to ``parallel``, which reads
    on every rank that can): data-parallel rank 0 of each
    model-parallel part reads (byte ranges, as above). Where every rank wants everything
    (``flat=False``) it broadcasts large tensors straight from its output into theirs and
    small ones in buckets of ``bucket_mb / W``: peak extra = output + ``bucket_mb / W`` per
    rank, one bucket summed over the group. Where ranks want different pieces (flat shards,
    FSDP2) it sends each rank its pieces point to point, received straight into its
    tensors: the reader holds output + one bucket, the others their output.
``parallel``
    Read once, exchange: every byte some rank wants is read by one rank that sees the files
    (one that wants it where it can, balanced by bytes) and sent point to point to the
    others, a node's share crossing the network once (see ``_exchange``). ``auto`` picks it
    when ranks on different nodes want the same bytes (``flat=False``, replicated tensors)
    from shared storage (a network filesystem, an object store), or some cannot see the
    files; ``own_shard`` and ``reshard`` read bytes wanted by several ranks the same way.
    Ranks of one node whose page cache holds the files (checked:
    ``_nodes.page_cache_view``, ``cached_nodes``) each read what they want through it,
    so inside a node nothing travels but what crossed into it; a node with a copy on a disk
    of its own (``private_nodes``) reads what its ranks want there, and nothing crosses
    into it. Asked for by name, it reads every byte once in all, inside a node and across
    own copies too. Storage bytes read, summed over the cluster = the model's bytes (not W
    times; once per copy where nodes have their own). Peak extra = output + at most one
    bucket of staging per rank (pieces that cannot land in place: none for CPU outputs of
    the stored dtype), + the rank's own shared-memory slots: ``bucket_mb / readers`` with
    the pieces it has mapped out of its neighbours' (one bucket summed over a node).

With no process group at all everything runs locally in one process (no collectives).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Mapping, Optional

import torch
import torch.distributed as dist

from ._begun import begin, load_call
from ._dist import Group, tell_failed
from ._engine import LoadReport, run
from ._errors import StateDictMismatchError
from ._execute import Want
from ._into import is_dtensor, module_wants
from ._layout import CheckpointLayout
from ._options import Options, Progress
from ._plan import FlatStructure, TargetTensor, qkv_naming

__all__ = ["LoadReport", "LoadedCheckpoint", "load_state_dict", "load_checkpoint", "load_into", "state_dict_wants"]


@dataclass(frozen=True)
class LoadedCheckpoint:
    """The result of :func:`load_checkpoint`: this rank's model state dict and, for
    ``flat=True``, the fairscale ``shard_metadata`` that describes it."""

    model: "OrderedDict[str, torch.Tensor]"
    shard_metadata: Optional[dict]
    layout: Optional[CheckpointLayout]
    report: LoadReport


# --------------------------------------------------------------------------- verbs


def load_groups(process_group, model_parallel_group, no_dist: bool = False) -> tuple:
    """(local) The groups a load runs over, by torch's convention (as
    ``torch.distributed.checkpoint`` has it): ``process_group=None`` is the default group
    when ``torch.distributed`` is initialized, so that a plain ``load_state_dict(path)``
    under torchrun reads once instead of once per rank; ``no_dist=True`` loads in this
    process alone."""
    if no_dist:
        if process_group is not None or model_parallel_group is not None:
            raise ValueError("no_dist=True loads in this process alone: pass no process_group or "
                             "model_parallel_group with it.")
        return Group(None, "data-parallel"), Group(None, "model-parallel")
    if process_group is None and dist.is_available() and dist.is_initialized():
        if model_parallel_group is None:
            process_group = dist.group.WORLD
        elif dist.get_world_size(model_parallel_group) != dist.get_world_size():
            raise ValueError(
                "process_group=None with a model_parallel_group of "
                f"{dist.get_world_size(model_parallel_group)} of the {dist.get_world_size()} ranks: pass the "
                "data-parallel group too (the ranks that hold the same model part), or no_dist=True to load in "
                "this process alone.")
    return Group(process_group, "data-parallel"), Group(model_parallel_group, "model-parallel")


def _tell_failed(error: BaseException, process_group, model_parallel_group, no_dist: bool,
                 module: Optional[torch.nn.Module] = None, timeout: Optional[float] = None) -> None:
    """(this rank alone) Its call to a load failed before the check-in: tell the ranks of
    the groups it would have loaded with (as far as its arguments give them; the default
    group, or ``module``'s DTensor mesh, where none is given) so that they stop now, with
    this rank's reason, instead of waiting ``arrival_timeout`` for it. ``timeout``: the
    caller's ``arrival_timeout``. Never raises."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    if no_dist and process_group is None and model_parallel_group is None:
        return  # a load of this process alone: no one waits for it
    if process_group is None and module is not None:
        with contextlib.suppress(Exception):
            mesh = next((t.device_mesh for t in module.state_dict(keep_vars=True).values() if is_dtensor(t)), None)
            if mesh is not None and mesh.ndim == 1:
                process_group = mesh.get_group()
    try:
        groups = list(load_groups(process_group, model_parallel_group))
    except Exception:  # noqa: BLE001  (the arguments were what failed: each group that can be built)
        groups = []
        for g, role in ((dist.group.WORLD if process_group is None else process_group, "data-parallel"),
                        (model_parallel_group, "model-parallel")):
            if g is not None:
                with contextlib.suppress(Exception):
                    groups.append(Group(g, role))
    tell_failed(groups, error, timeout)


def state_dict_wants(targets: Mapping[str, TargetTensor], structure: Optional[FlatStructure], flat: bool,
                     dp_rank: int, dp_size: int, device: "str | torch.device") -> tuple:
    """(local) What :func:`load_state_dict` fills on one rank: (the wants, the state dict
    they land in). :func:`~metaseq_oneload._loadplan.plan_load` calls it on the ``meta``
    device, so a plan states exactly the load's pieces."""
    out: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    wants = []
    if not flat:
        for name, t in targets.items():
            if t.alias_of is None:
                out[name] = torch.empty(t.shape, dtype=t.dtype, device=device)
                wants.append(Want(name, 0, out[name].view(-1)))
        for name, t in targets.items():
            if t.alias_of is not None:
                out[name] = out[t.alias_of]  # tied: one tensor under both names
        return wants, out
    covered = set()
    for g in structure.groups:
        dtypes = {targets[n].dtype for n in g.names}
        if len(dtypes) > 1:
            raise StateDictMismatchError(f"{g.key}: members have mixed dtypes {sorted(map(str, dtypes))}.")
        pieces, size = g.shard_pieces(dp_rank, dp_size)
        local = torch.empty(size, dtype=dtypes.pop() if dtypes else torch.float32, device=device)
        filled = pieces[-1][3] + pieces[-1][2] - pieces[-1][1] if pieces else 0
        local[filled:].zero_()  # fairscale pads the tail with zeros
        out[g.key] = local
        for n, start, stop, offset in pieces:
            wants.append(Want(n, start, local[offset: offset + stop - start]))
        covered.update(g.names)
    for name, t in targets.items():
        if name in covered or t.alias_of is not None:
            continue
        out[name] = torch.empty(t.shape, dtype=t.dtype, device=device)
        wants.append(Want(name, 0, out[name].view(-1)))
    return wants, out


@load_call()  # where this call's check-ins count from is forgotten when it ends
def load_checkpoint(
    path: "str | os.PathLike",
    *,
    process_group: Optional["dist.ProcessGroup"] = None,
    model_parallel_group: Optional["dist.ProcessGroup"] = None,
    flat: bool = False,
    strategy: str = "auto",
    shard_metadata: Optional[Mapping] = None,
    bucket_mb: float = 256,
    chunk_mb: float = 64,
    verify: "bool | str" = False,
    dtype: Optional[torch.dtype] = None,
    device: "str | torch.device" = "cpu",
    qkv: str = "auto",
    rules: Optional[Mapping[str, str]] = None,
    trust_pickle: bool = False,
    progress: Progress = None,
    arrival_timeout: Optional[float] = None,
    no_dist: bool = False,
) -> LoadedCheckpoint:
    """(collective over the groups given) Like :func:`load_state_dict`, returning the
    state dict with its ``shard_metadata``, the layout and a :class:`LoadReport`."""
    try:
        opts = Options(strategy=strategy, bucket_mb=bucket_mb, chunk_mb=chunk_mb, verify=verify,
                        trust_pickle=trust_pickle, qkv=qkv, rules=rules, dtype=dtype, progress=progress,
                        arrival_timeout=arrival_timeout)
        dp, mp = load_groups(process_group, model_parallel_group, no_dist)
        begin((dp, mp))  # this call's check-ins are counted from here (_begun.begin)
    except BaseException as e:
        _tell_failed(e, process_group, model_parallel_group, no_dist, timeout=arrival_timeout)
        raise
    out: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    meta: dict = {}

    def make_wants(targets, structure, layout):
        wants, filled = state_dict_wants(targets, structure, flat, dp.rank, dp.size, device)
        out.update(filled)
        if flat:
            meta.update(structure.shard_metadata(dp.rank, dp.size))
        return wants

    layout, _, _, report = run(path, dp, mp, opts, flat, shard_metadata, make_wants)
    if flat:
        out.shard_metadata = meta  # like torch's state_dict._metadata: travels with the dict
    return LoadedCheckpoint(out, meta if flat else None, layout, report)


def load_state_dict(
    path: "str | os.PathLike",
    *,
    process_group: Optional["dist.ProcessGroup"] = None,
    model_parallel_group: Optional["dist.ProcessGroup"] = None,
    flat: bool = False,
    strategy: str = "auto",
    shard_metadata: Optional[Mapping] = None,
    bucket_mb: float = 256,
    chunk_mb: float = 64,
    verify: "bool | str" = False,
    dtype: Optional[torch.dtype] = None,
    device: "str | torch.device" = "cpu",
    qkv: str = "auto",
    rules: Optional[Mapping[str, str]] = None,
    trust_pickle: bool = False,
    progress: Progress = None,
    arrival_timeout: Optional[float] = None,
    no_dist: bool = False,
) -> "OrderedDict[str, torch.Tensor]":
    """(collective over the groups given) This rank's part of any checkpoint's weights.

    Args:
        path: any file of the checkpoint, its folder, its un-suffixed name, or a glob.
        process_group: the data-parallel group (size W). None: torch's default group when
            ``torch.distributed`` is initialized (then the load is collective over every
            rank), else no collectives.
        model_parallel_group: the model-parallel group (size M'). None: M' = 1, every rank
            gets the whole model with all saved model-parallel parts merged.
        flat: False: the unflattened tensors of this rank's model-parallel part (identical on
            every data-parallel rank), with metaseq's names (fused ``qkv_proj``, rows k, v, q
            per part; the tied ``output_projection`` shares ``embed_tokens``' tensor).
            True: this rank's fairscale FSDP local shard for W ranks (``flat_param_*`` keys and
            buffers), with the matching metadata in the result's ``shard_metadata`` attribute;
            what ``FullyShardedDataParallel.load_local_state_dict`` expects.
        strategy: "auto" (chooses and logs why), "own_shard", "reshard", "broadcast" or "parallel"; see
            the module docstring for each one's peak memory.
        shard_metadata: for ``flat=True`` from an unflattened checkpoint: the target
            wrapping, i.e. fairscale's ``model.local_metadata_dict()``.
        bucket_mb: broadcast bucket size (peak extra memory of every rank when broadcasting).
        chunk_mb: staging size for dtype/device conversion and model-parallel column blocks.
        verify: True: also compare per-tensor sums of what was loaded with torch's own
            (memory-mapped) reading of the source; costs one more read. ``"digest"``: check
            every stored tensor the load reads against the digest recorded beside the set
            (by ``convert``/``consolidate``), hashing the bytes as they are read (no byte
            read twice); a mismatch raises :class:`DigestError` on every rank, naming the
            tensor and the file; a set with no recorded digest raises it before reading.
        dtype: cast to this dtype (default: as stored).
        device: where the returned tensors live.
        qkv: "auto" (fuse split k/v/q for metaseq checkpoints), "fused", "split" or "keep".
        rules: extra model-parallel split rules, name suffix -> "column"|"row"|"replicated"|"qkv".
        trust_pickle: unpickle without the allowlist. Unsafe: runs code from the file.
        progress: show a progress bar (default: on a terminal, rank 0, loads >= 256 MiB), or
            a callable that receives (bytes done so far, bytes in all) after each piece lands.
        arrival_timeout: seconds every rank waits, at the start, for the others to reach the
            load (default: ``$METASEQ_ONELOAD_ARRIVAL_TIMEOUT``, else 300). A rank that never
            comes (it failed earlier and went on) makes every rank that did raise
            :class:`DistributedLoadError` naming it, instead of waiting in a collective for
            the process group's timeout. A rank whose call fails before the check-in (a bad
            argument) does not cost the others this wait: they raise its reason at once.
        no_dist: load in this process alone, with no collectives, even where
            ``torch.distributed`` is initialized (each process then reads what it needs itself).

    Returns:
        An ``OrderedDict`` of tensors (with ``.shard_metadata`` when ``flat=True``).

    Raises:
        CheckpointLayoutError: bad files (single process), see :func:`inspect`.
        DistributedLoadError: on every rank, when any rank failed, did not arrive within
            ``arrival_timeout``, or was lost mid-load (the backend's error is the cause).
        StateDictMismatchError: the requested target does not fit the checkpoint.
        DigestError: ``verify="digest"``: a tensor's bytes do not match the recorded digest,
            or the set records none.

    Example::

        sd = load_state_dict("/ckpt/checkpoint_last.pt", process_group=dp, flat=True)
        fsdp_model.load_local_state_dict(sd)
    """
    return load_checkpoint(path, process_group=process_group, model_parallel_group=model_parallel_group,
                           flat=flat, strategy=strategy, shard_metadata=shard_metadata, bucket_mb=bucket_mb,
                           chunk_mb=chunk_mb, verify=verify, dtype=dtype, device=device, qkv=qkv, rules=rules,
                           trust_pickle=trust_pickle, progress=progress, arrival_timeout=arrival_timeout, no_dist=no_dist).model


# --------------------------------------------------------------------------- load_into


def _prepare_into(module, process_group, model_parallel_group, strategy, device, bucket_mb, chunk_mb, verify, qkv,
                  rules, trust_pickle, progress, arrival_timeout, no_dist) -> tuple:
    """(local) :func:`load_into`'s work before the check-in: the module's tensors, the
    groups (from its DTensors' mesh where none is given) and the options."""
    entries = module.state_dict(keep_vars=True)
    mesh = next((t.device_mesh for t in entries.values() if is_dtensor(t)), None)
    if no_dist and mesh is not None:
        raise ValueError(f"{type(module).__name__} holds DTensor parameters (FSDP2): its shards are loaded "
                         "over their mesh's group, so no_dist=True cannot be used with it.")
    if process_group is None and mesh is not None:
        if mesh.ndim == 1:
            process_group = mesh.get_group()
        elif mesh.size() == dist.get_world_size():
            # Every rank of a multi-dimensional mesh (HSDP, FSDP + TP) wants its own box:
            # one group over all of them lets any failure reach every rank.
            process_group = dist.group.WORLD
        else:
            raise ValueError(
                f"{type(module).__name__} is sharded over a {mesh.ndim}-D mesh of {mesh.size()} ranks in a world of "
                f"{dist.get_world_size()}: pass process_group=<a group of exactly the mesh's ranks>.")
    if device is None and mesh is not None:
        device = mesh.device_type  # FSDP2 on GPUs: materialise where the mesh lives
    if qkv is None:
        qkv = qkv_naming(entries)
    opts = Options(strategy=strategy, bucket_mb=bucket_mb, chunk_mb=chunk_mb, verify=verify,
                    trust_pickle=trust_pickle, qkv=qkv, rules=rules, progress=progress,
                    arrival_timeout=arrival_timeout)
    dp, mp = load_groups(process_group, model_parallel_group, no_dist)
    begin((dp, mp))  # before the optimizer's folder is read: this call's check-ins count from here
    return entries, process_group, device, opts, dp, mp


@load_call()
def load_into(
    module: torch.nn.Module,
    path: "str | os.PathLike",
    *,
    process_group: Optional["dist.ProcessGroup"] = None,
    model_parallel_group: Optional["dist.ProcessGroup"] = None,
    strategy: str = "auto",
    strict: bool = True,
    device: "str | torch.device | None" = None,
    bucket_mb: float = 256,
    chunk_mb: float = 64,
    verify: "bool | str" = False,
    qkv: Optional[str] = None,
    rules: Optional[Mapping[str, str]] = None,
    trust_pickle: bool = False,
    progress: Progress = None,
    arrival_timeout: Optional[float] = None,
    no_dist: bool = False,
    optimizer: Optional["torch.optim.Optimizer"] = None,
) -> LoadReport:
    """(collective over the groups given) Fill ``module``'s parameters and buffers in place.

    Works on a plain module, on a module built on the ``meta`` device (each tensor is
    materialised on ``device`` -- default CPU -- as it is loaded, so no rank ever holds a
    second copy), and on a module sharded with torch FSDP2 ``fully_shard`` (DTensor
    parameters: each rank receives only its shard). With DTensor parameters and no
    ``process_group``, the parameters' mesh group is used.

    Keys and shapes are checked before anything is written: with ``strict`` a missing,
    unexpected or wrongly shaped tensor raises :class:`StateDictMismatchError` naming the
    first few; without it, only wrongly shaped ones do and the rest is skipped.
    Other arguments as for :func:`load_state_dict` (``arrival_timeout`` included).

    With ``optimizer`` (a torch optimizer built over ``module``'s parameters, after it is
    materialised or sharded), its state is filled too, from a ``torch.distributed.checkpoint``
    folder saved with ``get_state_dict(model, optim)``: each state tensor is read in the same
    load as the weights and placed as its parameter is (resharded onto any world), the
    ``param_groups`` read as plain data only, and the result handed to torch's
    ``set_optimizer_state_dict``. A checkpoint without optimizer state raises
    :class:`OptionError`, and so does a metaseq or fairseq set's trainer state (resume those
    through :func:`install`).

    Returns:
        The :class:`LoadReport` (strategy, bytes read, time).
    """
    try:
        entries, process_group, device, opts, dp, mp = _prepare_into(
            module, process_group, model_parallel_group, strategy, device, bucket_mb, chunk_mb, verify, qkv, rules,
            trust_pickle, progress, arrival_timeout, no_dist)
        source, optim = path, None
        if optimizer is not None:  # the folder described here, its optimizer state as shadows
            from ._optim_into import prepare as prepare_optimizer  # (no plain load's import cost)

            source, optim = prepare_optimizer(path, optimizer, model_parallel=mp.size, strict=strict,
                                              trust_pickle=trust_pickle)
    except BaseException as e:
        _tell_failed(e, process_group, model_parallel_group, no_dist, module, timeout=arrival_timeout)
        raise
    post: list = []
    unloaded: list = []
    materialize_on = torch.device(device) if device is not None else torch.device("cpu")
    make_wants = module_wants(module, path, entries, strict, materialize_on, post, unloaded)
    if optim is not None:
        make_wants = optim.wrap(module, optimizer, post, make_wants)
    _, _, _, report = run(source, dp, mp, opts, False, None, make_wants)
    with torch.no_grad():
        for fn in post:
            fn()
    if optim is not None:
        optim.finish(module, optimizer)
    return dataclasses.replace(report, unloaded=tuple(unloaded))

