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

:func:`rank_state` lays out one target rank's state from an :class:`OptimizerPlan`, each
value a :class:`~._writing.Record` of read items (:meth:`OptimizerPlan.sources` names what
they read); :func:`materialize` has the executor land them in tensors now (``install()``'s
Trainer.load_checkpoint), while the offline conversion has the same executor stream them
into its files. Both ways give the same bytes.

The rest of a checkpoint follows one rule too, shared by ``install()`` and the conversion:
:func:`rest_source` says which saved file a target file takes its ``cfg``, meters and
``extra_state`` from, and :func:`carry_extra_state` drops what of ``extra_state`` belongs to
the saved layout only (the per-model-parallel-rank RNG tracker states; the EMA copy, which is
laid out like the saved weights).
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
from ._layout import CheckpointLayout, StoredTensor, raw_keys
from ._plan import FlatGroup, FlatStructure, TargetTensor, plan_part
from ._reading import Extent, RangeReader, key_path, read_header, storage_byte_offset
from ._execute import ReadItem, Want, fill_all
from ._writing import Record, whole_record

__all__ = ["OptimizerPlan", "plan_optimizer", "state_of", "state_source", "flat_record", "rank_state",
           "materialize",
           "rest_source", "same_weights_layout", "carry_extra_state"]


@dataclass(frozen=True)
class OptimizerPlan:
    """How the source's optimizer state is rewritten: per target part, per state key laid
    out like the parameters (``exp_avg``...), the planned tensors by parameter name."""

    keys: tuple  # entry keys in the source's order
    aligned: frozenset  # keys whose values are laid out like the parameters
    scalars: Mapping  # non-tensor values, equal for every parameter (``step``)
    param_groups: tuple
    targets: tuple  # [part] -> {key: {name: TargetTensor}}; None for a part not planned
    dtypes: Mapping  # key -> dtype

    def sources(self, part: int) -> dict:
        """Target part ``part``'s planned values by source name (:func:`state_source`): what
        the read items of :func:`rank_state`'s records name."""
        return {state_source(k, n): t for k, planned in (self.targets[part] or {}).items() for n, t in planned.items()}


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


class _Agreement:
    """Every parameter's entry has the same keys, the same ones laid out like the
    parameters, and the same scalars (``step``); the first entry sets them."""

    def __init__(self):
        self.keys = self.aligned = self.scalars = None
        self.dtypes: dict = {}

    def check(self, entry: Mapping, a: frozenset, s: Mapping) -> Optional[str]:
        if self.keys is None:
            self.keys, self.aligned, self.scalars = tuple(entry), a, s
        if tuple(entry) != self.keys or a != self.aligned:
            return "optimizer state entries hold different keys"
        for k, v in s.items():
            if not torch.is_tensor(v) and v != self.scalars[k]:
                return f"optimizer state '{k}' differs between parameters ({v!r} vs {self.scalars[k]!r})"
        return None


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
    agreed = _Agreement()
    shadows = []
    for part in layout.parts:
        shadow = _flat_shadows if part.flat_params else _unflat_shadows
        tensors, why = shadow(layout, part, states[part.index], agreed)
        if why:
            return None, why
        shadows.append(tensors)
    if not agreed.aligned:
        return None, "the optimizer state holds nothing laid out like the parameters"
    return (shadows, agreed.keys, agreed.aligned, agreed.scalars, tuple(copy.deepcopy(list(groups))),
            agreed.dtypes), None


