"""The optimizer state, laid out like the parameters, so it is resharded exactly like them.

A torch optimizer state dict indexes its per-parameter state by position (``state[i]``,
``param_groups[0]["params"]``). For metaseq checkpoints position ``i`` is:

* FSDP flat shards (``use_sharded_state``): the i-th flat parameter in ``shard_metadata``
  order, each value (Adam's ``exp_avg``, ``exp_avg_sq``) a 1-D tensor shaped like that
  rank's flat shard, padding included;
* unflattened files: the i-th parameter in ``model.parameters()`` order, which is the
  stored order less buffers and tied aliases (checked against every value's shape).

Each such value becomes a "shadow" :class:`~._layout.StoredTensor` per parameter name whose
extents point at the optimizer tensor's bytes, so the planner (:func:`~._plan.plan_part`,
Megatron's splits included) and the readers treat it exactly like a weight. Values that are
not laid out like the parameters (``step``) must agree for every parameter and are copied.

The concatenation of one flat parameter's state over its shards is read as "real elements
first, padding at the tail", which also holds for what metaseq's ``reshard_fsdp`` writes (it
keeps the padding inside the state: 4674 elements per shard for 9346 real ones).
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from ._errors import OneloadError
from ._layout import CheckpointLayout, StoredTensor
from ._plan import TargetTensor, plan_part
from ._reading import Extent, key_path, read_header, storage_byte_offset

__all__ = ["OptimizerPlan", "plan_optimizer", "state_of"]


@dataclass(frozen=True)
class OptimizerPlan:
    """How the source's optimizer state is rewritten: per target part, per state key laid
    out like the parameters (``exp_avg``...), the planned tensors by parameter name."""

    keys: tuple  # entry keys in the source's order
    aligned: frozenset  # keys whose values are laid out like the parameters
    scalars: Mapping  # non-tensor values, equal for every parameter (``step``)
    param_groups: tuple
    targets: tuple  # [part] -> {key: {name: TargetTensor}}
    dtypes: Mapping  # key -> dtype


def state_of(header: Any) -> Optional[Mapping]:
    """A checkpoint object's ``last_optimizer_state``, or None."""
    los = header.get("last_optimizer_state") if isinstance(header, Mapping) else None
    return los if isinstance(los, Mapping) else None


def _classify(entry: Mapping, aligned_fn: Callable[[Any], bool]) -> tuple:
    """(keys laid out like the parameter, {other key: value}), or (None, None) for a tensor
    that is neither."""
    aligned, scalars = [], {}
    for k, v in entry.items():
        if torch.is_tensor(v) and aligned_fn(v):
            aligned.append(k)
        elif torch.is_tensor(v):
            if v.numel() > 1:
                return None, None
            scalars[k] = v  # a 0-d tensor (torch's Adam step): the value comes from the file
        else:
            scalars[k] = v
    return frozenset(aligned), scalars


