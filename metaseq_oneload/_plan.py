"""What to read: saved pieces -> target pieces.

Every saved and every target tensor is placed in the unsplit model's coordinates by the
model-parallel rules of :mod:`._placement`. A target tensor becomes a list of copies
(:class:`FlatCopy` for contiguous element runs, :class:`BlockCopy` for a column block of a
row-parallel weight). Intersecting those with the element range a rank needs (its FSDP flat
shard, its DTensor rows, or everything) gives exactly the bytes it reads, from whichever
files hold them. How the target groups its tensors into FSDP flat parameters is decided in
one place, :func:`flat_structure`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import torch

from ._errors import CheckpointLayoutError, StateDictMismatchError
from ._layout import CheckpointLayout, StoredTensor
from ._placement import QKV_FUSED, Placement, canonical_table, place, split_qkv_name

__all__ = [
    "FlatCopy",
    "BlockCopy",
    "TargetTensor",
    "FlatGroup",
    "FlatStructure",
    "flat_structure",
    "metaseq_wrapping",
    "plan_part",
    "flat_shard_range",
    "qkv_naming",
]


def _target_placement(canonical: str, global_shape: tuple, part: int, nparts: int, name: str,
                      rules: Optional[Mapping[str, str]] = None) -> Placement:
    """The placement of target part ``part`` of ``nparts`` of a canonical tensor."""
    split = split_qkv_name(name)
    if split is not None and canonical != name:  # a projection cut out of a fused qkv_proj
        e = global_shape[0] // 3
        if e % nparts:
            raise CheckpointLayoutError(
                f"{name}: {e} rows per projection do not split over {nparts} model-parallel parts."
            )
        n = e // nparts
        return Placement(canonical, 0, ((0, split[1] * e + part * n, n),), global_shape)
    probe = place(name, _local_shape_guess(name, global_shape, nparts, rules), part, nparts, rules,
                  fuse_split_qkv=False)
    if probe is None:
        # A one-part checkpoint lists every tensor as placed (nothing to merge), so the
        # unknown-rule check of the caller cannot see this one: it shows when splitting.
        raise CheckpointLayoutError(
            f"{name}: no model-parallel split rule is known for this tensor {list(global_shape)}, so it cannot "
            f"be split over {nparts} model-parallel parts. Keep the saved model-parallel size, or (Python API, "
            "loads) pass rules={'<name suffix>': 'column'|'row'|'replicated'|'qkv'} for it."
        )
    if probe.global_shape != tuple(global_shape):
        raise CheckpointLayoutError(
            f"{name}: global shape {tuple(global_shape)} does not split over {nparts} model-parallel "
            f"parts (dim {probe.dim}). Choose a model-parallel size that divides it."
        )
    return probe


def _local_shape_guess(name: str, global_shape: tuple, nparts: int, rules: Optional[Mapping[str, str]]) -> tuple:
    p = place(name, global_shape, 0, 1, rules, fuse_split_qkv=False)
    if p is None or p.dim is None:
        return tuple(global_shape)
    shape = list(global_shape)
    shape[p.dim] = global_shape[p.dim] // nparts if global_shape[p.dim] % nparts == 0 else -1
    if shape[p.dim] < 0:
        raise CheckpointLayoutError(
            f"{name}: dim {p.dim} of size {global_shape[p.dim]} does not split over {nparts} "
            "model-parallel parts. Choose a model-parallel size that divides it."
        )
    return tuple(shape)


@dataclass(frozen=True)
class FlatCopy:
    """Elements ``src_start..+length`` of ``src`` (flattened) go to ``dst_start..``."""

    src: StoredTensor
    src_start: int
    dst_start: int
    length: int


@dataclass(frozen=True)
class BlockCopy:
    """Columns ``src_col0..+ncols`` of every row of 2-D ``src`` go to columns
    ``dst_col0..`` of the target (row-parallel weights when the model-parallel size changes)."""

    src: StoredTensor
    rows: int
    src_cols: int
    src_col0: int
    dst_cols: int
    dst_col0: int
    ncols: int


@dataclass(frozen=True)
class TargetTensor:
    """One tensor a rank wants, and where its elements come from."""

    name: str
    shape: tuple
    dtype: torch.dtype
    copies: tuple
    alias_of: Optional[str] = None  # a tied name that shares ``alias_of``'s tensor

    @property
    def numel(self) -> int:
        return math.prod(self.shape) if self.shape else 1

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()

    def sources(self) -> tuple:
        """The stored tensors this target reads from."""
        return tuple({id(c.src): c.src for c in self.copies}.values())


def _copies(target: Placement, local_shape: tuple, sources: Sequence, prefer_part: int = 0) -> tuple:
    """Intersect a target placement with the placements of the stored tensors. A replicated
    tensor is read from part ``prefer_part``'s copy when there is one (a rank's own file)."""
    if target.dim is None:
        src, sp = next((x for x in sources if x[0].part == prefer_part), sources[0])
        if tuple(src.shape) != tuple(local_shape):
            raise CheckpointLayoutError(f"{src.name}: stored shape {src.shape} != wanted {local_shape}.")
        return (FlatCopy(src, 0, 0, src.numel),)
    out = []
    covered = 0
    d = target.dim
    for src, sp in sources:
        if sp.dim != d:
            raise CheckpointLayoutError(f"{src.name}: stored split dim {sp.dim} != canonical dim {d}.")
        # Identity: the stored tensor is exactly the wanted one.
        if sp.segments == target.segments and tuple(src.shape) == tuple(local_shape):
            return (FlatCopy(src, 0, 0, src.numel),)
        for lt, gt, n in target.segments:
            for ls, gs, m in sp.segments:
                g0, g1 = max(gt, gs), min(gt + n, gs + m)
                if g0 >= g1:
                    continue
                covered += g1 - g0
                if d == 0:
                    inner = math.prod(local_shape[1:])
                    if inner != math.prod(src.shape[1:]):
                        raise CheckpointLayoutError(
                            f"{src.name}: stored shape {src.shape} does not match wanted {local_shape} "
                            "beyond the split dimension."
                        )
                    out.append(FlatCopy(src, (ls + g0 - gs) * inner, (lt + g0 - gt) * inner, (g1 - g0) * inner))
                else:
                    if src.shape[0] != local_shape[0]:
                        raise CheckpointLayoutError(f"{src.name}: stored rows {src.shape[0]} != wanted {local_shape[0]}.")
                    out.append(BlockCopy(src, local_shape[0], src.shape[1], ls + g0 - gs,
                                         local_shape[1], lt + g0 - gt, g1 - g0))
    want = sum(n for _, _, n in target.segments)
    if covered != want:
        raise CheckpointLayoutError(
            f"{target.canonical}: the checkpoint covers {covered} of the {want} wanted slices along "
            f"dim {d}; a model part is missing or parts disagree."
        )
    return tuple(out)


def qkv_naming(names) -> str:
    """How a model names its attention projections, from its parameter names: "fused"
    (metaseq's ``qkv_proj``), "split" (``k_proj``/``v_proj``/``q_proj``), or "keep" when it
    has neither (then stored names are left as they are)."""
    names = list(names)
    if any(n.endswith("self_attn.qkv_proj.weight") for n in names):
        return "fused"
    if any(n.endswith("self_attn.k_proj.weight") for n in names):
        return "split"
    return "keep"


def _qkv_style(layout: CheckpointLayout, qkv: str) -> str:
    if qkv not in ("auto", "fused", "split", "keep"):
        raise ValueError(f"qkv={qkv!r}: expected 'auto', 'fused', 'split' or 'keep'.")
    if qkv == "auto":
        return "fused" if layout.flavor == "metaseq" else "keep"
    return qkv


def _cast(stored: torch.dtype, wanted: Optional[torch.dtype]) -> torch.dtype:
    """A requested dtype applies to floating-point tensors; integer buffers keep theirs."""
    return wanted if wanted is not None and stored.is_floating_point else stored


def plan_part(layout: CheckpointLayout, target_parts: int, target_part: int, *, qkv: str = "auto",
              rules: Optional[Mapping[str, str]] = None, dtype: Optional[torch.dtype] = None,
              tied: bool = True) -> dict:
    """(any rank, local) The tensors of model-parallel part ``target_part`` of
    ``target_parts``, in the checkpoint's order: name -> :class:`TargetTensor`.

    Raises:
        CheckpointLayoutError: the saved parts cannot be mapped onto the target size (a
            tensor without a rule, a dimension that does not divide).
    """
    if not 0 <= target_part < target_parts:
        raise ValueError(f"target_part={target_part} is outside 0..{target_parts - 1}")
    style = _qkv_style(layout, qkv)
    saved = layout.model_parallel_size
    # Split k/v/q stay as stored unless asked to fuse, or the model-parallel size changes.
    fuse_split = style == "fused" or saved != target_parts
    table, unknown = canonical_table(layout.parts, rules, fuse_split)
    if unknown and saved != target_parts:
        names = sorted(unknown)[:5]
        raise CheckpointLayoutError(
            f"{layout.display_name}: cannot change the model-parallel size {saved} -> {target_parts}: no "
            f"split rule for {names}{' ...' if len(unknown) > 5 else ''}. Pass rules={{'<name suffix>': "
            "'column'|'row'|'replicated'|'qkv'}} for them, or load at the saved size."
        )
    out: dict = {}
    # Walk the stored names of the target part's own index (or part 0) to keep file order.
    order_part = layout.parts[target_part] if saved == target_parts else layout.parts[0]
    done = set()
    for stored_name, stored in order_part.tensors.items():
        if stored_name in unknown:
            src = unknown[stored_name][target_part if saved == target_parts else 0]
            out[stored_name] = TargetTensor(stored_name, src.shape, _cast(src.dtype, dtype),
                                            (FlatCopy(src, 0, 0, src.numel),))
            continue
        p = place(stored_name, stored.shape, order_part.index, saved, rules, fuse_split)
        canonical = p.canonical
        if canonical in done:
            continue
        done.add(canonical)
        entry = table[canonical]
        gshape = entry["shape"]
        is_qkv = canonical.endswith(QKV_FUSED)
        if is_qkv:
            stored_split = any(split_qkv_name(n) for n in entry["names"])
            fused = style == "fused" or (style == "keep" and not stored_split)
            prefix = canonical[: -len(".qkv_proj.weight") if canonical.endswith("weight") else -len(".qkv_proj.bias")]
            leaf = canonical.rsplit(".", 1)[1]
            names = [canonical] if fused else [f"{prefix}.{k}.{leaf}" for k in ("k_proj", "v_proj", "q_proj")]
        else:
            names = [canonical]
        for name in names:
            if is_qkv and name == canonical:
                e = gshape[0] // 3
                if e % target_parts:
                    raise CheckpointLayoutError(
                        f"{name}: {e} rows per projection (k, v, q) do not split over {target_parts} "
                        "model-parallel parts: the attention heads must divide by the model-parallel size."
                    )
                per = e // target_parts
                tp = Placement(canonical, 0, tuple((j * per, j * e + target_part * per, per) for j in range(3)), gshape)
                local = (3 * per,) + tuple(gshape[1:])
            else:
                tp = _target_placement(canonical, gshape, target_part, target_parts, name, rules)
                local = list(gshape)
                if tp.dim is not None:
                    local[tp.dim] = sum(n for _, _, n in tp.segments)
                local = tuple(local)
            src_dtype = entry["sources"][0][0].dtype
            prefer = target_part if saved == target_parts else 0
            out[name] = TargetTensor(name, local, _cast(src_dtype, dtype), _copies(tp, local, entry["sources"], prefer))
    if tied:
        shared = list(layout.parts[0].shared)
        if not shared and layout.model_args().get("share_decoder_input_output_embed"):
            shared = [(n, n.replace("embed_tokens", "output_projection")) for n in out if n.endswith("embed_tokens.weight")]
        for src, dst in shared:
            # The tied weight follows its source, also where a file stores both (metaseq's
            # pytorch_ddp parts do): one tensor under two names, read once.
            if src in out and (dst not in out or out[dst].shape == out[src].shape):
                t = out[src]
                out[dst] = TargetTensor(dst, t.shape, t.dtype, t.copies, alias_of=src)
    return out


# --------------------------------------------------------------------------- flat shards

# A metaseq transformer layer, each its own FSDP instance in metaseq's wrapping.
_LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")


@dataclass(frozen=True)
class FlatGroup:
    """One FSDP flat parameter of the target: its members, in order."""

    fsdp_path: str
    flat_name: str
    names: tuple  # full names
    shapes: tuple
    shared: tuple = ()

    @property
    def key(self) -> str:
        return f"{self.fsdp_path}.{self.flat_name}" if self.fsdp_path else self.flat_name

    @property
    def numels(self) -> tuple:
        return tuple(math.prod(s) if s else 1 for s in self.shapes)

    @property
    def total_numel(self) -> int:
        return sum(self.numels)

    def shard_pieces(self, rank: int, world: int) -> tuple:
        """(pieces, local size) of ``rank``'s fairscale shard of this flat parameter for
        ``world`` ranks: ``(name, start, stop, offset)`` per member overlapping the shard
        (an element range of that member, landing at ``offset`` in the shard); the shard's
        tail from the last piece's end to the local size is zero padding."""
        lo, hi, size = flat_shard_range(self.total_numel, rank, world)
        pieces, offset = [], 0
        for name, numel in zip(self.names, self.numels):
            a, b = max(lo, offset), min(hi, offset + numel)
            if a < b:
                pieces.append((name, a - offset, b - offset, a - lo))
            offset += numel
        return tuple(pieces), size


@dataclass(frozen=True)
class FlatStructure:
    """How the target FSDP model groups its parameters into flat parameters."""

    groups: tuple  # of FlatGroup
    buffer_names: tuple

    @classmethod
    def from_layout(cls, layout: CheckpointLayout, targets: Mapping[str, TargetTensor]) -> "FlatStructure":
        part = layout.parts[0]
        if not part.flat_params:
            raise StateDictMismatchError(
                f"{layout.display_name}: flat=True needs the target FSDP wrapping, and this checkpoint is "
                "not flattened, so it cannot tell. Pass the wrapping of the fairscale FSDP model you load into: "
                "shard_metadata=model.local_metadata_dict() (CLI: --wrapping SHARD.pt, a flat shard file that "
                "model saved)."
            )
        paths = {fp.fsdp_path for fp in part.flat_params}
        owned: dict = {}
        for pair in part.shared:
            owner = max((p for p in paths if p == "" or pair[0].startswith(p + ".")), key=len, default=None)
            if owner is not None:
                owned.setdefault(owner, []).append(tuple(pair))
        groups = []
        for fp in part.flat_params:
            shapes = []
            for n in fp.names:
                if n not in targets:
                    raise StateDictMismatchError(f"{n}: listed in the checkpoint's flat parameter {fp.key} but not planned.")
                shapes.append(targets[n].shape)
            flat_name = fp.key[len(fp.fsdp_path) + 1:] if fp.fsdp_path else fp.key
            groups.append(FlatGroup(fp.fsdp_path, flat_name, fp.names, tuple(shapes),
                                    tuple(owned.pop(fp.fsdp_path, ()))))
        return cls(tuple(groups), tuple(part.buffer_names))

    @classmethod
    def from_metadata(cls, metadata: Mapping) -> "FlatStructure":
        """From fairscale's ``FullyShardedDataParallel.local_metadata_dict()``."""
        groups = []
        for pm in metadata["param_metadata"]:
            fsdp_path = pm.get("fsdp_path", "") or ""
            shared = tuple(
                (f"{fsdp_path}.{a}" if fsdp_path else a, f"{fsdp_path}.{b}" if fsdp_path else b)
                for a, b in (pm.get("shared_param_info") or ())
            )
            first = True
            for flat_name, v in pm["params"].items():
                names = tuple(f"{fsdp_path}.{n}" if fsdp_path else n for n in v["names"])
                groups.append(FlatGroup(fsdp_path, flat_name, names, tuple(tuple(int(x) for x in s) for s in v["shapes"]),
                                        shared if first else ()))
                first = False
        return cls(tuple(groups), tuple(metadata.get("buffer_names", ()) or ()))

    def check_against(self, targets: Mapping[str, TargetTensor]) -> None:
        problems = []
        for g in self.groups:
            for n, s in zip(g.names, g.shapes):
                if n not in targets:
                    problems.append(f"missing {n}")
                elif tuple(targets[n].shape) != tuple(s):
                    problems.append(f"{n}: checkpoint {tuple(targets[n].shape)} vs target {tuple(s)}")
        if problems:
            raise StateDictMismatchError(
                f"the target FSDP model does not match the checkpoint: {'; '.join(problems[:5])}"
                + (f" (+{len(problems) - 5} more)" if len(problems) > 5 else "")
            )

    def shard_metadata(self, rank: int, world: int) -> dict:
        """fairscale's ``shard_metadata`` for the local shard of ``rank`` of ``world``."""
        by_path: dict = {}
        for g in self.groups:
            lo, hi, size = flat_shard_range(g.total_numel, rank, world)
            pm = by_path.get(g.fsdp_path)
            if pm is None:
                pm = {"fsdp_path": g.fsdp_path, "params": {}, "no_broadcast_optim_state": False,
                      "shared_param_info": [tuple(p[len(g.fsdp_path) + 1:] if g.fsdp_path else p for p in pair)
                                            for pair in g.shared]}
                by_path[g.fsdp_path] = pm
            prefix = len(g.fsdp_path) + 1 if g.fsdp_path else 0
            pm["params"][g.flat_name] = {
                "names": [n[prefix:] for n in g.names],
                "shapes": [tuple(s) for s in g.shapes],
                "numels": list(g.numels),
                "padding": size - (hi - lo),
            }
        return {"param_metadata": list(by_path.values()), "buffer_names": list(self.buffer_names)}


def metaseq_wrapping(targets: Mapping[str, TargetTensor], buffers: set) -> FlatStructure:
    """(local) metaseq's FSDP wrapping for an unflattened source: every ``*.layers.{i}``
    module is its own FSDP instance, the rest (embeddings, final layer norm) is the root's
    flat param; a tied weight is recorded in the ``shared_param_info`` of the instance
    holding its source."""
    root: list = []
    nested: dict = {}  # (insertion order: the model's)
    shared: dict = {}
    for n, t in targets.items():
        if t.alias_of is not None:
            m = _LAYER.match(t.alias_of)
            shared.setdefault(m.group(1) if m else "", []).append((t.alias_of, n))
            continue
        if n in buffers:
            continue
        m = _LAYER.match(n)
        (nested.setdefault(m.group(1), []) if m else root).append(n)
    groups = []
    if root:
        groups.append(FlatGroup("", "flat_param_0", tuple(root), tuple(targets[n].shape for n in root),
                                tuple(shared.get("", ()))))
    for path, names in nested.items():
        groups.append(FlatGroup(path, "flat_param_0", tuple(names), tuple(targets[n].shape for n in names),
                                tuple(shared.get(path, ()))))
    return FlatStructure(tuple(groups), tuple(n for n in targets if n in buffers))


def flat_structure(layout: CheckpointLayout, targets: Mapping[str, TargetTensor], metadata: Optional[Mapping] = None,
                   *, assume_metaseq: bool = False) -> FlatStructure:
    """(local) How the target FSDP model groups ``targets`` (one part's :func:`plan_part`)
    into flat parameters, checked against them: from fairscale's ``metadata``
    (``FullyShardedDataParallel.local_metadata_dict()``) where given, else from the
    checkpoint's own flat parameters; for unflattened weights, with ``assume_metaseq``, the
    wrapping metaseq gives its models (:func:`metaseq_wrapping`).

    Raises:
        StateDictMismatchError: the metadata does not describe ``targets``, or the
            checkpoint is unflattened and nothing says how the target wraps it.
    """
    if metadata is not None:
        structure = FlatStructure.from_metadata(metadata)
    elif assume_metaseq and not layout.flat:
        structure = metaseq_wrapping(targets, set(layout.parts[0].buffer_names))
    else:
        structure = FlatStructure.from_layout(layout, targets)
    structure.check_against(targets)
    return structure


def flat_shard_range(total: int, rank: int, world: int) -> tuple:
    """(start, end, local size) of ``rank``'s slice of a flat parameter of ``total``
    elements over ``world`` ranks, exactly as fairscale shards it: ``torch.chunk`` into
    ceil(total / world) sized pieces, the tail (and any empty rank) zero-padded."""
    size = -(-total // world) if total else 0
    lo = min(total, rank * size)
    hi = min(total, lo + size)
    return lo, hi, size

