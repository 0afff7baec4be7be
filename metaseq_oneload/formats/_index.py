"""A small index beside a checkpoint set, so that discovery need not unpickle every file.

Our writers (``convert``, ``consolidate``) leave ``<prefix>.oneload-index.json`` beside their
output, as safetensors' ``model.safetensors.index.json`` and DCP's ``.metadata`` do: the
whole :class:`~metaseq_oneload._layout.CheckpointLayout` (tensor -> file, key, element and
byte offsets, dtypes, shapes, flat parameters), the save identity, the model's
hyper-parameters, and per file its size and a digest of its pickle and its records.

Discovery uses an index only when it agrees with the files: the same file names, each of
the recorded size, whose pickle bytes and record table (read from the zip directory and
the pickle record, never unpickled) hash to what was recorded. Otherwise it reads the
headers as it would without one, and says so in the layout's warnings.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Mapping, Optional, Tuple

import torch

from .. import _storage
from .._errors import CheckpointLayoutError
from .._layout import CheckpointFile, CheckpointLayout, CheckpointSettings, FileName, FlatParam, ModelPart, StoredTensor
from .._reading import Extent, _record_bytes, _stat_key, _zip_index

SUFFIX = ".oneload-index.json"
VERSION = 1


def index_path(directory: str, prefix: str) -> str:
    return os.path.join(directory, prefix + SUFFIX)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def file_identity(path: str) -> dict:
    """(local) What an index records of one file, from its zip directory and the bytes of
    its pickle record (no unpickling): enough to tell a rewritten file from the one indexed."""
    index = _zip_index(_stat_key(path))
    fd = os.open(path, os.O_RDONLY)
    try:
        pkl = index.records.get("data.pkl")
        if pkl is None:
            raise CheckpointLayoutError(f"{path}: the archive holds no data.pkl record.")
        digest = hashlib.sha256(_record_bytes(fd, pkl, path)).hexdigest()
    finally:
        os.close(fd)
    table = sorted((r.name, r.data_offset, r.size, r.method) for r in index.records.values())
    return {"size": os.path.getsize(path), "pickle_sha256": digest,
            "records_sha256": hashlib.sha256(json.dumps(table).encode()).hexdigest()}


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def to_json(layout: CheckpointLayout, *, save_id: Optional[str] = None, identities: bool = True) -> dict:
    """(local) The index of a layout; ``identities`` (what an index file records, for
    ``torch.save`` zip archives) costs one read of each file's directory and pickle bytes,
    and is left out of what ranks send each other (they compare size and mtime instead)."""
    base = layout.directory
    rel = lambda p: os.path.relpath(p, base)  # noqa: E731  (a folder copied elsewhere keeps its index)
    model_args = {k: v for k, v in layout.model_args().items() if _jsonable(v)}

    def about(f: CheckpointFile) -> dict:
        if identities:
            return file_identity(f.path)
        return {"size": f.size, "mtime_ns": _storage.mtime_ns(f.path)}

    return {
        "format": "metaseq-oneload index",
        "version": VERSION,
        "prefix": layout.prefix,
        "name": {"prefix": layout.name.prefix, "part": layout.name.part, "shard": layout.name.shard,
                 "shard_style": layout.name.shard_style},
        "save_id": save_id,
        "num_updates": layout.num_updates,
        "flavor": layout.flavor,
        "metadata_key": layout.metadata_key,
        "cfg": {k: getattr(layout.cfg, k) for k in CheckpointSettings.__dataclass_fields__},
        "model_args": model_args,
        "files": [[{"name": rel(f.path), "format": f.format, **about(f)} for f in row] for row in layout.files],
        "aliases": list(layout.aliases),
        "parts": [{
            "index": p.index,
            "buffer_names": list(p.buffer_names),
            "shared": [list(s) for s in p.shared],
            "flat_params": [{"key": fp.key, "fsdp_path": fp.fsdp_path, "names": list(fp.names),
                             "shapes": [list(s) for s in fp.shapes], "numels": list(fp.numels),
                             "shard_numels": list(fp.shard_numels), "paddings": list(fp.paddings),
                             "dtype": _dtype_name(fp.dtype)} for fp in p.flat_params],
            "tensors": [{"name": t.name, "dtype": _dtype_name(t.dtype), "shape": list(t.shape),
                         "extents": [[rel(e.path), e.key, e.elem_offset, e.numel, e.byte_offset] for e in t.extents]}
                        for t in p.tensors.values()],
        } for p in layout.parts],
        "warnings": list(layout.warnings),
        "stale_metadata": list(layout.stale_metadata),
    }


def _digest(d: Mapping) -> str:
    """Of what an index says about where bytes are: a damaged or hand-edited index whose
    files still match is caught, not trusted."""
    body = {k: d[k] for k in ("prefix", "name", "metadata_key", "parts")}
    body["files"] = [[f["name"] for f in row] for row in d["files"]]
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def from_json(d: Mapping, directory: str, *, trust_pickle: bool = False, index: bool = True) -> CheckpointLayout:
    """The layout an index describes, its paths under ``directory`` (``index``: it was read
    from an index file there)."""
    at = lambda name: os.path.join(directory, name)  # noqa: E731
    n = d["name"]
    parts = []
    for p in d["parts"]:
        tensors = {}
        for t in p["tensors"]:
            extents = tuple(Extent(at(e[0]), e[1], int(e[2]), int(e[3]), None if e[4] is None else int(e[4]))
                            for e in t["extents"])
            tensors[t["name"]] = StoredTensor(t["name"], int(p["index"]), _dtype(t["dtype"]), tuple(t["shape"]), extents)
        flat = tuple(FlatParam(fp["key"], fp["fsdp_path"], tuple(fp["names"]), tuple(tuple(s) for s in fp["shapes"]),
                               tuple(fp["numels"]), tuple(fp["shard_numels"]), tuple(fp["paddings"]), _dtype(fp["dtype"]))
                     for fp in p["flat_params"])
        parts.append(ModelPart(int(p["index"]), tensors, flat, tuple(p["buffer_names"]),
                               tuple(tuple(s) for s in p["shared"])))
    files = tuple(tuple(CheckpointFile(at(f["name"]), m, s, int(f["size"]), f["format"]) for s, f in enumerate(row))
                  for m, row in enumerate(d["files"]))
    return CheckpointLayout(
        directory=directory,
        prefix=d["prefix"],
        name=FileName(n["prefix"], n["part"], n["shard"], n["shard_style"]),
        files=files,
        parts=tuple(parts),
        cfg=CheckpointSettings(**d["cfg"]),
        metadata_key=d["metadata_key"],
        aliases=tuple(d.get("aliases", ())),
        num_updates=d["num_updates"],
        flavor=d["flavor"],
        warnings=tuple(d["warnings"]),
        stale_metadata=tuple(d["stale_metadata"]),
        trust_pickle=trust_pickle,
        config=d["model_args"],
        index=index_path(directory, d["prefix"]) if index else None,
    )


def write(layout: CheckpointLayout, *, save_id: Optional[str] = None) -> str:
    """(local) Write the index of a freshly written set beside it (temp name, then rename)."""
    path = index_path(layout.directory, layout.prefix)
    tmp = f"{path}.tmp-{os.getpid()}"
    d = to_json(layout, save_id=save_id)
    d["digest"] = _digest(d)
    with open(tmp, "w") as f:
        json.dump(d, f, separators=(",", ":"))
    os.replace(tmp, path)
    return path


def load(directory: str, prefix: str, grid: list, *, trust_pickle: bool = False) -> Tuple[Optional[CheckpointLayout], str]:
    """(local) (layout, "") from the index beside a set when it agrees with the files, else
    (None, why not: "" where there is no index)."""
    path = index_path(directory, prefix)
    if _storage.is_url(path) or not os.path.exists(path):  # remote sets: headers (ranged reads)
        return None, ""
    try:
        with open(path) as f:
            d = json.load(f)
        if d.get("format") != "metaseq-oneload index" or d.get("version") != VERSION:
            return None, f"{path}: not an index of this version; read the headers instead."
        if d.get("digest") != _digest(d):
            return None, f"{path}: its contents do not match its digest (edited or damaged); read the headers instead."
        names = [[os.path.join(directory, f["name"]) for f in row] for row in d["files"]]
        if [[os.path.realpath(p) for p in row] for row in names] != [[os.path.realpath(p) for p in row] for row in grid]:
            return None, f"{path}: lists other files than the folder holds; read the headers instead."
        for row, paths in zip(d["files"], names):
            for f, p in zip(row, paths):
                have = file_identity(p)
                for key in ("size", "pickle_sha256", "records_sha256"):
                    if have[key] != f[key]:
                        what = "size" if key == "size" else "content"
                        return None, (f"{path}: stale ({os.path.basename(p)} changed {what} since the index was "
                                      "written); read the headers instead.")
        return from_json(d, directory, trust_pickle=trust_pickle), ""
    except (OSError, ValueError, KeyError, TypeError, CheckpointLayoutError) as e:
        return None, f"{path}: unreadable ({type(e).__name__}: {e}); read the headers instead."
