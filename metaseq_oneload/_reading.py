"""Safe, lazy reading of torch checkpoint files.

Three ways in, from cheapest to dearest:

* :func:`read_header` unpickles a file onto the ``meta`` device: every tensor comes back
  with its dtype, shape and the byte offset of its storage in the file, and no tensor data
  is read. This is all that layout discovery needs, so inspecting a 2 GB shard costs about
  what a 2 MB one does.
* :class:`RangeReader` reads byte ranges straight into destination tensors with
  ``os.preadv``: torch's zip archives store every storage uncompressed at a known offset,
  so a rank can take exactly the bytes it needs, and nothing else lands in its memory.
* :func:`load_object` is a full ``torch.load(mmap=True)`` for the rare data that is not a
  plain tensor range (legacy-format files, optimizer state, metaseq's full state dicts).

Checkpoints are pickles, and a pickle can run code. Every path here unpickles with
``weights_only=True`` plus an explicit allowlist of the classes real metaseq/fairseq
checkpoints carry. Anything else is refused with :class:`UnsafeCheckpointError`, unless the
caller passes ``trust_pickle=True`` (unsafe: it runs whatever the file says).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import functools
import os
import pickle
import threading
import typing
import zipfile
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ._errors import CheckpointLayoutError, UnsafeCheckpointError

__all__ = [
    "safe_globals",
    "read_header",
    "load_object",
    "RangeReader",
    "storage_byte_offset",
    "range_readable",
]

_ZIP_MAGIC = b"PK\x03\x04"
# Pickle protocol 2 opcode followed by a LONG1 of 10 bytes: the magic number that
# torch's pre-1.6 ("legacy") serialization writes first.
_LEGACY_MAGIC = b"\x80\x02\x8a\n"


@functools.lru_cache(maxsize=None)
def safe_globals() -> tuple:
    """The classes and functions, beyond torch's own allowlist, that real metaseq, fairseq
    and fairscale checkpoints carry in their pickles."""
    allowed: list = [
        argparse.Namespace,  # cfg["model"] in metaseq, `args` in old fairseq checkpoints
        collections.OrderedDict,
        collections.defaultdict,
        typing.Any,  # omegaconf container metadata refers to it
        dict,
        list,
        int,
        float,
        str,
        bool,
    ]
    try:  # fairseq checkpoints written from a live DictConfig
        from omegaconf import DictConfig, ListConfig
        from omegaconf.base import ContainerMetadata, Metadata
        from omegaconf.nodes import AnyNode, BooleanNode, EnumNode, FloatNode, IntegerNode, StringNode

        allowed += [DictConfig, ListConfig, ContainerMetadata, Metadata, AnyNode, BooleanNode,
                    EnumNode, FloatNode, IntegerNode, StringNode]
        try:
            from omegaconf.nodes import BytesNode, PathNode

            allowed += [BytesNode, PathNode]
        except ImportError:  # omegaconf < 2.2
            pass
    except ImportError:
        pass
    try:  # numpy scalars and small arrays in meters / extra_state (e.g. best_loss)
        import numpy as np

        try:
            from numpy._core.multiarray import _reconstruct, scalar
        except ImportError:  # numpy < 2
            from numpy.core.multiarray import _reconstruct, scalar
        allowed += [np.ndarray, np.dtype, _reconstruct, scalar]
        dtypes = getattr(np, "dtypes", None)
        if dtypes is not None:
            allowed += [getattr(dtypes, n) for n in dir(dtypes) if n.endswith("DType")]
    except ImportError:
        pass
    return tuple(allowed)


_ALLOWLIST_LOCK = threading.RLock()
_ALLOWLIST_USERS = 0
_ALLOWLIST_ADDED: list = []


@contextlib.contextmanager
def _allowlisted():
    """Our allowlist on top of whatever the process already allows, while any load of ours
    runs. Only the entries we added are removed afterwards (torch's own ``safe_globals``
    context removes its entries on exit, also ones the user had added, e.g. metaseq's shim's
    ``argparse.Namespace``). Loads run outside the lock, so header reads stay concurrent."""
    global _ALLOWLIST_USERS, _ALLOWLIST_ADDED
    with _ALLOWLIST_LOCK:
        if _ALLOWLIST_USERS == 0:
            present = set(map(id, torch.serialization.get_safe_globals()))
            _ALLOWLIST_ADDED = [g for g in safe_globals() if id(g) not in present]
            torch.serialization.add_safe_globals(_ALLOWLIST_ADDED)
        _ALLOWLIST_USERS += 1
    try:
        yield
    finally:
        with _ALLOWLIST_LOCK:
            _ALLOWLIST_USERS -= 1
            if _ALLOWLIST_USERS == 0 and _ALLOWLIST_ADDED:
                ours = set(map(id, _ALLOWLIST_ADDED))
                keep = [g for g in torch.serialization.get_safe_globals() if id(g) not in ours]
                torch.serialization.clear_safe_globals()
                torch.serialization.add_safe_globals(keep)
                _ALLOWLIST_ADDED = []


def _describe_unsafe(path: str) -> str:
    try:
        with _allowlisted():
            names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # the scan is best effort; the refusal stands either way
        names = []
    return ", ".join(names) if names else "a class outside the allowlist"


def _file_kind(path: str) -> str:
    """'zip', 'legacy', or raise a CheckpointLayoutError naming what the file is instead."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as e:
        raise CheckpointLayoutError(f"{path}: cannot read the file ({e.strerror or e}).") from e
    if size == 0:
        raise CheckpointLayoutError(f"{path}: the file is empty (0 bytes); expected a torch checkpoint.")
    if head.startswith(_ZIP_MAGIC):
        if not zipfile.is_zipfile(path):
            raise CheckpointLayoutError(
                f"{path}: truncated or corrupted: it starts like a torch zip checkpoint but its zip "
                f"directory, which torch writes at the very end, is missing ({size} bytes on disk). "
                "Copy the file again from its source, or delete it and re-create the set."
            )
        return "zip"
    if head.startswith(_LEGACY_MAGIC):
        return "legacy"
    raise CheckpointLayoutError(
        f"{path}: not a torch checkpoint: it starts with {head!r}, expected a torch zip archive "
        f"('PK\\x03\\x04') or torch's legacy pickle format. Remove it from the checkpoint set."
    )


