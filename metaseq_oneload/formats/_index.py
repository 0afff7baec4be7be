"""A small index beside a checkpoint set, so that discovery need not unpickle every file.

Our writers (``convert``, ``consolidate``) leave ``<prefix>.oneload-index.json`` beside their
output, as safetensors' ``model.safetensors.index.json`` and DCP's ``.metadata`` do: the
whole :class:`~metaseq_oneload._layout.CheckpointLayout` (tensor -> file, key, element and
byte offsets, dtypes, shapes, flat parameters), the save identity, the model's
hyper-parameters, and per file its size and a digest of its pickle and its records. The
writers add the content digests they hashed while writing (``docs/digest.md``): each stored
tensor's (``parts[p].tensors[i].digest``, ``StoredTensor.digest`` once read) and, for a set of
one model part, the set's canonical ones (top-level ``content``: ``{"model", "tensors", "by"}``,
:func:`recorded_content`). The top-level ``digest`` is the index's own signature. A recorded
digest is a claim about the bytes, checked against them by a load with ``verify="digest"``.

The index is a hint, never an authority. Anyone who can write the folder can write an index,
and a plain hash of it anyone can recompute, so an index is used only when:

* it is signed (HMAC-SHA256 over every field) with this user's index key
  (``$METASEQ_ONELOAD_INDEX_KEY``, default ``~/.cache/metaseq_oneload/index-key``, created
  on the first write, mode 0600): an index written by someone else, or edited, is not used;
* every file it names is a plain name in the set's folder, whose real path stays there (no
  absolute path, no ``..``, no link out), and they are the files discovery finds there;
* every extent names one of those files and lies inside one stored tensor record of it, as
  the archive parser that reads the file finds its records, and its tensor's element count
  is the sum of its extents';
* each file has the recorded size, and its pickle bytes and record table (read from the zip
  directory and the pickle record, never unpickled) hash to what was recorded;
* no conversion's commit to these names was cut short (``_outputs.interrupted_commit``:
  that is an error, not a fallback).

Otherwise discovery reads the headers as it would without one, and says why in the layout's
warnings.
"""

from __future__ import annotations

import bisect
import hashlib
import hmac
import json
import math
import os
import secrets
import stat
import threading
from typing import Any, Mapping, Optional, Tuple

import torch

from .. import _storage
from .. import _outputs
from .._digest import parse_digest
from .._errors import CheckpointLayoutError, ConversionError, DigestError
from .._layout import CheckpointFile, CheckpointLayout, CheckpointSettings, FileName, FlatParam, ModelPart, StoredTensor
from .._reading import Extent
from .._zip import record_bytes, stat_key, zip_index
from .._settings import INDEX, from_env, variable

SUFFIX = ".oneload-index.json"
VERSION = 2  # 2: signed with the user's key over every field (1: a plain hash of some)
KEY_ENV = variable("index_key")
_KEY_BYTES = 32


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
    index = zip_index(stat_key(path))
    fd = os.open(path, os.O_RDONLY)
    try:
        pkl = index.records.get("data.pkl")
        if pkl is None:
            raise CheckpointLayoutError(f"{path}: the archive holds no data.pkl record.")
        digest = hashlib.sha256(record_bytes(fd, pkl, path)).hexdigest()
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


def to_json(layout: CheckpointLayout, *, save_id: Optional[str] = None, identities: bool = True,
            content: Optional[Mapping] = None) -> dict:
    """(local) The index of a layout; ``identities`` (what an index file records, for
    ``torch.save`` zip archives) costs one read of each file's directory and pickle bytes,
    and is left out of what ranks send each other (they compare size and mtime instead).
    Each tensor's stored digest (``StoredTensor.digest``) is recorded where it is known, and
    ``content`` (the set's canonical digests, ``{"model", "tensors", "by"}``) as given."""
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
                         "extents": [[rel(e.path), e.key, e.elem_offset, e.numel, e.byte_offset] for e in t.extents],
                         **({"digest": t.digest} if t.digest is not None else {})}
                        for t in p.tensors.values()],
        } for p in layout.parts],
        "warnings": list(layout.warnings),
        "notes": list(layout.notes),
        "stale_metadata": list(layout.stale_metadata),
        **({"content": dict(content)} if content else {}),
    }


