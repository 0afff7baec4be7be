"""``torch.distributed.checkpoint`` folders: a ``.metadata`` file beside ``*.distcp`` files,
as ``dcp.save`` writes them (FSDP1 ``SHARDED_STATE_DICT``, FSDP2 ``fully_shard``, a plain
state dict saved without a process group, torchtitan), local or at a URL.

The ``.metadata`` is read as data by our own pickle machine (:mod:`.._dcp_meta`: torch's
reader is a bare ``pickle.load``); each chunk's item in its ``.distcp`` file is a whole
``torch.save`` archive, checked as ``torch.load`` would check it (:mod:`.._dcp_items`). The
layout is one model part whose tensors are the saved FQNs (the model's state dict unwrapped
from a training container such as ``{"model": ...}``, as :mod:`.plain` unwraps one), each
tensor's extents the contiguous runs of its chunks, in order, tiling it exactly. A chunk
whose trailing dims are whole is one run; one split along a later dim is one run per row
block. What the folder holds beside the model (optimizer state, step counters) is named in
the layout's notes and not read by the plain verbs; ``load_into(..., optimizer=)`` reads
the optimizer state ``get_state_dict`` saves through :func:`describe_with_optimizer`, its
per-parameter tensors shadows planned and read like the weights (:mod:`.._optim_into`).

Writer variants read: ``SerializationFormat.TORCH_SAVE`` (the default: one archive per item),
``SerializationFormat.SAFETENSORS`` (every tensor item of a file points at one safetensors
blob after the pickled values; torch 2.13 writes it and cannot read it back), and the Hugging
Face storage writer's distributed save (``shard-*-model-*-of-*.safetensors``, chunk offsets in
each header's ``DCP_SHARDING_INFO``, no ``.metadata``); its rank-0 save is a Hugging Face
folder (:mod:`.huggingface`). Refused by name: items written with a stream-transforming
extension (``stream.zstd/1``: compression), which ``torch.distributed.checkpoint.load`` reads.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
from dataclasses import dataclass
from typing import Mapping, Optional

import torch

from .. import _storage
from .._dcp_items import chunk_data_offset, chunk_key, parse_chunk_key, prefetch_items, vouch
from .._dcp_meta import METADATA, DcpMetadata, TensorEntry, metadata_of
from .._errors import CheckpointLayoutError, cap_list
from .._layout import CheckpointFile, CheckpointLayout, CheckpointSettings, FileName, ModelPart, StoredTensor
from .._reading import Extent
from .huggingface import read_safetensors_header

NAME = "dcp"

# Where a training script keeps the model inside what it saved (as formats/_torchsave.py
# unwraps a torch.save'd container): FSDP1's T5 example saves {"model": ...}.
_CONTAINERS = ("model", "state_dict", "model_state_dict", "module")
# What training loops save beside the model's tensors (never the model's: a container key).
_NOT_MODEL = ("optim", "optimizer", "optimizers", "optimizer_state_dict", "lr_scheduler", "lr_schedulers",
              "scheduler", "dataloader", "train_state")
NOT_MODEL = _NOT_MODEL  # the containers of training state, not the model's (_optim_into)
# torch's HuggingFaceStorageWriter(save_distributed=True) (torchtitan's Hugging Face save):
# each rank's chunks in a safetensors file of its own, their offsets in the header's
# DCP_SHARDING_INFO, and no .metadata (torch's HuggingFaceStorageReader infers each
# tensor's size from its chunks, as done here).
_HF_SHARD = re.compile(r"^shard-\d+-model-\d+-of-\d+\.safetensors$")
_ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
              "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
              "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def _folder(path: str) -> str:
    """The folder a path names: itself, or the folder of its ``.metadata`` or of one of its
    ``.distcp`` files (any file of a set names the set, as for metaseq's)."""
    sep = "/" if _storage.is_url(path) else os.sep
    path = path.rstrip(sep) or path
    head, _, base = path.rpartition(sep)
    named = base == METADATA or base.endswith(".distcp") or _HF_SHARD.match(base)
    return (head or ".") if head and named else path


def _join(folder: str, name: str) -> str:
    return folder.rstrip("/") + "/" + name if _storage.is_url(folder) else os.path.join(folder, name)


def detect(path: str) -> bool:
    """A folder holding a ``.metadata`` file, or that file itself."""
    folder = _folder(os.fspath(path))
    try:
        return _storage.isdir(folder) and (_storage.isfile(_join(folder, METADATA)) or bool(_hf_shards(folder)))
    except OSError:
        return False


def _hf_shards(folder: str) -> list:
    """The shard files of a Hugging Face writer's distributed save (local folders only)."""
    if _storage.is_url(folder) or os.path.exists(os.path.join(folder, METADATA)):
        return []
    try:
        return sorted(n for n in os.listdir(folder) if _HF_SHARD.match(n))
    except OSError:
        return []


def _model_tensors(meta: DcpMetadata) -> tuple:
    """(name -> TensorEntry of the model's tensors, the container they were under or "",
    the FQNs of tensors left out). The saved state dict's structure comes from the
    ``planner_data`` (the path of keys each FQN flattens); without it, every tensor is the
    model's, under its FQN."""
    paths = {fqn: meta.planner_data.get(fqn, (fqn,)) for fqn in meta.tensors}
    if meta.planner_data and all(len(p) >= 2 for p in paths.values()):
        tops = {p[0] for p in paths.values()}
        for c in _CONTAINERS:
            if c in tops:
                cut = len(c) + 1
                model = {fqn[cut:]: t for fqn, t in meta.tensors.items() if paths[fqn][0] == c}
                left = tuple(fqn for fqn in meta.tensors if paths[fqn][0] != c)
                return model, c, left
    # torchtitan keeps the model's FQNs at the top level, beside {"optimizer": ...} and the like
    left = tuple(fqn for fqn, p in paths.items() if len(p) >= 2 and p[0] in _NOT_MODEL)
    if left and len(left) < len(paths):
        return {fqn: t for fqn, t in meta.tensors.items() if fqn not in set(left)}, "", left
    return dict(meta.tensors), "", ()


def _file_of(folder: str, rel: str, where: str, seen: dict) -> str:
    """The ``.distcp`` file an item names: a plain name in the folder, no link out of it."""
    if rel in seen:
        return seen[rel]
    if rel in ("", ".", "..") or "/" in rel or "\\" in rel or "\0" in rel:
        raise CheckpointLayoutError(
            f"{where}: the .metadata places it in {rel!r}, which is not a file name inside the checkpoint's folder "
            "(torch.distributed.checkpoint writes plain names such as __0_0.distcp). The .metadata was crafted or "
            "damaged; nothing outside the folder is read.")
    path = _join(folder, rel)
    if not _storage.is_url(folder):
        real = os.path.realpath(path)
        if os.path.dirname(real) != os.path.realpath(folder):
            raise CheckpointLayoutError(
                f"{where}: {path} is a link out of the checkpoint's folder (to {real}). Replace the link with the "
                "file itself; nothing outside the folder is read.")
    if not _storage.isfile(path):
        raise CheckpointLayoutError(
            f"{where}: the .metadata places it in {rel}, which the folder does not hold. The folder is incomplete: "
            "copy it again from where it was saved.")
    seen[rel] = path
    return path


def _run_count(size: tuple, sizes: tuple) -> int:
    k = len(size)
    while k > 0 and sizes[k - 1] == size[k - 1]:
        k -= 1
    return math.prod(sizes[:k - 1]) if k > 1 else 1


def _runs(size: tuple, offsets: tuple, sizes: tuple) -> list:
    """(first element in the flattened tensor, first element in the chunk, elements) of each
    contiguous run of one chunk of a tensor of ``size``, in order."""
    d = len(size)
    k = d
    while k > 0 and sizes[k - 1] == size[k - 1]:
        k -= 1
    run = math.prod(size[k:]) * (sizes[k - 1] if k else 1)
    if run == 0:
        return []
    gstride = [math.prod(size[j + 1:]) for j in range(d)]
    cstride = [math.prod(sizes[j + 1:]) for j in range(d)]
    head = k - 1 if k else 0
    base = sum(o * g for o, g in zip(offsets[:k], gstride[:k]))
    out = []
    for idx in itertools.product(*(range(s) for s in sizes[:head])):
        out.append((base + sum(i * g for i, g in zip(idx, gstride)), sum(i * c for i, c in zip(idx, cstride)), run))
    return out


def _pieces(meta: DcpMetadata, fqn: str, t: TensorEntry, folder: str, files: dict, versions: dict) -> list:
    """(offsets, sizes, file, byte offset of its elements, Extent key) of each chunk, each
    item checked (:func:`.._dcp_items.chunk_data_offset`; ``versions``: the files' versions
    this description took)."""
    where = f"{meta.path}: tensor {fqn}"
    out = []
    for c in t.chunks:
        _check_chunk(where, t.size, c.offsets, c.sizes)
        item = meta.item(fqn, c.offsets)
        if item is None:
            raise CheckpointLayoutError(f"{where}: the .metadata lists a chunk at offsets {list(c.offsets)} but no "
                                        "item that stores it. The .metadata is damaged: copy the folder again.")
        if item.transforms:
            raise CheckpointLayoutError(
                f"{where}: written with the {', '.join(item.transforms)} extension, which metaseq-oneload does not "
                "decode; load it with torch.distributed.checkpoint.load or re-save it without the extension.")
        path = _file_of(folder, item.relative_path, where, files)
        if math.prod(c.sizes) == 0:
            continue
        data = chunk_data_offset(path, fqn, item, t.dtype, c.offsets, c.sizes, versions)
        out.append((c.offsets, c.sizes, path, data, chunk_key(fqn, c.offsets)))
    return out


def _check_chunk(where: str, size: tuple, offsets: tuple, sizes: tuple) -> None:
    if len(offsets) != len(size) or len(sizes) != len(size) or any(
            o + s > n for o, s, n in zip(offsets, sizes, size)):
        raise CheckpointLayoutError(
            f"{where}: a chunk at offsets {list(offsets)} of sizes {list(sizes)} reaches outside the tensor's "
            f"size {list(size)}. The checkpoint's metadata was crafted or damaged: copy the folder again.")


# Extents one tensor may have: a chunk split along an inner dim is one run per row, so a
# [50k, 4096] weight in 8 column blocks is 400k; a crafted split into single elements of a
# large tensor would be one object per element.
_MAX_RUNS = 1 << 22


def _tiled(where: str, size: tuple, dtype, pieces: list) -> tuple:
    """The tensor's extents, in order, once its chunks tile it exactly."""
    runs = []
    count = sum(_run_count(size, sizes) for _, sizes, *_ in pieces)
    if count > _MAX_RUNS:
        raise CheckpointLayoutError(
            f"{where}: its chunks split it into {count} separate runs of bytes, more than {_MAX_RUNS} (chunks of single "
            "rows or elements). Load it with torch.distributed.checkpoint.load, or re-save it sharded along dim 0.")
    for offsets, sizes, path, data, key in pieces:
        runs += [(g, Extent(path, key, local, n, data + local * dtype.itemsize))
                 for g, local, n in _runs(size, offsets, sizes)]
    runs.sort(key=lambda r: r[0])
    pos = 0
    for g, e in runs:
        if g != pos:
            what = (f"two chunks overlap at element {g}" if g < pos
                    else f"no chunk holds elements {pos}..{g}")
            raise CheckpointLayoutError(
                f"{where}: its chunks do not tile its size {list(size)}: {what}. The checkpoint's metadata was "
                "crafted or damaged, or the save was cut short: copy the folder again from where it was saved.")
        pos += e.numel
    if pos != math.prod(size):
        raise CheckpointLayoutError(
            f"{where}: its chunks hold {pos} of its {math.prod(size)} elements (size {list(size)}). The save was "
            "cut short or the checkpoint's metadata damaged: copy the folder again from where it was saved.")
    return tuple(e for _, e in runs)


def _notes(meta: DcpMetadata, container: str, left: tuple, files: dict) -> tuple:
    notes = [f"a torch.distributed.checkpoint folder written by {len(files)} rank(s) "
             f"({cap_list(sorted(files), 4)}), DCP version {meta.version or 'unknown'}"]
    if container:
        notes.append(f"the model's state dict is under {container!r} of what was saved")
    if left:
        optim = any(meta.planner_data.get(fqn, ())[1:2] == ("state",) for fqn in left)
        notes.append(f"{len(left)} tensor(s) beside the model's state dict, not read: {cap_list(left, 3)}"
                     + (" (an optimizer's state: load_into(..., optimizer=) reads it)" if optim else ""))
    if meta.values:
        notes.append(f"{len(meta.values)} non-tensor value(s), not read: {cap_list(meta.values, 3)}")
    return tuple(notes)


def _hf_pieces(path: str, pieces: dict, dtypes: dict) -> None:
    """Add one safetensors shard file's chunks to ``pieces`` (fqn -> list) and ``dtypes``."""
    header, start = read_safetensors_header(path)
    info = header.get("__metadata__", {}).get("DCP_SHARDING_INFO")
    info = json.loads(info) if isinstance(info, str) else None
    if not isinstance(info, dict):
        raise CheckpointLayoutError(f"{path}: no DCP_SHARDING_INFO in its header; expected a shard file of torch's "
                                    "HuggingFaceStorageWriter(save_distributed=True).")
    for key, v in header.items():
        if key == "__metadata__":
            continue
        where = f"{path}: tensor {key}"
        dtype = getattr(torch, _ST_DTYPES.get(v["dtype"], ""), None)
        shape, (b, e) = tuple(v["shape"]), v["data_offsets"]
        offsets = (info.get(key) or {}).get("saved_offsets")
        if not isinstance(dtype, torch.dtype) or not all(type(x) is int and x >= 0 for x in shape):
            raise CheckpointLayoutError(f"{where}: unsupported dtype {v['dtype']!r} or shape {list(shape)}.")
        if e - b != math.prod(shape) * dtype.itemsize:
            raise CheckpointLayoutError(f"{where}: {e - b} bytes for shape {list(shape)} {v['dtype']}.")
        if not isinstance(offsets, list) or len(offsets) != len(shape) or not all(
                type(o) is int and o >= 0 for o in offsets):
            raise CheckpointLayoutError(f"{where}: DCP_SHARDING_INFO gives it no saved_offsets of {len(shape)} ints.")
        if dtypes.setdefault(key, dtype) != dtype:
            raise CheckpointLayoutError(f"{where}: a {v['dtype']} chunk of a tensor other files hold as "
                                        f"{str(dtypes[key]).replace('torch.', '')}.")
        if math.prod(shape):
            pieces.setdefault(key, []).append((tuple(offsets), shape, path, start + b, key))
        else:
            pieces.setdefault(key, [])


def _describe_hf_shards(folder: str, names: list) -> tuple:
    """(tensors, notes) of a Hugging Face writer's distributed save."""
    pieces: dict = {}
    dtypes: dict = {}
    for n in names:
        _hf_pieces(os.path.join(folder, n), pieces, dtypes)
    tensors = {}
    for fqn, ps in pieces.items():
        size = tuple(max((o[d] + s[d] for o, s, *_ in ps), default=0) for d in range(len(ps[0][0]))) if ps else (0,)
        tensors[fqn] = StoredTensor(fqn, 0, dtypes[fqn], size, _tiled(f"{folder}: tensor {fqn}", size, dtypes[fqn], ps))
    notes = (f"a torch.distributed.checkpoint save by the Hugging Face storage writer (save_distributed), written by "
             f"{len(names)} rank(s) ({cap_list(names, 2)}); each tensor's size is where its chunks end, as torch's "
             "HuggingFaceStorageReader takes it",)
    return tensors, notes


def describe(path: str, *, trust_pickle: bool = False) -> CheckpointLayout:
    """(any rank, local) The one-part layout of a DCP folder (``trust_pickle`` changes
    nothing: the ``.metadata`` is read as data, and items are single tensors)."""
    folder = _folder(os.fspath(path))
    if not _storage.is_url(folder):
        folder = os.path.abspath(folder)
    names = _hf_shards(folder)
    if names:
        tensors, notes = _describe_hf_shards(folder, names)
        return _layout(folder, tensors, [os.path.join(folder, n) for n in names], "safetensors", notes, trust_pickle)
    return _dcp_layout(folder, metadata_of(folder), trust_pickle, None)


def _stored(meta: DcpMetadata, name: str, t: TensorEntry, folder: str, files: dict, versions: dict) -> StoredTensor:
    return StoredTensor(name, 0, t.dtype, t.size, _tiled(f"{meta.path}: tensor {t.fqn}", t.size, t.dtype,
                                                          _pieces(meta, t.fqn, t, folder, files, versions)))


def _dcp_layout(folder: str, meta: DcpMetadata, trust_pickle: bool, shadows: "Optional[OptimizerShadows]"):
    """The layout of a folder with a ``.metadata``; with ``shadows``, its part holds the
    optimizer's state tensors too, under their saved FQNs."""
    model, container, left = _model_tensors(meta)
    if not model:
        raise CheckpointLayoutError(
            f"{meta.path}: the torch.distributed.checkpoint folder holds no tensors "
            f"({len(meta.values)} non-tensor value(s) only); nothing to load.")
    files: dict = {}
    versions: dict = {}  # each file's version, taken once (its items are parsed under it)
    _prefetch(meta, [t.fqn for t in model.values()] + list(shadows.tensors if shadows is not None else ()),
              folder, files, versions)
    tensors = {name: _stored(meta, name, t, folder, files, versions) for name, t in model.items()}
    for name in (shadows.tensors if shadows is not None else {}):
        if name in tensors:
            raise CheckpointLayoutError(f"{meta.path}: the optimizer state tensor {name} has the name of one of the "
                                        "model's tensors; load the model and the optimizer with torch's own loader.")
        tensors[name] = _stored(meta, name, meta.tensors[name], folder, files, versions)
    layout = _layout(folder, tensors, [p for _, p in sorted(files.items())], "distcp",
                     _notes(meta, container, left, files), trust_pickle)
    if not _storage.is_url(folder):
        # Every chunk of the layout was just checked item by item (_stored): this process's
        # reads take those spans, as a rank that adopts the layout does, instead of parsing
        # every item of the file again when the first read of it is checked.
        vouch_layout(layout)
    return layout


_BATCH = 64  # items fetched together, then parsed (a batch's bytes stay a few MB in the cache)


def _prefetch(meta: DcpMetadata, fqns: list, folder: str, files: dict, versions: dict) -> None:
    """(local) On an object store, the items of these tensors fetched file by file, a batch
    at a time concurrently (:func:`.._dcp_items.prefetch_items`), and parsed from the cache
    while it holds them. Refuses nothing here: every check runs again, from the parsed
    cache, in the order :func:`_stored` takes the tensors, and raises there."""
    if not _storage.is_url(folder):
        return
    by_file: dict = {}
    for fqn in fqns:
        t = meta.tensors[fqn]
        for c in t.chunks:
            item = meta.item(fqn, c.offsets)
            if item is not None and not item.transforms and math.prod(c.sizes):
                by_file.setdefault(item.relative_path, []).append((item.offset, fqn, t, c, item))
    for rel, entries in sorted(by_file.items()):
        try:
            path = _file_of(folder, rel, meta.path, files)
        except CheckpointLayoutError:
            continue
        entries.sort(key=lambda e: e[0])
        for i in range(0, len(entries), _BATCH):
            batch = entries[i:i + _BATCH]
            prefetch_items(path, [e[4] for e in batch])
            for _, fqn, t, c, item in batch:
                try:
                    chunk_data_offset(path, fqn, item, t.dtype, c.offsets, c.sizes, versions)
                except Exception:  # noqa: BLE001  (raised where _stored meets it)
                    pass


def vouch_layout(layout: CheckpointLayout) -> None:
    """(local) On a rank that adopted a DCP layout another rank described: the spans of the
    chunks it checked, taken from the layout's extents (each chunk's first byte, and its last
    run's end), so that this rank's reads are checked against them without parsing every
    item again (:func:`.._dcp_items.vouch`)."""
    ends: dict = {}
    for part in layout.parts:
        for t in part.tensors.values():
            size = t.dtype.itemsize
            for e in t.extents:
                if e.byte_offset is None or not e.path.endswith(".distcp"):
                    continue
                start = e.byte_offset - e.elem_offset * size
                k = (e.path, parse_chunk_key(e.key), start)
                ends[k] = max(ends.get(k, start), e.byte_offset + e.numel * size)
    spans: dict = {}
    for (path, _, start), end in sorted(ends.items(), key=lambda kv: (kv[0][0], kv[0][2])):
        starts, stops = spans.setdefault(path, ([], []))
        starts.append(start)
        stops.append(end)
    vouch(spans)


@dataclass(frozen=True)
class OptimizerShadows:
    """A DCP folder's optimizer state as ``torch.distributed.checkpoint.state_dict.get_state_dict``
    saves it (``{container: {"state": {fqn: {key: value}}, "param_groups": [...]}}``, flattened):
    each per-parameter state tensor a shadow tensor of the layout, named by its saved FQN and
    chunked like its parameter, and the pickled values (``param_groups``, non-tensor state)."""

    container: str  # the key the optimizer's state dict was saved under ("optim", "optimizer", ...)
    tensors: Mapping  # shadow name (saved FQN) -> (the parameter's FQN, the state key)
    values: Mapping  # saved FQN of a pickled value -> its path under the container
    folder: str


def _optimizer_entries(meta: DcpMetadata, folder: str) -> Optional[OptimizerShadows]:
    """The optimizer state the ``planner_data`` places under a training container, or None."""
    under = {fqn: p for fqn, p in meta.planner_data.items()
             if len(p) >= 3 and p[0] in _NOT_MODEL and p[1] in ("state", "param_groups")}
    if not under:
        return None
    containers = sorted({p[0] for p in under.values()})
    if len(containers) > 1:
        raise CheckpointLayoutError(
            f"{meta.path}: optimizer state under {len(containers)} keys ({', '.join(containers)}); metaseq-oneload "
            "fills one optimizer. Load them with torch.distributed.checkpoint.load and set_optimizer_state_dict.")
    tensors, values = {}, {}
    for fqn, p in under.items():
        if fqn in meta.tensors:
            if p[1] != "state" or len(p) != 4 or not all(type(x) is str for x in p[2:]):
                raise CheckpointLayoutError(
                    f"{meta.path}: the optimizer tensor {fqn} is saved at {list(p)}, not as "
                    "state.<parameter FQN>.<key> (what get_state_dict saves); load it with torch's own loader.")
            tensors[fqn] = (p[2], p[3])
        else:
            values[fqn] = tuple(p[1:])
    return OptimizerShadows(containers[0], tensors, values, folder)


def describe_with_optimizer(path: str, *, trust_pickle: bool = False) -> tuple:
    """(any rank, local) (the layout of :func:`describe` whose part also holds the optimizer's
    state tensors, the :class:`OptimizerShadows`), or (:func:`describe`'s layout, None) where
    the folder holds no optimizer state as ``get_state_dict`` saves it."""
    folder = _folder(os.fspath(path))
    if not _storage.is_url(folder):
        folder = os.path.abspath(folder)
    if _hf_shards(folder):
        return describe(folder, trust_pickle=trust_pickle), None
    meta = metadata_of(folder)
    shadows = _optimizer_entries(meta, folder)
    return _dcp_layout(folder, meta, trust_pickle, shadows), shadows


def _layout(folder: str, tensors: dict, files: list, fmt: str, notes: tuple, trust_pickle: bool) -> CheckpointLayout:
    return CheckpointLayout(
        directory=folder,
        prefix="",
        name=FileName(""),
        files=(tuple(CheckpointFile(p, 0, i, _storage.getsize(p), fmt) for i, p in enumerate(files)),),
        parts=(ModelPart(0, tensors, (), (), ()),),
        cfg=CheckpointSettings(),
        metadata_key=None,
        aliases=(),
        num_updates=None,
        flavor="dcp",
        notes=notes,
        trust_pickle=trust_pickle,
        config={},
    )