@functools.lru_cache(maxsize=4096)
def _zip_range_readable(key: tuple) -> Optional[str]:
    """None if every tensor record of the zip archive is stored uncompressed and little-
    endian (so its bytes can be read in place), else why not. torch.load reads both other
    cases fine, so such a file is read whole instead."""
    with zipfile.ZipFile(key[0]) as z:
        for info in z.infolist():
            if "/data/" in info.filename and info.compress_type != zipfile.ZIP_STORED:
                return f"record {info.filename} is compressed"
            if info.filename.endswith("/byteorder") and z.read(info.filename).strip() == b"big":
                return "tensors are stored big-endian"
    return None


def range_readable(path: str) -> bool:
    """(local) Whether tensors of this torch file can be read in place (see RangeReader)."""
    try:
        return _file_kind(path) == "zip" and _zip_range_readable(_stat_key(path)) is None
    except (OSError, zipfile.BadZipFile):
        return False


def _torch_load(path: str, *, trust_pickle: bool, **kwargs) -> Any:
    kind = _file_kind(path)
    if kind == "legacy":
        kwargs.pop("mmap", None)  # legacy files cannot be memory-mapped
    try:
        if trust_pickle:
            return torch.load(path, weights_only=False, **kwargs)
        with _allowlisted():
            return torch.load(path, weights_only=True, **kwargs)
    except pickle.UnpicklingError as e:
        if "weights only" in str(e).lower() or "weights_only" in str(e):
            raise UnsafeCheckpointError(
                f"{path}: refused to unpickle: the file needs {_describe_unsafe(path)}, which is "
                "not on the allowlist of classes that metaseq/fairseq checkpoints carry. Nothing "
                "from the file was executed. If you trust this file and its author, load it with "
                "trust_pickle=True (CLI: --trust-pickle); that runs whatever code the pickle holds."
            ) from None
        raise CheckpointLayoutError(f"{path}: the checkpoint's pickle is damaged ({e}).") from e
    except RuntimeError as e:
        msg = str(e)
        if "central directory" in msg or "zip archive" in msg or "PytorchStreamReader" in msg:
            raise CheckpointLayoutError(
                f"{path}: truncated or corrupted torch checkpoint ({msg.splitlines()[0]}). "
                "Copy the file again from its source."
            ) from None
        raise