def key_path() -> str:
    """Where this user's index key lives: ``$METASEQ_ONELOAD_INDEX_KEY``, else
    ``$XDG_CACHE_HOME/metaseq_oneload/index-key`` (``~/.cache`` by default)."""
    explicit = from_env(only=INDEX).index_key
    if explicit:
        return os.path.abspath(os.path.expanduser(explicit))
    cache = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "metaseq_oneload", "index-key")


_KEYS: dict = {}
_KEYS_LOCK = threading.Lock()
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)


def _read_key(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file")
        if st.st_mode & 0o022:
            raise ValueError(f"writable by others (mode {stat.S_IMODE(st.st_mode):o}); make it 0600")
        data = os.read(fd, 4097)
    finally:
        os.close(fd)
    if not _KEY_BYTES <= len(data) <= 4096:
        raise ValueError(f"{len(data)} bytes, expected {_KEY_BYTES} to 4096")
    return data


def _make_key(path: str) -> bytes:
    """A new random key, published at ``path`` all at once (a hard link of a complete file:
    two processes that create it together end up with one key)."""
    folder = os.path.dirname(path)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)
    try:
        try:
            os.write(fd, secrets.token_bytes(_KEY_BYTES))
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
    finally:
        os.unlink(tmp)
    return _read_key(path)


def _key(create: bool = False) -> Tuple[Optional[bytes], str]:
    """(local) (this user's index key, "") or (None, why there is none)."""
    path = key_path()
    with _KEYS_LOCK:
        if path in _KEYS:
            return _KEYS[path], ""
        try:
            try:
                key = _read_key(path)
            except FileNotFoundError:
                if not create:
                    return None, f"there is no index key at {path} (${KEY_ENV}) on this machine"
                key = _make_key(path)
        except (OSError, ValueError) as e:
            return None, f"the index key {path} (${KEY_ENV}) is unusable: {getattr(e, 'strerror', None) or e}"
        _KEYS[path] = key
        return key, ""


def _digest(d: Mapping, key: Optional[bytes] = None) -> Optional[str]:
    """HMAC-SHA256 with this user's key of every field of an index but the digest itself:
    an index someone else wrote or edited does not match. None without a key."""
    if key is None:
        key = _key()[0]
        if key is None:
            return None
    body = json.dumps({k: v for k, v in d.items() if k != "digest"}, sort_keys=True, separators=(",", ":"))
    return hmac.new(key, b"metaseq-oneload index\0" + body.encode(), hashlib.sha256).hexdigest()


def _plain_name(name: Any) -> bool:
    return (isinstance(name, str) and name not in ("", ".", "..") and "\0" not in name and os.sep not in name
            and not (os.altsep and os.altsep in name))


def _confinement_problem(d: Mapping, directory: str) -> Optional[str]:
    """Why the paths of an index leave the set's folder, or None."""
    real_dir = os.path.realpath(directory)
    names = set()
    for row in d["files"]:
        for f in row:
            name = f["name"]
            if not _plain_name(name):
                return f"names the file {name!r}, which is not a plain name in the set's folder"
            real = os.path.realpath(os.path.join(directory, name))
            if os.path.dirname(real) != real_dir:
                return f"names {name}, which leads out of the set's folder (to {real})"
            names.add(name)
    for p in d["parts"]:
        for t in p["tensors"]:
            for e in t["extents"]:
                if e[0] not in names:
                    return f"places tensor {t['name']} in {e[0]!r}, which is not one of the set's files"
    return None