def _flat_shadows(layout: CheckpointLayout, part, states: Sequence[Mapping], agreed: _Agreement) -> tuple:
    """({key: {name: StoredTensor}}, None) of one part's flat shards, or (None, why not)."""
    files = layout.files[part.index]
    fps = part.flat_params
    chunks = [{} for _ in fps]  # per flat parameter, per key: its runs over the shards
    for d, f in enumerate(files):
        state = states[d]["state"]
        if sorted(state, key=str) != sorted(range(len(fps)), key=str):
            return None, (f"{os.path.basename(f.path)}: optimizer state for {len(state)} parameters "
                          f"but the file holds {len(fps)} flat parameters")
        for i, fp in enumerate(fps):
            entry = state[i]
            a, s = _classify(entry, lambda v: v.dim() == 1 and v.numel() > 1) if isinstance(
                entry, Mapping) else (None, None)
            if a is None:
                return None, f"{os.path.basename(f.path)}: optimizer state {i} holds tensors of unexpected shapes"
            why = agreed.check(entry, a, s)
            if why:
                return None, why
            for k in agreed.aligned:
                v = entry[k]
                off = storage_byte_offset(v) if f.format == "zip" and v.is_contiguous() else None
                if off is None:
                    return None, f"{os.path.basename(f.path)}: its optimizer state cannot be range-read (legacy format or strided)"
                chunks[i].setdefault(k, []).append((f.path, key_path("last_optimizer_state", "state", str(i), str(k)),
                                                    v.numel(), off, v.dtype))
                agreed.dtypes[k] = v.dtype
    tensors: dict = {}
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
    return tensors, None


def _unflat_shadows(layout: CheckpointLayout, part, states: Sequence[Mapping], agreed: _Agreement) -> tuple:
    """({key: {name: StoredTensor}}, None) of one part's unflattened file, or (None, why not)."""
    f = layout.files[part.index][0]
    state = states[0]["state"]
    buffers = set(layout.parts[0].buffer_names)
    names = [n for n in part.tensors if n not in buffers]
    tied = {dst for _, dst in part.shared}
    if layout.model_args().get("share_decoder_input_output_embed"):
        tied |= {n for n in names if n.endswith("output_projection.weight")}

    def shaped_like(n: str) -> Callable[[Any], bool]:
        return lambda v: tuple(v.shape) == tuple(part.tensors[n].shape)

    # model.parameters() order: the stored order less buffers, perhaps less tied aliases.
    order = None
    for candidate in (names, [n for n in names if n not in tied]):
        if len(candidate) != len(state) or sorted(state, key=str) != sorted(range(len(state)), key=str):
            continue
        if all(_classify(state[i], shaped_like(n))[0] for i, n in enumerate(candidate)):
            order = candidate
            break
    if order is None:
        return None, (f"{os.path.basename(f.path)}: optimizer state for {len(state)} parameters does not "
                      f"line up with the {len(names)} parameters the file holds")
    tensors: dict = {}
    for i, n in enumerate(order):
        entry = state[i]
        why = agreed.check(entry, *_classify(entry, shaped_like(n)))
        if why:
            return None, why
        for k in agreed.aligned:
            v = entry[k]
            off = storage_byte_offset(v) if f.format == "zip" else None
            if off is None or not v.is_contiguous():
                return None, f"{os.path.basename(f.path)}: its optimizer state cannot be range-read"
            tensors.setdefault(k, {})[n] = StoredTensor(
                n, part.index, v.dtype, tuple(v.shape),
                (Extent(f.path, key_path("last_optimizer_state", "state", str(i), str(k)), 0, v.numel(), off),))
            agreed.dtypes[k] = v.dtype
    return tensors, None


def plan_optimizer(layout: CheckpointLayout, model_parallel: int, qkv: str, params_per_part: Sequence[Sequence[str]],
                   weights: Sequence[Mapping[str, TargetTensor]], *, parts: Optional[Sequence[int]] = None) -> tuple:
    """(any rank, local) (:class:`OptimizerPlan`, None), or (None, why it cannot be carried).

    ``params_per_part[m]`` lists the parameters of target part ``m`` in the order the
    target optimizer indexes them; ``weights[m]`` their planned weights (shapes must agree).
    ``parts``: plan only these target parts (one rank needs its own); default all. Both
    sequences (or mappings) need entries for the parts planned only.
    """
    found, reason = _optimizer_shadows(layout)
    if found is None:
        return None, reason
    shadows, keys, aligned, scalars, groups, dtypes = found
    wanted = range(model_parallel) if parts is None else sorted(set(parts))
    per_part: list = [None] * model_parallel
    for m in wanted:
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
        per_part[m] = by_key
    return OptimizerPlan(keys, aligned, scalars, groups, tuple(per_part), dtypes), None


# --------------------------------------------------------------------------- one rank's state