def _stat_key(path: str) -> tuple:
    st = os.stat(path)
    return (os.path.realpath(path), st.st_size, st.st_mtime_ns, st.st_ino)


@functools.lru_cache(maxsize=4096)
def _cached_header(key: tuple, trust_pickle: bool) -> Any:
    return _torch_load(key[0], trust_pickle=trust_pickle, map_location="meta")


def read_header(path: str, *, trust_pickle: bool = False) -> Any:
    """(any rank, local) The file's pickled object with every tensor on ``meta``.

    Reads the pickle only, never tensor data; cached per (path, size, mtime). Each meta
    tensor's storage remembers where its bytes start (:func:`storage_byte_offset`).

    Raises:
        CheckpointLayoutError: the file is missing, empty, truncated or not a checkpoint.
        UnsafeCheckpointError: the pickle needs a class outside the allowlist.
    """
    try:
        key = _stat_key(path)
    except OSError as e:
        raise CheckpointLayoutError(f"{path}: cannot read the file ({e.strerror or e}).") from e
    return _cached_header(key, bool(trust_pickle))


def load_object(path: str, *, trust_pickle: bool = False, mmap: bool = True) -> Any:
    """(any rank, local) ``torch.load`` of the whole file onto CPU, memory-mapped where the
    format allows (pages are read only when touched), through the same allowlist."""
    # A compressed or big-endian zip cannot be memory-mapped; torch reads it whole.
    mmap = mmap and (_file_kind(path) != "zip" or range_readable(path))
    return _torch_load(path, trust_pickle=trust_pickle, map_location="cpu", mmap=mmap)


def storage_byte_offset(meta_tensor: torch.Tensor) -> Optional[int]:
    """Byte offset in its file of a tensor from :func:`read_header`, or None when torch
    could not tell (then the tensor is read through :func:`load_object`)."""
    base = getattr(meta_tensor.untyped_storage(), "_checkpoint_offset", None)
    if base is None:
        return None
    return int(base) + meta_tensor.storage_offset() * meta_tensor.element_size()


def _writable_buffer(t: torch.Tensor) -> memoryview:
    """A writable memoryview over a contiguous CPU tensor's bytes (any dtype, bf16 too)."""
    nbytes = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())).cast("B")


@dataclass(frozen=True)
class Extent:
    """A run of ``numel`` consecutive elements of one tensor stored in one file.

    ``key`` names the file tensor (dotted path in the pickle, e.g. ``model.flat_param_0``)
    and ``elem_offset`` where the run starts inside it; ``byte_offset`` is where it starts
    in the file (None where the file cannot be range-read, e.g. legacy format).
    """

    path: str
    key: str
    elem_offset: int
    numel: int
    byte_offset: Optional[int]


