"""Hugging Face model folders.

``model.safetensors``, ``model-0000k-of-0000n.safetensors`` + ``model.safetensors.index.json``,
``pytorch_model.bin`` and its sharded ``.bin.index.json`` variant all describe ONE state dict
spread over files (not FSDP shards), so they become a one-part layout whose tensors point
into whichever file holds them. Safetensors headers give byte offsets directly; ``.bin``
files are torch zip archives read through the same allowlisted header reader as ``.pt``.
Nothing here reads tensor data.
"""

from __future__ import annotations

import json
import os
import stat
import struct

import torch

from .._errors import CheckpointLayoutError, CheckpointNotFoundError, cap_list, os_error_message
from .._layout import CheckpointFile, CheckpointLayout, CheckpointSettings, FileName, ModelPart, StoredTensor
from .._reading import Extent, read_header
from ._torchsave import direct_extent, file_format, model_dict

NAME = "huggingface"

_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
for _name, _attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2")):
    if hasattr(torch, _attr):
        _ST_DTYPES[_name] = getattr(torch, _attr)

_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_SINGLES = ("model.safetensors", "pytorch_model.bin")
SIDECAR_FORMAT = "metaseq-oneload/safetensors-sidecar/1"  # the sidecar _conversion writes
_MAX_SIDECAR = 64 << 20


def _hf_files_in(folder: str) -> list:
    try:
        names = set(os.listdir(folder))
    except OSError:
        return []
    return [n for n in _INDEXES + _SINGLES if n in names]


def detect(path: str) -> bool:
    """A Hugging Face folder (weights beside no ``.pt`` files) or one of its weight files /
    indexes."""
    if os.path.isdir(path):
        return bool(_hf_files_in(path)) and not any(n.endswith(".pt") for n in os.listdir(path))
    return path.endswith((".safetensors", ".bin", ".index.json"))