def _optimizer_shadows(layout: CheckpointLayout) -> tuple:
    """(per part {key: {name: StoredTensor}}, keys, aligned, scalars, param_groups, dtypes) or
    (None, reason): the optimizer state viewed as tensors shaped like the parameters."""
    heads = [[read_header(f.path) for f in row] for row in layout.files]
    states = [[state_of(h) for h in row] for row in heads]
    if all(s is None for row in states for s in row):
        return None, "absent"
    for row, files in zip(states, layout.files):
        for s, f in zip(row, files):
            if s is None or not isinstance(s.get("state"), Mapping) or not isinstance(s.get("param_groups"), (list, tuple)):
                return None, (f"{os.path.basename(f.path)}: last_optimizer_state is missing or not a torch "
                              "optimizer state dict (state, param_groups)")
    groups = states[0][0]["param_groups"]
    if len(groups) != 1:
        return None, f"the optimizer has {len(groups)} parameter groups; only a single group can be re-indexed"
    keys, aligned, scalars, dtypes = None, None, None, {}
    shadows = []
    buffers_all = set(layout.parts[0].buffer_names)
    for part in layout.parts:
        files = layout.files[part.index]
        tensors: dict = {}
        if part.flat_params:
            fps = part.flat_params
            chunks = [{} for _ in fps]
            for d, f in enumerate(files):
                state = states[part.index][d]["state"]
                if sorted(state, key=str) != sorted(range(len(fps)), key=str):
                    return None, (f"{os.path.basename(f.path)}: optimizer state for {len(state)} parameters "
                                  f"but the file holds {len(fps)} flat parameters")
                for i, fp in enumerate(fps):
                    entry = state[i]
                    a, s = _classify(entry, lambda v: v.dim() == 1 and v.numel() > 1) if isinstance(
                        entry, Mapping) else (None, None)
                    if a is None:
                        return None, f"{os.path.basename(f.path)}: optimizer state {i} holds tensors of unexpected shapes"
                    if keys is None:
                        keys, aligned, scalars = tuple(entry), a, s
                    if tuple(entry) != keys or a != aligned:
                        return None, "optimizer state entries hold different keys"
                    for k, v in s.items():
                        if not torch.is_tensor(v) and v != scalars[k]:
                            return None, f"optimizer state '{k}' differs between parameters ({v!r} vs {scalars[k]!r})"
                    for k in aligned:
                        v = entry[k]
                        off = storage_byte_offset(v) if f.format == "zip" and v.is_contiguous() else None
                        if off is None:
                            return None, f"{os.path.basename(f.path)}: its optimizer state cannot be range-read (legacy format or strided)"
                        chunks[i].setdefault(k, []).append((f.path, key_path("last_optimizer_state", "state", str(i), str(k)),
                                                            v.numel(), off, v.dtype))
                        dtypes[k] = v.dtype
            for fp, per_key in zip(fps, chunks):
                for k, runs in per_key.items():
                    if sum(r[2] for r in runs) < fp.total_numel:
                        return None, (f"{fp.key}: optimizer '{k}' holds {sum(r[2] for r in runs)} elements for "
                                      f"{fp.total_numel} parameter elements")
                    pos = 0
                    for name, shape, numel in zip(fp.names, fp.shapes, fp.numels):
                        extents, c0 = [], 0
                        for path, kp, n, off, dt in runs:
                            a0, b0 = max(pos, c0), min(pos + numel, c0 + n)
                            if a0 < b0:
                                item = torch.empty((), dtype=dt).element_size()
                                extents.append(Extent(path, kp, a0 - c0, b0 - a0, off + (a0 - c0) * item))
                            c0 += n
                        tensors.setdefault(k, {})[name] = StoredTensor(name, part.index, runs[0][4], tuple(shape),
                                                                       tuple(extents))
                        pos += numel
        else:
            f = files[0]
            state = states[part.index][0]["state"]
            names = [n for n in part.tensors if n not in buffers_all]
            tied = {dst for _, dst in part.shared}
            if layout.model_args().get("share_decoder_input_output_embed"):
                tied |= {n for n in names if n.endswith("output_projection.weight")}
            order = None
            for candidate in (names, [n for n in names if n not in tied]):
                if len(candidate) != len(state) or sorted(state, key=str) != sorted(range(len(state)), key=str):
                    continue
                ok = True
                for i, n in enumerate(candidate):
                    entry = state[i]
                    a, _ = _classify(entry, lambda v, n=n: tuple(v.shape) == tuple(part.tensors[n].shape))
                    if not a:
                        ok = False
                        break
                if ok:
                    order = candidate
                    break
            if order is None:
                return None, (f"{os.path.basename(f.path)}: optimizer state for {len(state)} parameters does not "
                              f"line up with the {len(names)} parameters the file holds")
            for i, n in enumerate(order):
                entry = state[i]
                a, s = _classify(entry, lambda v, n=n: tuple(v.shape) == tuple(part.tensors[n].shape))
                if keys is None:
                    keys, aligned, scalars = tuple(entry), a, s
                if tuple(entry) != keys or a != aligned:
                    return None, "optimizer state entries hold different keys"
                for k, v in s.items():
                    if not torch.is_tensor(v) and v != scalars[k]:
                        return None, f"optimizer state '{k}' differs between parameters ({v!r} vs {scalars[k]!r})"
                for k in aligned:
                    v = entry[k]
                    off = storage_byte_offset(v) if f.format == "zip" else None
                    if off is None or not v.is_contiguous():
                        return None, f"{os.path.basename(f.path)}: its optimizer state cannot be range-read"
                    tensors.setdefault(k, {})[n] = StoredTensor(
                        n, part.index, v.dtype, tuple(v.shape),
                        (Extent(f.path, key_path("last_optimizer_state", "state", str(i), str(k)), 0, v.numel(), off),))
                    dtypes[k] = v.dtype
        shadows.append(tensors)
    if not aligned:
        return None, "the optimizer state holds nothing laid out like the parameters"
    return (shadows, keys, aligned, scalars, tuple(copy.deepcopy(list(groups))), dtypes), None


def plan_optimizer(layout: CheckpointLayout, model_parallel: int, qkv: str, params_per_part: Sequence[Sequence[str]],
                   weights: Sequence[Mapping[str, TargetTensor]]) -> tuple:
    """(any rank, local) (:class:`OptimizerPlan`, None), or (None, why it cannot be carried).

    ``params_per_part[m]`` lists the parameters of target part ``m`` in the order the
    target optimizer indexes them; ``weights[m]`` their planned weights (shapes must agree).
    """
    found, reason = _optimizer_shadows(layout)
    if found is None:
        return None, reason
    shadows, keys, aligned, scalars, groups, dtypes = found
    per_part = []
    for m in range(model_parallel):
        by_key = {}
        for k in aligned:
            shadow = dataclasses.replace(layout, parts=tuple(
                dataclasses.replace(p, tensors=OrderedDict(shadows[p.index][k])) for p in layout.parts))
            try:
                planned = plan_part(shadow, model_parallel, m, qkv=qkv, tied=False)
            except OneloadError as e:
                return None, f"its '{k}' cannot be split like the weights ({e})"
            for n in params_per_part[m]:
                if n not in planned:
                    return None, f"no optimizer '{k}' for parameter {n}"
                if tuple(planned[n].shape) != tuple(weights[m][n].shape):
                    return None, f"optimizer '{k}' of {n} has shape {planned[n].shape}, the weight {weights[m][n].shape}"
            by_key[k] = planned
        per_part.append(by_key)
    return OptimizerPlan(keys, aligned, scalars, groups, tuple(per_part), dtypes), None
