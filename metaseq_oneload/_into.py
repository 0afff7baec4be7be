"""What :func:`~metaseq_oneload.load_into` wants of a module: its tensors matched against the
checkpoint's targets (keys and shapes, before anything is written), meta tensors materialised,
ties kept, and each rank's element range of a DTensor (FSDP2) shard."""

from __future__ import annotations

import math
import sys
from typing import Callable, List, Mapping

import torch

from ._errors import StateDictMismatchError, cap_list
from ._execute import Want

__all__ = ["is_dtensor", "owner_of", "dtensor_want", "module_wants"]


def owner_of(module: torch.nn.Module, name: str) -> tuple:
    """(the submodule that holds ``name``, the attribute's name in it)."""
    *path, leaf = name.split(".")
    m = module
    for p in path:
        m = getattr(m, p)
    return m, leaf


def is_dtensor(t) -> bool:
    # No DTensor exists until its module is imported: importing it here would cost a plain
    # module's load_into half a second and more (seconds on a busy host) before its check-in.
    for name in ("torch.distributed.tensor", "torch.distributed._tensor"):  # torch < 2.4: the latter
        cls = getattr(sys.modules.get(name), "DTensor", None)
        if cls is not None:
            return isinstance(t, cls)
    return False


def dtensor_want(name: str, t, post: list) -> Want:
    """The element range of the global tensor this rank's DTensor shard holds."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = t.to_local().detach()
    shape = tuple(t.shape)
    local_shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    inner = math.prod(shape[1:]) if len(shape) > 1 else 1
    rows_only = all(o == 0 for o in offset[1:]) and tuple(local_shape[1:]) == shape[1:]
    if rows_only:
        start = (offset[0] if shape else 0) * inner
        if local.is_contiguous():
            return Want(name, start, local.view(-1))
        tmp = torch.empty(local.numel(), dtype=local.dtype)
        post.append(lambda: local.copy_(tmp.view(local.shape)))
        return Want(name, start, tmp)
    # A box that is not a run of whole rows (e.g. tensor-parallel Shard(1)): read the rows
    # it spans, then cut the box out. Costs those rows in staging memory.
    r0, r1 = offset[0], offset[0] + local_shape[0]
    tmp = torch.empty((r1 - r0) * inner, dtype=local.dtype)

    def cut():
        box = tmp.view((r1 - r0,) + shape[1:])
        for d in range(1, len(shape)):
            box = box.narrow(d, offset[d], local_shape[d])
        local.copy_(box)

    post.append(cut)
    return Want(name, r0 * inner, tmp)


def _owned(entries: Mapping, targets: Mapping) -> tuple:
    """(names this module owns, tied name -> the name it shares a tensor with)."""
    first_name: dict = {}
    for name, t in entries.items():
        first_name.setdefault(id(t), name)
        # Of names sharing one tensor, own the one the checkpoint stores (Hugging Face
        # saves one of a tied group, not always the module's first).
        if name in targets and targets[name].alias_of is None and first_name[id(t)] not in targets:
            first_name[id(t)] = name
    owned = [n for n, t in entries.items() if first_name[id(t)] == n]
    tied = {n: first_name[id(t)] for n, t in entries.items() if first_name[id(t)] != n}
    return owned, tied


def _check(module: torch.nn.Module, path, entries: Mapping, targets: Mapping, owned: list, strict: bool) -> None:
    wanted = {n for n, t in targets.items() if t.alias_of is None}
    missing = [n for n in owned if n not in targets]
    unexpected = [n for n in wanted if n not in entries]
    wrong = [f"{n}: checkpoint {tuple(targets[n].shape)} vs module {tuple(entries[n].shape)}"
             for n in owned if n in targets and tuple(targets[n].shape) != tuple(entries[n].shape)]
    problems = []
    if wrong:
        problems.append("wrong shape: " + cap_list(wrong, sep="; "))
    if strict and missing:
        problems.append("missing from the checkpoint: " + cap_list(missing))
    if strict and unexpected:
        problems.append("not in the module: " + cap_list(sorted(unexpected)))
    if problems:
        raise StateDictMismatchError(
            f"{type(module).__name__} does not match {path}: " + " | ".join(problems)
            + ". Nothing was loaded. Check the model config against the checkpoint"
            + (", or pass strict=False to load the matching tensors only." if not wrong else ".")
        )


def _materialize(module: torch.nn.Module, entries: Mapping, targets: Mapping, owned: list, tied: dict,
                 on: torch.device) -> dict:
    """Meta tensors the checkpoint holds, made real on ``on`` (ties kept); the fresh state dict.
    One the checkpoint does not hold (strict=False) stays on meta, so using it fails loudly,
    except under FSDP2, whose to_empty() materialises everything."""
    if any(is_dtensor(t) and t.device.type == "meta" for t in entries.values()):
        module.to_empty(device=on)
    fresh = module.state_dict(keep_vars=True)
    with torch.no_grad():
        for n in owned:
            t = fresh[n]
            if is_dtensor(t) or t.device.type != "meta" or n not in targets:
                continue
            new = torch.empty(t.shape, dtype=t.dtype, device=on)
            for alias in [n] + [a for a, src in tied.items() if src == n]:
                owner, leaf = owner_of(module, alias)
                if isinstance(t, torch.nn.Parameter):
                    owner._parameters[leaf] = torch.nn.Parameter(new, requires_grad=t.requires_grad)
                else:
                    owner._buffers[leaf] = new
        fresh = module.state_dict(keep_vars=True)
        # Re-tie: parameters built on meta and re-created above keep their sharing.
        for a, src in tied.items():
            owner, leaf = owner_of(module, a)
            if leaf in owner._parameters and isinstance(fresh[src], torch.nn.Parameter):
                owner._parameters[leaf] = fresh[src]
    return module.state_dict(keep_vars=True)


def module_wants(module: torch.nn.Module, path, entries: Mapping, strict: bool, materialize_on: torch.device,
                 post: List[Callable], unloaded: list) -> Callable:
    """(local) The engine's ``make_wants`` for :func:`load_into`: checks the module against
    the targets, materialises it, and returns its wants; copies to run after the load go to
    ``post``, names the checkpoint lacks to ``unloaded``."""

    def make_wants(targets, structure, layout):
        owned, tied = _owned(entries, targets)
        _check(module, path, entries, targets, owned, strict)
        unloaded.extend(n for n in owned if n not in targets)
        fresh = _materialize(module, entries, targets, owned, tied, materialize_on)
        wants = []
        for n in owned:
            if n not in targets:
                continue
            t = fresh[n]
            if is_dtensor(t):
                wants.append(dtensor_want(n, t, post))
                continue
            data = t.data if isinstance(t, torch.nn.Parameter) else t
            if data.is_contiguous():
                wants.append(Want(n, 0, data.view(-1)))
            else:
                tmp = torch.empty(data.numel(), dtype=data.dtype, device=data.device)
                post.append(lambda data=data, tmp=tmp: data.copy_(tmp.view(data.shape)))
                wants.append(Want(n, 0, tmp))
        return wants

    return make_wants