def state_source(key: Any, name: str) -> str:
    """The source name (in :meth:`OptimizerPlan.sources`) of parameter ``name``'s ``key``
    value (``exp_avg``...)."""
    return f"last_optimizer_state/{key}/{name}"


def flat_record(g: FlatGroup, shard: int, shards: int, dtype: torch.dtype,
                source: Callable[[str], str] = str) -> tuple:
    """(record, local size) of rank ``shard``'s flat shard of ``g`` for ``shards`` ranks: its
    members' element ranges (read items of the sources ``source(member)``), then fairscale's
    zero padding."""
    members, size = g.shard_pieces(shard, shards)
    items = tuple(ReadItem(source(n), start, stop) for n, start, stop, _ in members)
    filled = sum(i.numel for i in items)
    return Record(items, dtype, max(0, size - filled)), size


def rank_state(plan: OptimizerPlan, part: int, skeleton: Mapping, *, make: Callable[[Record, tuple], Any],
               structure: Optional[FlatStructure] = None, shard: int = 0, shards: int = 1,
               params: Optional[Sequence[str]] = None) -> dict:
    """(local) Target part ``part``'s ``last_optimizer_state`` for one rank.

    With ``structure`` (FSDP flat parameters) there is one entry per flat parameter, this
    rank's shard ``shard`` of ``shards`` as fairscale cuts it (zero padding at the tail);
    without, one entry per parameter of ``params``, in that order. Each value laid out like
    the parameters is ``make(record, shape)``, the :class:`~._writing.Record` of its elements
    (read items of ``plan.sources(part)``); ``step`` and the like are copied
    (a 0-d tensor from ``skeleton``, the source file's optimizer state), ``param_groups``
    re-indexed, other top-level keys of ``skeleton`` (loss scale) copied.
    """
    planned = plan.targets[part]
    if planned is None:
        raise ValueError(f"the optimizer plan does not cover target part {part}")
    src = skeleton.get("state") if isinstance(skeleton.get("state"), Mapping) else {}
    first = src.get(0, src.get("0", {})) if src else {}
    state: dict = {}

    def entry(value_of: Callable[[str], Any]) -> dict:
        e = {}
        for k in plan.keys:
            if k in plan.aligned:
                e[k] = value_of(k)
            elif torch.is_tensor(plan.scalars.get(k)):
                v = first.get(k) if isinstance(first, Mapping) else None
                e[k] = v.clone() if torch.is_tensor(v) else copy.deepcopy(v)
            else:
                e[k] = copy.deepcopy(plan.scalars[k])
        return e

    if structure is not None:
        for i, g in enumerate(structure.groups):
            def flat_value(k: str, g: FlatGroup = g) -> Any:
                rec, size = flat_record(g, shard, shards, plan.dtypes[k], lambda n: state_source(k, n))
                return make(rec, (size,))
            state[i] = entry(flat_value)
    else:
        if params is None:
            raise ValueError("rank_state: an unflattened target needs params (the optimizer's parameter order)")
        for i, n in enumerate(params):
            def value(k: str, n: str = n) -> Any:
                return make(whole_record(state_source(k, n), planned[k][n]), tuple(planned[k][n].shape))
            state[i] = entry(value)
    groups = copy.deepcopy(list(plan.param_groups))
    groups[0]["params"] = list(range(len(state)))
    out = {}
    for k, v in skeleton.items():
        if k == "state":
            out[k] = state
        elif k == "param_groups":
            out[k] = groups
        else:
            out[k] = copy.deepcopy(v)
    return out


def materialize(plan: OptimizerPlan, part: int, skeleton: Mapping, *, structure: Optional[FlatStructure] = None,
                shard: int = 0, shards: int = 1, params: Optional[Sequence[str]] = None,
                chunk_bytes: int = 64 << 20, trust_pickle: bool = False) -> dict:
    """(local) :func:`rank_state` with every value read now: each value's record lands in
    a tensor through the executor (``_execute.fill_all``: only the byte ranges this rank's
    values cover). Owns its memory (``skeleton`` may be mapped)."""
    sources = plan.sources(part)
    wants: list = []

    def make(rec: Record, shape: tuple) -> torch.Tensor:
        out = torch.empty(shape, dtype=rec.dtype)
        flat, pos = out.view(-1), 0
        for item in rec.items:
            wants.append(Want(item.name, item.start, flat[pos: pos + item.numel]))
            pos += item.numel
        flat[pos:].zero_()  # fairscale's padding
        return out

    state = rank_state(plan, part, skeleton, make=make, structure=structure, shard=shard, shards=shards,
                       params=params)
    with RangeReader(chunk_bytes=chunk_bytes, trust_pickle=trust_pickle) as reader:
        fill_all(sources, wants, reader, None)
    return state



