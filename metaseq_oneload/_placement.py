"""Where a tensor sits in the unsplit model: the model-parallel rules.

Every saved tensor and every target tensor is *placed* in one canonical coordinate
system, the unsplit (model-parallel size 1) model with metaseq's names: a fused
``qkv_proj`` holds rows k, v, q of all heads. A placement says which rows (or columns) of
the canonical tensor a stored or wanted tensor covers, so any saved model-parallel size maps
onto any target size by intersecting ranges (Megatron's rules):

=====================================  ==================  =================================
tensor                                 split               note
=====================================  ==================  =================================
``self_attn.qkv_proj`` weight, bias    dim 0, per part     rows k_m, v_m, q_m of part m's heads
``self_attn.{k,v,q}_proj`` (split)     dim 0               fused into ``qkv_proj`` on load
``fc1`` weight, bias                   dim 0               column parallel
``embed_tokens``, ``output_projection``  dim 0             vocab parallel
``self_attn.out_proj.weight``, ``fc2.weight``  dim 1       row parallel
layer norms, positions, row biases     replicated
=====================================  ==================  =================================

The layout (its parameter count) and the planner (:mod:`._plan`) both read these rules; they
take the stored tensors, never a file, and import neither (the layout imports this module).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from ._errors import CheckpointLayoutError

__all__ = ["QKV_FUSED", "Placement", "split_qkv_name", "split_length", "place", "canonical_table",
           "canonical_numels"]

QKV_FUSED = (".self_attn.qkv_proj.weight", ".self_attn.qkv_proj.bias")
_QKV_SPLIT = {"k_proj": 0, "v_proj": 1, "q_proj": 2}
_COLUMN = (".fc1.weight", ".fc1.bias", "embed_tokens.weight", "output_projection.weight")
_ROW = (".self_attn.out_proj.weight", ".fc2.weight")
_REPLICATED_HINTS = ("layer_norm.", "layernorm", "embed_positions.", ".out_proj.bias", ".fc2.bias",
                     ".version", "_float_tensor", "alibi", "embed_scale")


@dataclass(frozen=True)
class Placement:
    """Where a tensor sits in the canonical (unsplit) tensor ``canonical``.

    ``segments`` are ``(local_start, global_start, length)`` along ``dim``; ``dim`` None
    means the tensor is the whole canonical tensor (replicated or not model parallel).
    """

    canonical: str
    dim: Optional[int]
    segments: tuple
    global_shape: tuple


def split_qkv_name(name: str) -> Optional[tuple]:
    parts = name.rsplit(".", 2)
    if len(parts) == 3 and parts[1] in _QKV_SPLIT and parts[0].endswith("self_attn"):
        return parts[0] + ".qkv_proj." + parts[2], _QKV_SPLIT[parts[1]]
    return None


def _rule_of(name: str, rules: Optional[Mapping[str, str]], fuse_split_qkv: bool) -> Optional[str]:
    rule = None
    for suffix, r in (rules or {}).items():
        if name.endswith(suffix):
            rule = r
    if rule is None:
        if name.endswith(QKV_FUSED):
            rule = "qkv"
        elif fuse_split_qkv and split_qkv_name(name):
            rule = "qkv_split"
        elif name.endswith(_COLUMN):
            rule = "column"
        elif name.endswith(_ROW):
            rule = "row"
        elif any(h in name for h in _REPLICATED_HINTS):
            rule = "replicated"
    return rule


def split_length(name: str, shape: Sequence[int], rules: Optional[Mapping[str, str]] = None,
                 fuse_split_qkv: bool = True) -> Optional[int]:
    """How much of its split dimension one part's tensor holds (rows per projection for a
    fused qkv), or None when it is not split."""
    rule = _rule_of(name, rules, fuse_split_qkv)
    if rule == "qkv":
        return int(shape[0]) // 3
    if rule in ("qkv_split", "column"):
        return int(shape[0])
    if rule == "row" and len(shape) == 2:
        return int(shape[1])
    return None


def place(name: str, shape: Sequence[int], part: int, nparts: int,
          rules: Optional[Mapping[str, str]] = None, fuse_split_qkv: bool = True,
          lengths: Optional[Sequence[int]] = None) -> Optional[Placement]:
    """The placement of part ``part`` of ``nparts`` of tensor ``name``, or None for a
    tensor without a known model-parallel rule (it can only be loaded at the same size).

    ``fuse_split_qkv=False`` leaves split ``k_proj``/``v_proj``/``q_proj`` as they are:
    their rows need not match (grouped-query attention), which fusing assumes.
    ``lengths``: every part's :func:`split_length`, where the parts are not all alike
    (``torch.chunk`` of a size the part count does not divide, as metaseq's
    ``reshard_mp.py`` writes it); by default every part holds as much as this one."""
    shape = tuple(int(s) for s in shape)
    own = split_length(name, shape, rules, fuse_split_qkv)
    if lengths is not None and own is not None and list(lengths) != [own] * nparts:
        if lengths[part] != own:
            raise CheckpointLayoutError(f"{name}: part {part} holds {own} along its split dimension, not {lengths[part]}.")
        start, total = sum(lengths[:part]), sum(lengths)
    else:
        start, total = (None, None)
    rule = _rule_of(name, rules, fuse_split_qkv)
    if rule is None:
        if nparts == 1:
            return Placement(name, None, (), shape)
        return None
    if rule == "replicated":
        return Placement(name, None, (), shape)
    if rule == "qkv":
        n = shape[0]
        if n % 3:
            raise CheckpointLayoutError(f"{name}: fused qkv_proj has {n} rows, not a multiple of 3 (k, v, q).")
        per = n // 3
        e, at = (per * nparts, part * per) if total is None else (total, start)
        segs = tuple((j * per, j * e + at, per) for j in range(3))
        return Placement(name, 0, segs, (3 * e,) + shape[1:])
    if rule == "qkv_split":
        canonical, j = split_qkv_name(name)
        n = shape[0]
        e, at = (n * nparts, part * n) if total is None else (total, start)
        return Placement(canonical, 0, ((0, j * e + at, n),), (3 * e,) + shape[1:])
    if rule == "column":
        n = shape[0]
        e, at = (n * nparts, part * n) if total is None else (total, start)
        return Placement(name, 0, ((0, at, n),), (e,) + shape[1:])
    if rule == "row":
        if len(shape) != 2:
            raise CheckpointLayoutError(f"{name}: a row-parallel rule needs a 2-D weight, found shape {shape}.")
        m = shape[1]
        e, at = (m * nparts, part * m) if total is None else (total, start)
        return Placement(name, 1, ((0, at, m),), (shape[0], e))
    raise ValueError(f"unknown model-parallel rule {rule!r} for {name} (use qkv, column, row or replicated)")


def canonical_table(parts: Sequence, rules: Optional[Mapping[str, str]], fuse_split_qkv: bool) -> tuple:
    """(local) The stored model parts (a layout's :class:`~._layout.ModelPart` s, one per
    model-parallel part) placed: canonical name -> {"shape": global shape, "sources":
    [(stored tensor, placement)], "names": stored names}, and the stored names without a rule
    -> their tensors, one per part."""
    table: dict = {}
    unknown: dict = {}
    m = len(parts)
    lengths: dict = {}
    if m > 1:
        for part in parts:
            for t in part.tensors.values():
                lengths.setdefault(t.name, []).append(split_length(t.name, t.shape, rules, fuse_split_qkv))
    for part in parts:
        for t in part.tensors.values():
            ls = lengths.get(t.name)
            p = place(t.name, t.shape, part.index, m, rules, fuse_split_qkv,
                      lengths=ls if ls and len(ls) == m and None not in ls else None)
            if p is None:
                unknown.setdefault(t.name, []).append(t)
                continue
            entry = table.setdefault(p.canonical, {"shape": p.global_shape, "sources": [], "names": []})
            if entry["shape"] != p.global_shape:
                raise CheckpointLayoutError(
                    f"{t.name}: part {part.index} implies global shape {p.global_shape} but other parts "
                    f"imply {entry['shape']}: the model parts disagree."
                )
            entry["sources"].append((t, p))  # replicated: every part's copy, to read the nearest
            if t.name not in entry["names"]:
                entry["names"].append(t.name)
    return table, unknown


def canonical_numels(parts: Sequence, *, tied_embeddings: bool) -> int:
    """(local) Parameter elements of the full model the stored ``parts`` make up (see
    :attr:`~._layout.CheckpointLayout.num_params`); ``tied_embeddings``: the output
    projection is the input embedding (``share_decoder_input_output_embed``)."""
    table, unknown = canonical_table(parts, None, fuse_split_qkv=len(parts) > 1)
    buffers = set(parts[0].buffer_names)
    aliases = {dst for p in parts for _, dst in p.shared}
    if tied_embeddings:
        aliases |= {n for n in table if n.endswith("output_projection.weight")}
    total = 0
    for name, entry in table.items():
        if any(n in buffers or n in aliases or n.endswith((".version", "._float_tensor")) for n in entry["names"]):
            continue
        total += math.prod(entry["shape"])
    for name, ts in unknown.items():
        if name not in buffers:
            total += sum(t.numel for t in ts)
    return total
