"""This rank's view of a checkpoint set and of its groups, as both libraries' patches need
it: the set a path names (:func:`locate`, the way metaseq and fairseq name files), the file
whose cfg, meters and optimizer state go with this rank and everything in it but the weights
(:func:`read_rest`), the data- and model-parallel groups as the engine takes them (and a
model's fairscale FSDP root, with its local load), and a rank's preparation that fails all of
them at once (:func:`before_load`).

All functions here are local: none talks to other ranks, except :func:`before_load`, which
tells them of a failure.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import re
from typing import Any, Callable, Mapping, Optional, Tuple

import torch

from .. import _reading, _storage
from .._begun import begin, forget_begun
from .._dist import Group, tell_failed
from .._errors import CheckpointLayoutError, CheckpointNotFoundError
from .._optim import rest_source
from ..formats import discover

__all__ = ["OPT_KEY", "locate", "exists", "remote", "before_load", "answered_alone", "real_group", "rank_in", "fsdp_root",
           "fsdp_load_local", "rest_file", "read_rest", "owning", "named_part", "part_layout", "fuse_split_qkv"]

OPT_KEY = "last_optimizer_state"


def remote(path: Any) -> bool:
    """URLs the engine cannot read here stay with the library: a protocol fsspec does not
    know (manifold://), or no fsspec installed. s3://, gs://, ... go through the engine."""
    return isinstance(path, str) and "://" in path and not _storage.readable_url(path)


_RANK_SUFFIX = re.compile(r"(-model_part-\d+)?(-shard\d+)?\.pt$")


def locate(path: Any, suffix: str = ""):
    """(local) The checkpoint set ``path`` names, the way metaseq names files: ``path`` with
    this rank's ``suffix`` when that file exists, else ``path`` itself (a folder, any file,
    the un-suffixed name), else ``path`` with a rank suffix stripped (the suffix of a
    world size other than the one that saved).

    Raises:
        CheckpointNotFoundError: none of them exists. CheckpointLayoutError: a damaged set
            is never skipped for another candidate.
    """
    path = os.fspath(path)
    candidates = []
    if suffix and path.endswith(".pt") and not path.endswith(suffix + ".pt"):
        suffixed = path[:-3] + suffix + ".pt"
        if _storage.lexists(suffixed):
            candidates.append(suffixed)
    candidates.append(path)
    if path.endswith(".pt"):
        candidates.append(_RANK_SUFFIX.sub(".pt", path))
    first: Optional[BaseException] = None
    for c in dict.fromkeys(candidates):
        try:
            return discover(c)
        except CheckpointNotFoundError as e:
            first = first or e
    raise first


def exists(path: str) -> bool:
    try:
        locate(path)
    except CheckpointNotFoundError:
        return False
    return True


@contextlib.contextmanager
def before_load(process_group: Any = None, model_parallel_group: Any = None, unless: tuple = ()):
    """(this rank alone) This rank's own preparation of a collective load over the groups
    given (its discovery of the set, :func:`locate`, a check of the files): an error raised
    in the block tells the ranks of those groups at once (as the engine's entry points do
    for their arguments, :func:`metaseq_oneload._dist.tell_failed`), so they stop with its
    reason instead of waiting ``arrival_timeout`` for a rank that is not coming. Errors of
    the types in ``unless`` (those the caller answers without loading, on every rank alike:
    no checkpoint yet) pass without telling. None for a group: not part of the load.

    The load's call begins here (:func:`metaseq_oneload._begun.begin`): a check-in the others
    give up on while this rank discovers is this load's, so a failure here, or the rank's
    arrival, after that is told to it at once, never left for the others' next load."""
    groups = _load_groups(process_group, model_parallel_group)
    begin(groups)
    try:
        yield
    except BaseException as e:
        if isinstance(e, unless):
            forget_begun(groups)  # answered without loading: no check-in follows
        else:
            tell_failed(groups, e)
        raise


def answered_alone(process_group: Any = None, model_parallel_group: Any = None) -> None:
    """(this rank alone) The call :func:`before_load` began is answered on this rank without
    a collective load (the file as saved, read by this rank): no check-in follows, so the
    rank's next call must not be taken for this one."""
    forget_begun(_load_groups(process_group, model_parallel_group))


def _load_groups(process_group: Any, model_parallel_group: Any) -> list:
    groups = []
    for g, role in ((process_group, "data-parallel"), (model_parallel_group, "model-parallel")):
        if g is not None:
            with contextlib.suppress(Exception):
                groups.append(Group(g, role))
    return groups


def real_group(group: Any) -> Any:
    """``group`` if it is a torch.distributed group of more than one rank, else None
    (fairscale's DummyProcessGroup, a group of one)."""
    import torch.distributed as dist

    if group is None or not (dist.is_available() and dist.is_initialized()):
        return None
    if not isinstance(group, dist.ProcessGroup):
        return None
    try:
        return group if dist.get_world_size(group) > 1 else None
    except (RuntimeError, ValueError):
        return None


def rank_in(group: Any) -> Tuple[int, int]:
    import torch.distributed as dist

    return (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)


def fsdp_root(model: Any) -> Any:
    """``model`` if it is a fairscale FullyShardedDataParallel, else None."""
    try:
        from fairscale.nn.data_parallel import FullyShardedDataParallel
    except ImportError:
        return None
    return model if isinstance(model, FullyShardedDataParallel) else None


def fsdp_load_local(model: Any, state_dict: Mapping, strict: bool = True) -> Any:
    """(local) fairscale's ``load_local_state_dict``, also before the first forward.

    fairscale 0.4.13 ends it by freeing every instance's full parameters, which do not
    exist before the lazy init of the first forward (AttributeError ``_full_param_padded``);
    here only parameters that were initialised are freed, and an uninitialised model stays
    uninitialised, as fairscale's own ``load_state_dict`` leaves it.
    """
    from fairscale.nn.data_parallel import fully_sharded_data_parallel as fsdp

    model.assert_state([fsdp.TrainingState.IDLE, fsdp.TrainingState.FORWARD, fsdp.TrainingState.BACKWARD_PRE,
                        fsdp.TrainingState.BACKWARD_POST])
    uninitialized = model._is_root is None
    with contextlib.ExitStack() as stack:
        for m in fsdp.get_fsdp_instances(model):
            stack.enter_context(m._no_return_full_state_dict())
        output = model._load_state_dict(state_dict, strict)
    for m in fsdp.get_fsdp_instances(model):
        initialised = [p for p in m.params if hasattr(p, "_fp32_shard")]
        if initialised:
            m._free_full_params(initialised)
    if uninitialized and model._is_root:
        for m in fsdp.get_fsdp_instances(model):
            m._reset_lazy_init()
    return output


def rest_file(layout, dp_group: Any = None, mp_group: Any = None) -> str:
    """(local) The file whose cfg, meters and extra_state go with this rank
    (:func:`._optim.rest_source`, the rule the offline conversion follows too)."""
    mp_rank, mp_size = rank_in(mp_group)
    dp_rank, dp_size = rank_in(dp_group)
    return rest_source(layout, mp_rank, mp_size, dp_rank, dp_size)


def owning(obj: Any) -> Any:
    """A copy of ``obj`` whose tensors own their memory: what a memory-mapped load returns
    must not outlive a checkpoint file that training may overwrite in place."""
    if torch.is_tensor(obj):
        return obj.clone()
    if isinstance(obj, dict):
        out = obj.copy()  # keeps OrderedDict / defaultdict
        for k, v in obj.items():
            out[k] = owning(v)
        return out
    if isinstance(obj, list):
        return [owning(v) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(owning(v) for v in obj)
    return obj


def read_rest(path: str, *, skip_optimizer: bool, cast: Optional[Callable[[dict], None]] = None) -> dict:
    """(local) Everything in one checkpoint file except the model weights, read through
    the safe reader; memory-mapped, so the weights it skips cost nothing. The optimizer
    state stays mapped until :func:`._optimizer.place_optimizer_state` decides what of it to keep.
    ``cast``: the library's own treatment of the saved cfg, applied in place."""
    # the weights (and a skipped optimizer state) are left out: from an object store they
    # are then never fetched
    obj = _reading.load_object(path, mmap=True, exclude=("model",) + ((OPT_KEY,) if skip_optimizer else ()))
    if not isinstance(obj, dict):
        raise CheckpointLayoutError(f"{path}: expected a metaseq checkpoint (a dict), found {type(obj).__name__}.")
    rest = {k: (v if k == OPT_KEY else owning(v)) for k, v in obj.items()
            if k != "model" and not (skip_optimizer and k == OPT_KEY)}
    del obj
    if cast is not None:
        cast(rest)
    return rest


def named_part(path: Any, layout) -> Optional[int]:
    """The model part of the set that ``path`` names when it is one existing file of it
    (a link to one included), else None (a folder, an un-suffixed name)."""
    if not isinstance(path, (str, os.PathLike)) or not _storage.isfile(os.fspath(path)):
        return None
    real = _storage.realpath(os.fspath(path))
    for row in layout.files:
        for f in row:
            if _storage.realpath(f.path) == real:
                return f.part
    return None


def part_layout(layout, part: int):
    """``layout`` reduced to its model part ``part``, as a set of one part: what a script
    that names one part's file (and has no model-parallel group) reads."""
    if layout.model_parallel_size == 1:
        return layout

    p = layout.parts[part]
    tensors = collections.OrderedDict((n, dataclasses.replace(t, part=0)) for n, t in p.tensors.items())
    files = tuple(dataclasses.replace(f, part=0) for f in layout.files[part])
    return dataclasses.replace(layout, files=(files,), parts=(dataclasses.replace(p, index=0, tensors=tensors),))


def fuse_split_qkv(model: Mapping) -> Mapping:
    """``model`` with each split ``k_proj``/``v_proj``/``q_proj`` (weight, bias) fused into
    metaseq's ``qkv_proj`` = cat([k, v, q]), at ``k_proj``'s place; other entries as they are."""
    out = model.copy() if isinstance(model, dict) else dict(model)
    out.clear()
    done = set()
    for name, value in model.items():
        head, _, leaf = name.rpartition(".")
        base, _, proj = head.rpartition(".")
        if proj in ("k_proj", "v_proj", "q_proj") and base.endswith("self_attn"):
            parts = [model.get(f"{base}.{x}.{leaf}") for x in ("k_proj", "v_proj", "q_proj")]
            if all(torch.is_tensor(t) for t in parts):
                if (base, leaf) not in done:
                    done.add((base, leaf))
                    out[f"{base}.qkv_proj.{leaf}"] = torch.cat(parts)
                continue
        out[name] = value
    return out