# --------------------------------------------------------------------------- the rest of a checkpoint

# Megatron's CUDA RNG tracker: one state per model-parallel rank.
MODEL_PARALLEL_EXTRAS = ("rng_tracker_states",)
# metaseq's EMA copy of the model (store_ema) and its fp32 master copy: laid out like the
# file's own ``model`` (flat local shards under use_sharded_state, else the part's weights).
WEIGHTS_EXTRAS = ("ema", "ema_fp32_params")


def rest_source(layout: CheckpointLayout, part: int, parts: int, shard: int, shards: int) -> str:
    """(local) The saved file whose ``cfg``, meters and ``extra_state`` go with target part
    ``part`` of ``parts``, shard ``shard`` of ``shards``: the same grid position when the
    saved layout has the same model-parallel size (and shard count), else part 0 (shard 0)."""
    m = part if layout.model_parallel_size == parts else 0
    d = shard if layout.shards_per_part == shards else 0
    return layout.files[m][d].path


def _structure_key(s: FlatStructure) -> list:
    return [(g.fsdp_path, g.flat_name, tuple(g.names), tuple(tuple(int(x) for x in sh) for sh in g.shapes))
            for g in s.groups]


def same_weights_layout(layout: CheckpointLayout, *, parts: int, shards: int, flat: bool,
                        structure: Optional[FlatStructure] = None) -> bool:
    """(local) Whether a target of ``parts`` x ``shards`` (``flat``: fairscale flat shards
    with FSDP wrapping ``structure``, default the saved one) holds, file for file, the
    weights laid out as saved: then what is laid out like the saved weights (the optimizer
    state, the EMA copy) can be taken as it is."""
    from ._planner import own_shard_fits  # the same test the engine's own-shard strategy makes

    if layout.flat != flat:
        return False
    if not own_shard_fits(layout, parts, shards if flat else layout.shards_per_part, flat)[0]:
        return False
    if not flat or structure is None:
        return True
    try:
        saved = FlatStructure.from_metadata(read_header(layout.files[0][0].path)[layout.metadata_key])
    except Exception:  # noqa: BLE001  (fairseq's fsdp_metadata, anything unexpected: not the same)
        return False
    return _structure_key(saved) == _structure_key(structure)


def carry_extra_state(extra: Any, *, same_parts: bool, same_weights: bool) -> tuple:
    """(``extra_state`` for a target file, notes): what of the saved file's ``extra_state``
    belongs to the saved layout only is left out. ``same_parts``: the model-parallel size
    is unchanged; ``same_weights``: the target's weights are laid out as saved
    (:func:`same_weights_layout`). The input is never modified."""
    if not isinstance(extra, Mapping):
        return extra, ()
    drop, notes = [], []
    keys = raw_keys(extra)  # a DictConfig's `in` resolves the value it finds
    if not same_parts:
        found = [k for k in MODEL_PARALLEL_EXTRAS if k in keys]
        if found:
            drop += found
            notes.append(f"extra_state[{found[0]!r}] dropped: one RNG state per model-parallel rank, and the "
                         "model-parallel size changes (metaseq seeds the tracker afresh)")
    if not same_weights:
        found = [k for k in WEIGHTS_EXTRAS if k in keys]
        if found:
            drop += found
            notes.append(f"extra_state {', '.join(found)} dropped: the EMA copy is laid out like the saved weights "
                         "(metaseq re-initialises EMA from the loaded weights, with a warning)")
    if not drop:
        return extra, ()
    out = copy.copy(extra)  # keeps the mapping's type (OrderedDict)
    for k in drop:
        del out[k]
    return out, tuple(notes)