def _extent_problem(d: Mapping, directory: str) -> Optional[str]:
    """Why an extent of an index is not inside one stored tensor record of its file (as the
    archive parser that reads the file finds its records), or None."""
    spans: dict = {}
    for row in d["files"]:
        for f in row:
            if f["format"] == "zip":
                index = zip_index(stat_key(os.path.join(directory, f["name"])))
                recs = sorted((r.data_offset, r.data_offset + r.size) for r in index.records.values()
                              if r.name.startswith("data/") and r.stored)
                spans[f["name"]] = ([a for a, _ in recs], [b for _, b in recs])
    itemsizes: dict = {}
    for p in d["parts"]:
        for t in p["tensors"]:
            itemsize = itemsizes.get(t["dtype"])
            if itemsize is None:
                itemsize = itemsizes[t["dtype"]] = torch.empty((), dtype=_dtype(t["dtype"])).element_size()
            total = 0
            for name, _key_, elem, numel, offset in t["extents"]:
                if not (isinstance(elem, int) and isinstance(numel, int) and elem >= 0 and numel >= 0):
                    return f"gives tensor {t['name']} an extent of {numel!r} elements at {elem!r}"
                total += numel
                if offset is None or name not in spans:
                    continue  # read through torch.load by its key, not by an offset
                starts, ends = spans[name]
                i = bisect.bisect_right(starts, offset) - 1 if isinstance(offset, int) else -1
                if i < 0 or offset + numel * itemsize > ends[i]:
                    return (f"places tensor {t['name']} at bytes {offset}..{offset + numel * itemsize} of {name}, "
                            "which do not lie inside one tensor record of the file")
            if total != math.prod(t["shape"]):
                return f"gives tensor {t['name']} of shape {t['shape']} extents of {total} elements"
    return None


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
            digest = t.get("digest")
            if digest is not None and not _is_digest(digest):
                raise ValueError(f"tensor {t['name']}: recorded digest {str(digest)[:80]!r} is not a digest")
            tensors[t["name"]] = StoredTensor(t["name"], int(p["index"]), _dtype(t["dtype"]), tuple(t["shape"]), extents,
                                              digest=digest)
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
        notes=tuple(d.get("notes", ())),  # (absent from indexes written before notes existed)
        stale_metadata=tuple(d["stale_metadata"]),
        trust_pickle=trust_pickle,
        config=d["model_args"],
        index=index_path(directory, d["prefix"]) if index else None,
    )


def write(layout: CheckpointLayout, *, save_id: Optional[str] = None, content: Optional[Mapping] = None) -> str:
    """(local) Write the index of a freshly written set beside it, signed with this user's
    key (created on first use), all at once (:func:`_outputs.replace_file`: an exclusively
    created temporary name, then a rename; nothing left behind on failure). The layout's
    stored digests and ``content`` (see :func:`to_json`) are recorded with it.

    Raises:
        ConversionError: no usable key, or the folder refused the file.
    """
    path = index_path(layout.directory, layout.prefix)
    key, why = _key(create=True)
    if key is None:
        raise ConversionError(f"{path}: not written: {why}. Loads read the headers instead; set ${KEY_ENV} to a "
                              "file path you can write to have indexes.")
    d = json.loads(json.dumps(to_json(layout, save_id=save_id, content=content)))  # what a reader parses, signed as such
    d["digest"] = _digest(d, key)
    _outputs.replace_file(path, json.dumps(d, separators=(",", ":")).encode(), what="index")
    return path