class RangeReader:
    """(any rank, local) Reads element ranges of stored tensors into destination tensors.

    Holds one open descriptor per file. Reads go straight into the destination's memory
    when it is a contiguous CPU tensor of the stored dtype; otherwise (another dtype, a
    CUDA destination) through a staging buffer of at most ``chunk_bytes``.
    """

    def __init__(self, *, chunk_bytes: int = 64 << 20, trust_pickle: bool = False):
        self.chunk_bytes = max(int(chunk_bytes), 1 << 16)
        self.trust_pickle = trust_pickle
        self.bytes_read = 0
        self._fds: dict[str, int] = {}
        self._objects: dict[str, Any] = {}
        self._lock = threading.Lock()

    def __enter__(self) -> "RangeReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._objects.clear()

    def _fd(self, path: str) -> int:
        fd = self._fds.get(path)
        if fd is None:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as e:
                raise CheckpointLayoutError(f"{path}: cannot open the file ({e.strerror or e}).") from e
            self._fds[path] = fd
        return fd

    def _pread(self, path: str, offset: int, out: torch.Tensor) -> None:
        view = _writable_buffer(out)
        fd = self._fd(path)
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], offset + done)
            if n <= 0:
                raise CheckpointLayoutError(
                    f"{path}: truncated: needed bytes {offset}..{offset + len(view)} but the file "
                    f"ends at {offset + done}. Copy the file again from its source."
                )
            done += n
        self.bytes_read += len(view)

    def _object_tensor(self, ext: Extent) -> torch.Tensor:
        if ext.path.endswith(".safetensors"):
            from safetensors import safe_open

            cached = self._objects.get((ext.path, ext.key))
            if cached is None:  # one tensor at a time: verify walks a tensor in chunks
                self._objects = {k: v for k, v in self._objects.items() if not isinstance(k, tuple)}
                with safe_open(ext.path, framework="pt") as handle:
                    cached = self._objects[(ext.path, ext.key)] = handle.get_tensor(ext.key).reshape(-1)
            return cached[ext.elem_offset: ext.elem_offset + ext.numel]
        obj = self._objects.get(ext.path)
        if obj is None:
            # Memory-mapped where the format allows; a legacy (pre-1.6) file cannot be, so it
            # is read whole and kept until close(): every part it holds is read from it
            # without loading it again (peak memory: the legacy files a load touches).
            obj = load_object(ext.path, trust_pickle=self.trust_pickle)
            self._objects[ext.path] = obj
        t = obj
        for part in ext.key.split("\x00"):
            t = t[part]
        return t.reshape(-1)[ext.elem_offset: ext.elem_offset + ext.numel]

    def read_extent(self, ext: Extent, start: int, out: torch.Tensor, dtype: torch.dtype) -> None:
        """Fill 1-D ``out`` with elements ``start .. start+len(out)`` of ``ext`` (stored as
        ``dtype``), converting dtype/device as needed."""
        n = out.numel()
        if n == 0:
            return
        if ext.byte_offset is None:
            out.copy_(self._object_tensor(ext)[start: start + n])
            return
        itemsize = torch.empty((), dtype=dtype).element_size()
        offset = ext.byte_offset + start * itemsize
        if out.device.type == "cpu" and out.dtype == dtype and out.is_contiguous():
            self._pread(ext.path, offset, out)
            return
        step = max(1, self.chunk_bytes // itemsize)
        staging = torch.empty(min(step, n), dtype=dtype,
                              pin_memory=out.device.type == "cuda" and torch.cuda.is_available())
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            buf = staging[: hi - lo]
            self._pread(ext.path, offset + lo * itemsize, buf)
            out[lo:hi].copy_(buf, non_blocking=False)

    def read_from_mmap(self, ext: Extent, start: int, n: int) -> torch.Tensor:
        """The same elements through ``torch.load(mmap=True)``: an independent path used by
        ``verify=True`` to check the byte arithmetic of :meth:`read_extent`."""
        return self._object_tensor(ext)[start: start + n]


def key_path(*parts: str) -> str:
    """Join the keys that lead to a tensor inside a checkpoint's pickle (see Extent.key)."""
    return "\x00".join(parts)