def read_safetensors_header(path: str) -> tuple:
    """(header dict, data start offset) of a safetensors file."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise CheckpointLayoutError(f"{path}: truncated: {size} bytes, shorter than a safetensors header.")
            (n,) = struct.unpack("<Q", raw)
            if n > min(size - 8, 100 << 20):
                raise CheckpointLayoutError(
                    f"{path}: not a safetensors file or truncated: header length {n} but the file has {size} bytes.")
            header = json.loads(f.read(n))
    except OSError as e:
        raise CheckpointLayoutError(os_error_message(e, path)) from e
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointLayoutError(f"{path}: damaged safetensors header ({e}).") from e
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        raise CheckpointLayoutError(
            f"{path}: truncated: tensors end at byte {8 + n + end} but the file has {size} bytes. "
            "Download or copy it again.")
    return header, 8 + n


def _weight_files(path: str) -> tuple:
    """(folder, ordered weight files, tensor name -> file or None)."""
    if os.path.isdir(path):
        found = _hf_files_in(path)
        if not found:
            raise CheckpointNotFoundError(
                f"{path}: no model.safetensors, model.safetensors.index.json, pytorch_model.bin or "
                "pytorch_model.bin.index.json in the folder.")
        path = os.path.join(path, found[0])
    if not os.path.exists(path):
        raise CheckpointNotFoundError(f"{path}: no such file.")
    folder = os.path.dirname(os.path.abspath(path))
    if path.endswith(".index.json"):
        with open(path) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointLayoutError(f"{path}: not a Hugging Face index (no weight_map).")
        files = sorted(set(weight_map.values()))
        missing = [n for n in files if not os.path.exists(os.path.join(folder, n))]
        if missing:
            raise CheckpointLayoutError(
                f"{path}: the index lists {len(files)} files but {cap_list(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} missing. Download the complete set.")
        return folder, [os.path.join(folder, n) for n in files], {k: os.path.join(folder, v) for k, v in weight_map.items()}
    # A single shard file of an indexed set: use the index beside it.
    base = os.path.basename(path)
    for index in _INDEXES:
        idx = os.path.join(folder, index)
        if "-of-" in base and os.path.exists(idx):
            return _weight_files(idx)
    return folder, [os.path.abspath(path)], None


def describe(path: str, *, trust_pickle: bool = False) -> CheckpointLayout:
    """(any rank, local) The one-part layout of a Hugging Face folder or weight file."""
    folder, files, weight_map = _weight_files(os.fspath(path))
    tensors: dict = {}
    ties: list = []
    for p in files:
        if p.endswith(".safetensors"):
            header, start = read_safetensors_header(p)
            ties += [(p, src, dst) for dst, src in _sidecar_ties(p, header).items()]
            for name, v in header.items():
                if name == "__metadata__":
                    continue
                if v["dtype"] not in _ST_DTYPES:
                    raise CheckpointLayoutError(f"{p}: {name}: unsupported safetensors dtype {v['dtype']}.")
                b, e = v["data_offsets"]
                dtype = _ST_DTYPES[v["dtype"]]
                numel = 1
                for s in v["shape"]:
                    numel *= s
                if (e - b) != numel * torch.empty((), dtype=dtype).element_size():
                    raise CheckpointLayoutError(f"{p}: {name}: {e - b} bytes for shape {v['shape']} {v['dtype']}.")
                tensors[name] = StoredTensor(name, 0, dtype, tuple(v["shape"]), (Extent(p, name, 0, numel, start + b),))
        else:
            obj = read_header(p, trust_pickle=trust_pickle)
            model = model_dict(obj)
            if model is None:
                raise CheckpointLayoutError(f"{p}: not a state dict of tensors.")
            fmt = file_format(p)
            for name, t in model.items():
                tensors[name] = StoredTensor(name, 0, t.dtype, tuple(t.shape), (direct_extent(p, fmt, obj, name, t),))
    if weight_map is not None:
        missing = sorted(set(weight_map) - set(tensors))
        if missing:
            raise CheckpointLayoutError(
                f"{folder}: the index lists {len(missing)} tensor(s) its files do not hold (e.g. {missing[:3]}).")
    if not tensors:
        raise CheckpointLayoutError(f"{folder}: the weight files hold no tensors.")
    shared = _apply_ties(tensors, ties)
    stem = os.path.basename(files[0]).split(".")[0].split("-0")[0]
    return CheckpointLayout(
        directory=folder,
        prefix=stem,
        name=FileName(stem),
        files=(tuple(CheckpointFile(p, 0, i, os.path.getsize(p), "safetensors" if p.endswith(".safetensors")
                                    else file_format(p)) for i, p in enumerate(files)),),
        parts=(ModelPart(0, tensors, (), tuple(n for n in tensors if n.endswith(".version")), shared),),
        cfg=CheckpointSettings(),
        metadata_key=None,
        aliases=(),
        num_updates=None,
        flavor="huggingface",
        warnings=(),
        config=_config(folder),
    )


def _sidecar_ties(path: str, header: dict) -> dict:
    """``{tied name: its source}`` from the JSON sidecar ``convert --format safetensors`` writes
    beside its file (named in ``__metadata__["metaseq_oneload"]``): safetensors cannot store one
    tensor under two names, so the tie lives there. Read as a hint: a plain file beside this
    one, not through a link, bounded; an unreadable sidecar ties nothing."""
    meta = header.get("__metadata__")
    side = meta.get("metaseq_oneload") if isinstance(meta, dict) else None
    if not isinstance(side, str) or os.path.basename(side) != side or side in ("", ".", ".."):
        return {}
    try:
        fd = os.open(os.path.join(os.path.dirname(path), side),
                     os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return {}
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_SIDECAR:
            return {}
        with os.fdopen(fd, "rb", closefd=False) as f:
            doc = json.loads(f.read(_MAX_SIDECAR))
    except (OSError, ValueError):
        return {}
    finally:
        os.close(fd)
    if not isinstance(doc, dict) or doc.get("format") != SIDECAR_FORMAT or \
            doc.get("weights") != os.path.basename(path):
        return {}
    tied = doc.get("tied")
    if not isinstance(tied, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in tied.items()):
        raise CheckpointLayoutError(
            f"{path}: its sidecar {side} has a \"tied\" field that is not an object of tensor names "
            f"(found {str(tied)[:80]}); expected {{tied name: source name}}. Write the sidecar again "
            "(convert --format safetensors) or remove its \"tied\" field.")
    return tied


def _apply_ties(tensors: dict, ties: list) -> tuple:
    """(tied name, source) pairs checked against the stored tensors; each tied name becomes
    an alias of its source's bytes (the same extents), as a file storing both names would.
    Returns ``ModelPart.shared``'s (source, alias) pairs."""
    shared = []
    for path, src, dst in ties:
        if src == dst or src not in tensors:
            raise CheckpointLayoutError(
                f"{path}: its sidecar ties {dst!r} to {src!r}, "
                + ("itself" if src == dst else "which no weight file holds")
                + "; expected the name of a stored tensor. The sidecar does not belong to these files: "
                "write the output again, or remove the sidecar's \"tied\" entry.")
        if (src, dst) in shared:
            continue
        s = tensors[src]
        have = tensors.get(dst)
        if have is not None and (have.shape != s.shape or have.dtype != s.dtype):
            raise CheckpointLayoutError(
                f"{path}: its sidecar ties {dst!r} ({have.dtype}, {list(have.shape)}) to {src!r} "
                f"({s.dtype}, {list(s.shape)}); a tie needs the same dtype and shape. "
                "Write the output again, or remove the sidecar's \"tied\" entry.")
        if have is None:
            tensors[dst] = StoredTensor(dst, s.part, s.dtype, s.shape, s.extents)
        shared.append((src, dst))
    return tuple(shared)


def _config(folder: str) -> dict:
    """The folder's config.json ({} where there is none)."""
    p = os.path.join(folder, "config.json")
    if not os.path.exists(p):
        return {}
    try:
        with open(p) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointLayoutError(f"{p}: cannot read the model's config.json ({e}).") from e