def load(directory: str, prefix: str, grid: list, *, trust_pickle: bool = False) -> Tuple[Optional[CheckpointLayout], str]:
    """(local) (layout, "") from the index beside a set when it agrees with the files, else
    (None, why not: "" where there is no index).

    Raises:
        CheckpointLayoutError: a conversion's commit to these names was cut short (the files
            mix two sets, whether or not there is an index).
    """
    path = index_path(directory, prefix)
    if _storage.is_url(path):  # remote sets: headers (ranged reads)
        return None, ""
    cut = _outputs.interrupted_commit(directory, prefix)
    if cut:
        raise CheckpointLayoutError(cut)
    if not os.path.lexists(path):
        return None, ""
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return None, f"{path}: not a regular file; read the headers instead."
            chunks, n = [], 0
            while n <= min(st.st_size, _MAX_INDEX):
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    break
                chunks.append(chunk)
                n += len(chunk)
            raw = b"".join(chunks)
        finally:
            os.close(fd)
        if len(raw) > _MAX_INDEX:
            return None, (f"{path}: larger than any index this package writes ({st.st_size} bytes); read the "
                          "headers instead.")
        d = json.loads(raw)
        if not isinstance(d, dict) or d.get("format") != "metaseq-oneload index" or d.get("version") != VERSION:
            return None, f"{path}: not an index of this version; read the headers instead."
        key, why = _key()
        if key is None:
            return None, f"{path}: not used: {why}; read the headers instead."
        if not isinstance(d.get("digest"), str) or not hmac.compare_digest(d["digest"], _digest(d, key)):
            return None, (f"{path}: not signed with this user's index key ({key_path()}): written by someone else or "
                          "edited since; read the headers instead.")
        problem = _confinement_problem(d, directory)
        if problem:
            return None, f"{path}: {problem}; read the headers instead."
        names = [[os.path.join(directory, f["name"]) for f in row] for row in d["files"]]
        if [[os.path.realpath(p) for p in row] for row in names] != [[os.path.realpath(p) for p in row] for row in grid]:
            return None, f"{path}: lists other files than the folder holds; read the headers instead."
        for row, paths in zip(d["files"], names):
            for f, p in zip(row, paths):
                have = file_identity(p)
                for key_ in ("size", "pickle_sha256", "records_sha256"):
                    if have[key_] != f[key_]:
                        what = "size" if key_ == "size" else "content"
                        return None, (f"{path}: stale ({os.path.basename(p)} changed {what} since the index was "
                                      "written); read the headers instead.")
        problem = _extent_problem(d, directory)
        if problem:
            return None, f"{path}: {problem}; read the headers instead."
        return from_json(d, directory, trust_pickle=trust_pickle), ""
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError, RecursionError,
            CheckpointLayoutError) as e:
        return None, f"{path}: unreadable ({type(e).__name__}: {e}); read the headers instead."


def _is_digest(value: Any) -> bool:
    try:
        parse_digest(value)
    except DigestError:
        return False
    return True


def recorded_content(layout: CheckpointLayout) -> Optional[dict]:
    """(local) The content digests (``{"model", "tensors", "by"}``) recorded in the index a
    layout was read from, or None (no index, none recorded, or the index no longer the one
    the layout was read from: unsigned, edited, or its stored digests differ). A claim of the
    writer, never checked here against the bytes."""
    if not layout.index:
        return None
    try:
        with open(layout.index, "rb", opener=lambda p, f: os.open(p, f | _NOFOLLOW)) as f:
            d = json.loads(f.read(_MAX_INDEX + 1))
        key = _key()[0]
        if key is None or not isinstance(d, dict) or not isinstance(d.get("digest"), str) or not hmac.compare_digest(
                d["digest"], _digest(d, key) or ""):
            return None
        stored = {(int(p["index"]), t["name"]): t.get("digest") for p in d["parts"] for t in p["tensors"]}
        if stored != {(t.part, t.name): t.digest for p in layout.parts for t in p.tensors.values()}:
            return None
        content = d.get("content")
        if not isinstance(content, dict) or not _is_digest(content.get("model")):
            return None
        tensors = content.get("tensors")
        if not isinstance(tensors, dict) or not all(isinstance(k, str) and _is_digest(v) for k, v in tensors.items()):
            return None
        return {"model": content["model"], "tensors": dict(tensors), "by": str(content.get("by", ""))}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


# An index of a million tensors is a few hundred MB: past this it is not one of ours.
_MAX_INDEX = 1 << 30
