"""Safe, lazy reading of torch checkpoint files.

Three ways in, from cheapest to dearest:

* :func:`read_header` unpickles a file onto the ``meta`` device: every tensor comes back
  with its dtype, shape and the byte offset of its storage in the file, and no tensor data
  is read (one pass of the C unpickler, :mod:`._unpickle`; the optimizer state's tensors
  only once used). This is all that layout discovery needs, so inspecting a 2 GB shard
  costs about what a 2 MB one does.
* :class:`RangeReader` reads byte ranges straight into destination tensors with
  ``os.preadv``: torch's zip archives store every storage uncompressed in one record, whose
  place :func:`read_header` finds in the archive itself and checks against the pickle, so a
  rank can take exactly the bytes it needs, and nothing else lands in its memory. A read
  outside every storage record is refused, whatever computed it.
* :func:`load_object` is a full ``torch.load(mmap=True)`` for the rare data that is not a
  plain tensor range (legacy-format files, optimizer state, metaseq's full state dicts).

Checkpoints are pickles, and a pickle can run code. Every path here unpickles with
``weights_only=True`` plus an explicit allowlist of the classes real metaseq/fairseq
checkpoints carry. Anything else is refused with :class:`UnsafeCheckpointError`, unless the
caller passes ``trust_pickle=True`` (unsafe: it runs whatever the file says).
"""

from __future__ import annotations

import argparse
import bisect
import collections
import contextlib
import copy
import ctypes
import functools
import io
import os
import pickle
import struct
import threading
import typing
import warnings
import zipfile
import zlib
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch

from . import _storage
from . import _unpickle
from ._errors import CheckpointLayoutError, OneloadError, UnsafeCheckpointError, os_error_message

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


def _describe_unsafe(path: str, error: str = "") -> str:
    """What torch's weights_only loader refused in the file (``error``: its message), as the
    rest of the sentence "refused to unpickle: ..."."""
    if "Unsupported operand" in error:  # e.g. protocol 4's FRAME: no class involved at all
        proto = ""
        try:  # best effort: the PROTO opcode that starts the pickle of a local file
            if not _storage.is_url(path):
                with zipfile.ZipFile(path) as z:
                    head = z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))[:2]
                proto = f" (protocol {head[1]})" if head[:1] == b"\x80" else ""
        except Exception:  # noqa: BLE001 - the refusal stands either way
            pass
        return (f"the file uses pickle opcodes torch's weights_only loader cannot read{proto}; re-save it with "
                "torch.save's default protocol")
    try:
        with _allowlisted():
            names = torch.serialization.get_unsafe_globals_in_checkpoint(
                _storage.RemoteFile(path) if _storage.is_url(path) else path)
    except Exception:  # the scan is best effort; the refusal stands either way
        names = []
    if not names and "WeightsUnpickler error: " in error:  # allowlisted names, used in a way it refuses
        why = next((ln.strip() for ln in error.split("WeightsUnpickler error: ", 1)[1].splitlines() if ln.strip()), "")
        return f"the file asks torch's weights_only loader for what it refuses ({why})"
    return (f"the file needs {', '.join(names) if names else 'a class outside the allowlist'}, which is not on "
            "the allowlist of classes that metaseq/fairseq checkpoints carry")


def _file_kind(path: str) -> str:
    """'zip', 'legacy', or raise a CheckpointLayoutError naming what the file is instead."""
    try:
        if _storage.is_url(path):  # an object: its first bytes through the header cache
            src = _storage.RemoteFile(path)
            size, head = src.size, src.pread(8, 0)
        else:
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                head = f.read(8)
    except OSError as e:
        raise CheckpointLayoutError(os_error_message(e, path)) from e
    if size == 0:
        raise CheckpointLayoutError(f"{path}: the file is empty (0 bytes); expected a torch checkpoint.")
    if head.startswith(_ZIP_MAGIC):
        if not zipfile.is_zipfile(src if _storage.is_url(path) else path):
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
        f"('PK\\x03\\x04') or torch's legacy pickle format.{NOT_TORCH_IN_A_SET}"
    )


# The advice for a non-torch file among a set's files; one file named alone gets another
# (formats/_torchsave.py), since removing it would leave nothing.
NOT_TORCH_IN_A_SET = " Remove it from the checkpoint set."


# --------------------------------------------------------------------------- the archive
# Recent torch (2.13 here) does not read a storage's place in the file when it unpickles onto
# ``meta``: it computes it, assuming the archive was written by torch's own writer (miniz:
# records in key order, a 16- or 24-byte data descriptor after each, local headers padded to
# ``.storage_alignment`` with a fixed extra field). A valid zip written any other way (re-
# stored with Python's zipfile, ZIP64 forced, another tool) gets offsets that point into the
# wrong bytes, and no meta load checks a record's size. So every offset the engine reads is
# taken from the archive itself here, as ``torch.load`` finds it when it reads the data:
# central directory -> the record's *local* header -> its data, then checked against the
# pickle's own claims (record size == storage bytes, every tensor inside its storage).

_EOCD = struct.Struct("<4s4H2LH")  # end of central directory
_EOCD64_LOCATOR = struct.Struct("<4sLQL")
_EOCD64 = struct.Struct("<4sQ2H2L4Q")
_CENTRAL = struct.Struct("<4s4B4HL2L5H2L")
_LOCAL = struct.Struct("<4s2B4HL2L2H")
_U16, _U32 = 0xFFFF, 0xFFFFFFFF
# What miniz, torch's zip reader, can decompress; anything else torch.load cannot read.
_METHODS = {0: "stored", 8: "deflate"}
_METHOD_NAMES = {12: "bzip2", 14: "lzma", 93: "zstandard", 95: "xz", 99: "AES-encrypted"}


@dataclass(frozen=True)
class ZipRecord:
    """One member of a torch archive, located as a zip reader finds it (central directory
    entry, then the record's own local header, whose name and extra-field lengths may
    differ from the central directory's)."""

    name: str  # inside the archive's folder, e.g. "data/0"
    header_offset: int
    data_offset: int  # first byte of the (possibly compressed) data
    size: int  # bytes once uncompressed, per the central directory
    compressed_size: int
    method: int  # 0 stored, 8 deflate

    @property
    def stored(self) -> bool:
        return self.method == 0


@dataclass(frozen=True)
class ZipIndex:
    """The records of one torch archive that ``torch.load`` reads, by name."""

    path: str
    folder: str  # the archive's top folder: torch looks every record up under it
    records: Mapping[str, ZipRecord]
    byteorder: Optional[str]  # the "byteorder" record, None where absent (torch reads little)

    @property
    def why_not_range_readable(self) -> Optional[str]:
        """None when every storage record can be read in place, else why not."""
        for rec in self.records.values():
            if rec.name.startswith("data/") and not rec.stored:
                return f"record {self.folder}/{rec.name} is compressed ({_METHODS.get(rec.method)})"
        if self.byteorder == "big":
            return "tensors are stored big-endian"
        return None


def _bad_zip(path: str, what: str) -> CheckpointLayoutError:
    return CheckpointLayoutError(
        f"{path}: not a readable torch zip archive: {what}. Copy the file again from its source; if it "
        "was re-packed by a tool, re-create it with torch.save (or Python's zipfile, uncompressed).")


def _pread_exact(fd: int, offset: int, n: int, path: str, what: str) -> bytes:
    data = _storage.pread(fd, n, offset)  # fd: a descriptor, or an object store's RemoteFile
    if len(data) != n:
        raise _bad_zip(path, f"{what} at byte {offset} runs past the end of the file")
    return data


def _central_directory(fd: int, size: int, path: str) -> tuple:
    """(entries, start of the central directory): each entry (name, flags, method,
    compressed size, size, local header offset), ZIP64 fields resolved."""
    tail_len = min(size, _EOCD.size + _U16)
    tail = _pread_exact(fd, size - tail_len, tail_len, path, "the end of the archive")
    pos = tail.rfind(b"PK\x05\x06")
    while pos >= 0 and (len(tail) - pos < _EOCD.size
                        or pos + _EOCD.size + _EOCD.unpack_from(tail, pos)[-1] != len(tail)):
        pos = tail.rfind(b"PK\x05\x06", 0, pos)
    if pos < 0:
        raise _bad_zip(path, "no end-of-central-directory record at the end of the file (truncated?)")
    eocd_at = size - tail_len + pos
    _, disk, cd_disk, _, count, cd_size, cd_offset, _ = _EOCD.unpack_from(tail, pos)
    limit = eocd_at  # the central directory ends before this
    loc_at = eocd_at - _EOCD64_LOCATOR.size
    if loc_at >= 0:
        loc = _pread_exact(fd, loc_at, _EOCD64_LOCATOR.size, path, "the ZIP64 locator")
        if loc[:4] == b"PK\x06\x07":
            _, _, eocd64_at, _ = _EOCD64_LOCATOR.unpack(loc)
            rec = _pread_exact(fd, eocd64_at, _EOCD64.size, path, "the ZIP64 end record")
            if rec[:4] != b"PK\x06\x06":
                raise _bad_zip(path, f"the ZIP64 locator points at byte {eocd64_at}, which holds no ZIP64 end record")
            _, _, _, _, disk, cd_disk, _, count, cd_size, cd_offset = _EOCD64.unpack(rec)
            limit = eocd64_at
    if disk != 0 or cd_disk != 0:
        raise _bad_zip(path, "it is a multi-volume (split) archive")
    if cd_offset + cd_size > limit:
        raise _bad_zip(path, f"its central directory (bytes {cd_offset}..{cd_offset + cd_size}) "
                             "overlaps its end record")
    cd = _pread_exact(fd, cd_offset, cd_size, path, "the central directory")
    entries, p = [], 0
    for _ in range(count):
        if p + _CENTRAL.size > len(cd) or cd[p:p + 4] != b"PK\x01\x02":
            raise _bad_zip(path, f"central directory entry at byte {cd_offset + p} is damaged")
        (_, _, _, _, _, flags, method, _, _, _, csize, usize, nlen, xlen, clen, _, _, _,
         hoff) = _CENTRAL.unpack_from(cd, p)
        raw = cd[p + _CENTRAL.size: p + _CENTRAL.size + nlen]
        extra = cd[p + _CENTRAL.size + nlen: p + _CENTRAL.size + nlen + xlen]
        p += _CENTRAL.size + nlen + xlen + clen
        if _U32 in (usize, csize, hoff):  # the real values are in the ZIP64 extra field, in this order
            x = 0
            while x + 4 <= len(extra):
                tag, ln = struct.unpack_from("<HH", extra, x)
                if tag == 1:
                    vals = list(struct.unpack_from(f"<{ln // 8}Q", extra, x + 4))
                    if usize == _U32 and vals:
                        usize = vals.pop(0)
                    if csize == _U32 and vals:
                        csize = vals.pop(0)
                    if hoff == _U32 and vals:
                        hoff = vals.pop(0)
                    break
                x += 4 + ln
        name = raw.decode("utf-8" if flags & 0x800 else "cp437", errors="replace")
        _check_sizes(path, name, method, csize, usize, hoff, size)
        entries.append((name, flags, method, csize, usize, hoff))
    return entries, cd_offset


# deflate's densest code (a 258-byte match in about 2 bits) bounds what a stream can inflate to
_DEFLATE_RATIO = 1032
_DEFLATE_SLACK = 1 << 10
# A record read into memory whole (the pickle, byteorder: every record but the storages
# under data/) inflates to at most max(64 MiB, 64 x its compressed bytes): torch.save's
# pickles are at most tens of MB (11 MB for 40,000 optimizer entries) and deflate 3-10:1,
# where 1 GiB of zeros after a pickle's STOP deflates 1032:1 into a 1 MB file.
_INFLATED_CAP = 64 << 20
_INFLATED_RATIO = 64


def _check_sizes(path: str, name: str, method: int, csize: int, usize: int, hoff: int, size: int) -> None:
    """Refuse a directory entry whose sizes torch's zip reader (miniz) refuses when it opens
    the archive, whichever record it is: every later read of a record is sized by these
    numbers, so an entry that disagrees with itself would have us read another record's
    bytes (a stored record read for its uncompressed size runs into the next one)."""
    if method == 0 and csize != usize:
        raise _bad_zip(path, f"record {name} is stored uncompressed, yet its directory entry gives {csize} bytes "
                             f"in the file and {usize} once read; torch.load refuses the archive too ('invalid "
                             "header or archive is corrupted')")
    if usize and not csize:
        raise _bad_zip(path, f"record {name} claims {usize} bytes from 0 bytes in the file; torch.load refuses "
                             "the archive too ('invalid header or archive is corrupted')")
    if hoff + _LOCAL.size + csize > size:
        raise _bad_zip(path, f"record {name} ({csize} bytes from byte {hoff}) runs past the end of the file "
                             f"({size} bytes); torch.load refuses the archive too")


def _parse_zip(path: str) -> ZipIndex:
    """The archive's records as a zip reader (and so torch.load) reads them; raises
    CheckpointLayoutError on anything torch could not read or could read two ways."""
    fd = _storage.open_ro(path)
    try:
        size = _storage.fsize(fd)
        entries, cd_offset = _central_directory(fd, size, path)
        if not entries:
            raise _bad_zip(path, "the archive holds no records")
        if not isinstance(fd, int):  # an object: every local header in one concurrent batch
            fd.prefetch([(e[5], _LOCAL.size + 1024) for e in entries])
        # torch looks every record up under the folder of the archive's first entry.
        folder = entries[0][0].split("/", 1)[0]
        prefix = folder + "/"
        records: dict = {}
        for name, flags, method, csize, usize, hoff in entries:
            if not name.startswith(prefix):
                continue
            short = name[len(prefix):]
            if short in records:
                raise CheckpointLayoutError(
                    f"{path}: the archive holds two records named {name}; which one a reader takes is "
                    "undefined. Re-create the file with torch.save.")
            if flags & 0x1:
                raise CheckpointLayoutError(f"{path}: record {name} is encrypted; torch cannot read it.")
            if method not in _METHODS:
                raise CheckpointLayoutError(
                    f"{path}: record {name} is compressed with zip method {method} "
                    f"({_METHOD_NAMES.get(method, 'unknown')}), which torch.load cannot read either. "
                    "Re-store the archive uncompressed (zip -0, or Python zipfile with ZIP_STORED).")
            if method == 8 and usize > csize * _DEFLATE_RATIO + _DEFLATE_SLACK:
                # before anything is allocated: torch's reader allocates the declared size, then
                # inflates into it (and hands back what it did not fill where the stream stops)
                raise _bad_zip(path, f"record {name} claims to inflate to {usize} bytes from {csize} compressed "
                                     f"bytes, more than deflate can produce ({_DEFLATE_RATIO}:1)")
            cap = max(_INFLATED_CAP, _INFLATED_RATIO * csize)
            if method == 8 and not short.startswith("data/") and usize > cap:
                # read into memory whole (by torch's reader too): refused before anything is inflated
                raise _bad_zip(path, f"record {name} declares {usize} bytes once inflated, from {csize} compressed "
                                     f"bytes; a record read whole into memory (the pickle) may declare at most "
                                     f"{cap} (64 MiB, or {_INFLATED_RATIO} times its compressed size): torch.save's "
                                     "pickles are at most tens of MB and deflate a few times, so this one was "
                                     "padded or crafted")
            local = _pread_exact(fd, hoff, _LOCAL.size, path, f"the local header of {name}")
            if local[:4] != b"PK\x03\x04":
                raise _bad_zip(path, f"the central directory places {name} at byte {hoff}, "
                                     "which holds no local file header")
            lnlen, lxlen = _LOCAL.unpack(local)[-2:]
            data = hoff + _LOCAL.size + lnlen + lxlen
            if data + csize > cd_offset:
                raise _bad_zip(path, f"record {name} (bytes {data}..{data + csize}) runs into the central "
                                     f"directory at byte {cd_offset}")
            records[short] = ZipRecord(short, hoff, data, usize, csize, method)
        # Records must not share bytes: one record's data read as another's is the failure
        # this whole check exists to prevent.
        spans = sorted(records.values(), key=lambda r: r.header_offset)
        for a, b in zip(spans, spans[1:]):
            if a.data_offset + a.compressed_size > b.header_offset:
                raise _bad_zip(path, f"records {prefix}{a.name} and {prefix}{b.name} overlap")
        byteorder = None
        if "byteorder" in records:
            byteorder = _record_bytes(fd, records["byteorder"], path, folder).decode("ascii", "replace").strip()
        return ZipIndex(path, folder, records, byteorder)
    finally:
        _storage.close(fd)


def _record_bytes(fd: int, rec: ZipRecord, path: str, folder: str = "") -> "bytes | bytearray":
    """(local) A small record's bytes (the pickle, byteorder), never more than its directory
    entry declares: a stream that would inflate past it stops there and is refused. A
    deflated record comes back as the bytearray it was inflated into (declared sizes capped
    in :func:`_parse_zip`); read it through :func:`._unpickle.stream`, which copies nothing."""
    label = f"{folder}/{rec.name}" if folder else rec.name
    if rec.method == 8:
        return _inflate_exact(fd, rec, path, keep=True, label=label)
    raw = _pread_exact(fd, rec.data_offset, rec.compressed_size, path, f"record {label}")
    if len(raw) != rec.size:
        raise _bad_zip(path, f"record {label} holds {len(raw)} bytes, its directory entry says {rec.size}")
    return raw


_INFLATE_STEP = 4 << 20


def _inflate_exact(fd: int, rec: ZipRecord, path: str, *, keep: bool, label: str = "") -> Optional[bytearray]:
    """(local) Inflate a deflated record, refusing a stream that does not end exactly at the
    record's declared size within its compressed bytes. Memory: when ``keep``, one buffer of
    the declared size that the stream is inflated into (no second copy), else a few MiB.

    torch's reader inflates into a buffer of the declared size and, where the stream stops
    early or runs on, hands back that buffer without a word: its unfilled bytes are whatever
    the allocator left there. So a record is inflated here, and checked, before torch reads it.
    """
    label = label or rec.name
    d = zlib.decompressobj(-15)
    out = bytearray(rec.size) if keep else None
    done, pos, end = 0, rec.data_offset, rec.data_offset + rec.compressed_size
    pending = b""
    try:
        while not d.eof and done <= rec.size:
            if not pending:
                if pos >= end:
                    break
                n = min(_INFLATE_STEP, end - pos)
                pending = _pread_exact(fd, pos, n, path, f"record {label}")
                pos += n
            # max_length: one call never produces more than a step, nor more than one byte
            # past the declared size (enough to see a stream that goes on)
            piece = d.decompress(pending, min(_INFLATE_STEP, rec.size + 1 - done))
            pending = d.unconsumed_tail
            if keep and done + len(piece) <= rec.size:
                out[done:done + len(piece)] = piece
            done += len(piece)
    except zlib.error as e:
        raise _bad_zip(path, f"record {label} does not inflate ({e})") from None
    if done > rec.size:
        raise _bad_zip(path, f"record {label} inflates to more than the {rec.size} bytes its directory entry "
                             "declares (inflating stopped there)")
    if not d.eof:
        raise _bad_zip(path, f"record {label}'s compressed stream ends after {done} of its {rec.size} bytes "
                             f"(its {rec.compressed_size} compressed bytes hold no end of stream)")
    if done != rec.size:
        raise _bad_zip(path, f"record {label} holds {done} bytes, its directory entry says {rec.size}")
    return out


@functools.lru_cache(maxsize=256)
def _check_deflated(key: tuple) -> None:
    """(local) Every deflated record of a zip inflates to exactly its declared size: checked
    once per file version before ``torch.load`` reads it whole (see :func:`_inflate_exact`)."""
    path = key[0]
    index = _zip_index(key)
    records = [r for r in index.records.values() if r.method == 8]
    if not records:
        return
    fd = _storage.open_ro(path)
    try:
        for rec in records:
            _inflate_exact(fd, rec, path, keep=False, label=f"{index.folder}/{rec.name}")
    finally:
        _storage.close(fd)


@functools.lru_cache(maxsize=4096)
def _zip_index(key: tuple) -> ZipIndex:
    try:
        return _parse_zip(key[0])
    except OSError as e:
        raise CheckpointLayoutError(os_error_message(e, key[0])) from e


# --------------------------------------------------------------------------- the pickle's storages
@dataclass(frozen=True)
class _StorageRef:
    """One storage the pickle refers to (torch's persistent id), in first-use order."""

    key: str
    dtype: torch.dtype
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)


@functools.lru_cache(maxsize=None)
def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _storage_dtype(global_name: Any) -> Optional[torch.dtype]:
    if not (isinstance(global_name, tuple) and len(global_name) == 2):
        return None
    return _storage_class_dtype(*global_name)


@functools.lru_cache(maxsize=None)
def _storage_class_dtype(module: str, name: str) -> Optional[torch.dtype]:
    """torch.FloatStorage -> torch.float32, torch.storage.UntypedStorage -> torch.uint8: the
    classes torch.save names in a persistent id (bytes of dtypes without a typed class, e.g.
    float8 or uint16, are saved untyped)."""
    if module not in ("torch", "torch.storage") or not name.endswith("Storage"):
        return None
    with warnings.catch_warnings():  # the typed storage classes are deprecated, not their names
        warnings.simplefilter("ignore")
        cls = getattr(torch if module == "torch" else torch.storage, name, None)
        if cls is torch.UntypedStorage:
            return torch.uint8
        dtype = getattr(cls, "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else None


class _Stub:
    """Stands in for every object a pickle builds while its storage references are listed:
    takes any arguments and state, does nothing."""

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        pass

    def __setitem__(self, key, value):
        pass

    def append(self, value):
        pass

    def extend(self, values):
        pass

    def add(self, value):
        pass


@functools.lru_cache(maxsize=None)
def _stub_class(module: str, name: str) -> type:
    return type(name, (_Stub,), {"global_name": (module, name)})


class _StorageRefScanner(pickle.Unpickler):
    """Replays a pickle with a stub for every global it names (nothing is imported, nothing
    of the file's runs) to see its persistent ids, in the order torch's loader meets them."""

    def __init__(self, data: bytes):
        super().__init__(_unpickle.stream(data))
        self.pids: list = []

    def find_class(self, module, name):
        return _stub_class(module, name)

    def persistent_load(self, pid):
        self.pids.append(pid)
        return _Stub()


class _DictMemoScanner(pickle._Unpickler):
    """The same replay in pickle's Python unpickler, whose memo is a dict (as torch's
    loader's is): a memo index far past the memo costs one entry, where the C unpickler
    grows an array to twice the index and clears it (LONG_BINPUT 2**27 in a 1 KB file: 2 GiB
    written). About as slow as torch's loader, so only for pickles the C one cannot take."""

    find_class = _StorageRefScanner.find_class
    persistent_load = _StorageRefScanner.persistent_load

    def __init__(self, data: bytes):
        super().__init__(_unpickle.stream(data))
        self.pids: list = []


def _storage_refs(data: bytes, path: str) -> list:
    """(local) The storages a torch pickle refers to, each once, in first-use order."""
    try:
        # torch.save's pickles (only opcodes torch's loader reads, memo indices within the
        # pickle's length: a memo of at most 16 bytes per pickle byte) go through the C one
        scan = _StorageRefScanner if _unpickle._torch_opcodes_only(data) else _DictMemoScanner
        scanner = scan(data)
        scanner.load()
    except Exception as e:  # noqa: BLE001 - whatever a stub could not stand in for
        raise CheckpointLayoutError(
            f"{path}: cannot list the tensor storages its pickle refers to ({type(e).__name__}: {e}); the "
            "pickle is not one torch.save writes. Re-save the checkpoint with torch.save.") from None
    refs: dict = {}
    for pid in scanner.pids:
        ok = isinstance(pid, tuple) and len(pid) == 5 and pid[0] in ("storage", b"storage")
        dtype = _storage_dtype(getattr(pid[1], "global_name", None)) if ok else None
        if dtype is None or not isinstance(pid[4], int):
            raise CheckpointLayoutError(
                f"{path}: its pickle refers to {pid!r}, which is not a storage torch.save writes "
                "('storage', <dtype>Storage, key, location, elements). Re-save the checkpoint with torch.save.")
        key = f"{pid[2]}"  # torch reads record data/{key}
        ref = _StorageRef(key, dtype, pid[4])
        if refs.setdefault(key, ref) != ref:
            raise CheckpointLayoutError(
                f"{path}: its pickle refers to storage {key} as {refs[key].numel} {refs[key].dtype} elements "
                f"and as {ref.numel} {ref.dtype}; the file was edited. Re-save it with torch.save.")
    return list(refs.values())


# --------------------------------------------------------------------------- the header's tensors
_WALKED = (dict, list, tuple, argparse.Namespace, torch.Tensor, torch.UntypedStorage, torch.TypedStorage, set)


def _key_height(k: Any, file: str, path: tuple, depth: int) -> int:
    """How deep a dict key or set element nests (tuples in tuples), bounded like values."""
    if type(k) is not tuple:
        return 0
    if depth > _unpickle.MAX_DEPTH:
        raise _unpickle.too_deep_error(file, list(path))
    return 1 + max((_key_height(v, file, path, depth + 1) for v in k), default=0)


def _walk_tensors(obj: Any, file: str = "the checkpoint", path: tuple = (), seen: Optional[set] = None,
                  depth: int = 1, heights: Optional[dict] = None):
    """(local) (dotted name, tensor or storage) for every tensor in dicts, lists, tuples and
    Namespaces (an omegaconf container holds no tensors, and iterating one resolves
    interpolations). Each container is entered once however often it is shared; past
    ``_unpickle.MAX_DEPTH`` levels of nesting (counting the levels a shared container holds
    wherever it is met again) it raises CheckpointLayoutError naming ``file``."""
    if seen is None:
        seen, heights = set(), {}
    if isinstance(obj, torch.Tensor):
        if obj.layout == torch.strided:  # sparse tensors are read whole, like legacy files
            yield ".".join(path), obj
        return
    if isinstance(obj, (torch.UntypedStorage, torch.TypedStorage)):
        yield ".".join(path), obj
        return
    if isinstance(obj, (dict, list, tuple, argparse.Namespace, set)):
        if id(obj) in seen:
            h = heights.get(id(obj))  # None while it is walked: a cycle
            if h is not None and depth + h - 1 > _unpickle.MAX_DEPTH:
                raise _unpickle.too_deep_error(file, list(path))
            return
        if depth > _unpickle.MAX_DEPTH:
            raise _unpickle.too_deep_error(file, list(path))
        seen.add(id(obj))
        sub = 0
        if isinstance(obj, set):  # not searched for tensors (as before); its elements nest
            sub = max((_key_height(k, file, path, depth + 1) for k in obj), default=0)
        else:
            if isinstance(obj, dict) and not all(type(k) is str for k in obj):
                sub = max((_key_height(k, file, path, depth + 1) for k in obj), default=0)
            items = (vars(obj).items() if isinstance(obj, argparse.Namespace)
                     else obj.items() if isinstance(obj, dict) else enumerate(obj))
            for k, v in items:
                if isinstance(v, _WALKED):
                    yield from _walk_tensors(v, file, path + (str(k),), seen, depth + 1, heights)
                    sub = max(sub, heights.get(id(v), 0))
        if depth + sub > _unpickle.MAX_DEPTH:
            raise _unpickle.too_deep_error(file, list(path))
        heights[id(obj)] = 1 + sub


# Where a checkpoint may keep an OmegaConf config: its top-level ``cfg`` and ``args``, read
# raw everywhere (``_layout.raw_get``). Anywhere else every ``.get``, ``in``, ``.values()``
# on a DictConfig resolves the interpolations the file chose, and the tensor walk does not
# enter one.
_CONFIG_KEYS = ("cfg", "args")


def _omegaconf_node() -> Optional[type]:
    try:
        from omegaconf.base import Node
    except ImportError:  # without omegaconf no pickle can rebuild one
        return None
    return Node


def _where(chain: Any) -> str:
    keys: list = []
    while chain is not None:
        chain, k = chain
        keys.append(str(k))
    return ".".join(reversed(keys))


def _check_configs(path: str, obj: Any) -> None:
    """(local) Refuse an OmegaConf container or node anywhere in a header but under the
    top-level ``cfg``/``args`` (a top-level DictConfig, a DictConfig state dict or
    ``extra_state``, one deep in a list), and a tensor or storage inside an OmegaConf
    container anywhere. Walked without resolving (each node's own stored value), each object
    once per context, iteratively (no recursion, nothing copied per level)."""
    node_type = _omegaconf_node()
    if node_type is None:
        return
    if isinstance(obj, node_type):
        raise CheckpointLayoutError(
            f"{path}: its top level is an OmegaConf {type(obj).__name__}; expected a dict (a training "
            "checkpoint's 'model', 'cfg', 'extra_state', ... or a state dict of tensors), as torch.save writes "
            "one. Reading an OmegaConf container resolves the interpolations (${...}) the file chose, which can "
            "run code, so nothing of it was used. If you trust the file, torch.load(path, weights_only=False) "
            "reads it: re-save it as a plain dict (OmegaConf.to_container(..., resolve=False)).")
    seen: set = set()
    # (object, key chain, under cfg/args, inside an OmegaConf container)
    stack: list = []
    if isinstance(obj, dict):
        stack += [(v, (None, k), isinstance(k, str) and k in _CONFIG_KEYS, False) for k, v in obj.items()]
        stack += [(k, (None, "<key>"), False, False) for k in obj if not isinstance(k, (str, int))]
    else:
        stack.append((obj, None, False, False))
    while stack:
        x, chain, in_cfg, in_oc = stack.pop()
        if x is None or isinstance(x, (str, bytes, int, float, bool)):
            continue
        if isinstance(x, (torch.Tensor, torch.UntypedStorage, torch.TypedStorage)):
            if in_oc:
                raise CheckpointLayoutError(
                    f"{path}: {_where(chain)}: a tensor inside an OmegaConf config; a config holds settings, "
                    "not tensors, and a tensor there is never checked against the file's records. The file was "
                    "crafted or built wrongly: re-save it with the tensor outside the config (torch.load(path, "
                    "weights_only=False) reads it, if you trust the file).")
            continue
        state = (id(x), in_cfg, in_oc)
        if state in seen:
            continue
        seen.add(state)
        if isinstance(x, node_type):
            if not in_cfg:
                raise CheckpointLayoutError(
                    f"{path}: the value at {_where(chain)} is an OmegaConf {type(x).__name__}; expected a dict, "
                    "list or tensor, as torch.save writes a training checkpoint: only the top-level 'cfg' and "
                    "'args' may be OmegaConf configs (they are read raw). Reading this one resolves the "
                    "interpolations (${...}) the file chose, which can run code, so nothing of it was used. If "
                    "you trust the file, torch.load(path, weights_only=False) reads it: re-save that entry as a "
                    "plain dict or list (OmegaConf.to_container(..., resolve=False)).")
            raw = vars(x)  # the node's own fields: never a property, never resolved
            content = raw.get("_content", raw.get("_val"))
            if isinstance(content, dict):
                stack += [(v, (chain, k), in_cfg, True) for k, v in content.items()]
            elif isinstance(content, (list, tuple)):
                stack += [(v, (chain, i), in_cfg, True) for i, v in enumerate(content)]
            elif content is not None and not isinstance(content, str):
                stack.append((content, chain, in_cfg, True))
            continue
        if isinstance(x, dict):
            stack += [(v, (chain, k), in_cfg, in_oc) for k, v in x.items()]
            stack += [(k, (chain, "<key>"), in_cfg, in_oc) for k in x if not isinstance(k, (str, int))]
        elif isinstance(x, (list, tuple, set, frozenset)):
            stack += [(v, (chain, i), in_cfg, in_oc) for i, v in enumerate(x)]
        elif isinstance(x, argparse.Namespace):
            stack += [(v, (chain, k), in_cfg, in_oc) for k, v in vars(x).items()]


def _untyped(x: Any) -> torch.UntypedStorage:
    if isinstance(x, torch.Tensor):
        return x.untyped_storage()
    if isinstance(x, torch.TypedStorage):
        return x._untyped_storage
    return x


def _storage_keys(found: list, refs: list, index: ZipIndex) -> Optional[dict]:
    """id(untyped storage) -> the key of its record, or None where the header cannot tell.

    torch marks each meta storage with ``_checkpoint_offset`` only: the record's true data
    offset (older torch, or a file without ``.format_version``), or one computed in
    first-use order, strictly increasing (recent torch, 2.13 here). Both readings are tried;
    one is used only when it is consistent (every storage matched, sizes agree) and the
    other, if also consistent, agrees with it.
    """
    by_offset: dict = {}
    for _, t in found:
        s = _untyped(t)
        off = getattr(s, "_checkpoint_offset", None)
        if off is None:
            return None
        by_offset.setdefault(int(off), []).append(s)
    nbytes = {ref.key: ref.nbytes for ref in refs}

    def consistent(mapping: dict) -> bool:
        # >=: a meta storage grows to fit a tensor that reaches past it (meta storages are
        # resizable), which the bounds check then reports against the declared size.
        return all(key in nbytes and all(s.nbytes() >= nbytes[key] for s in by_offset[off])
                   for off, key in mapping.items())

    data_at = {rec.data_offset: rec.name[len("data/"):] for rec in index.records.values()
               if rec.name.startswith("data/")}
    true = {off: data_at[off] for off in by_offset if off in data_at}
    true = true if len(true) == len(by_offset) and consistent(true) else None
    ranked = None
    if len(by_offset) == len(refs):
        ranked = dict(zip(sorted(by_offset), (ref.key for ref in refs)))
        first = index.records.get("data/" + refs[0].key) if refs else None
        if not consistent(ranked) or (first is not None and min(by_offset) != first.data_offset):
            ranked = None
    mapping = true if ranked is None else ranked if true is None else (true if true == ranked else None)
    if mapping is None:
        return None
    return {id(s): key for off, key in mapping.items() for s in by_offset[off]}


def _fmt_shape(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)} stride {tuple(t.stride())} at storage offset {t.storage_offset()}"


def _check_bounds(path: str, found: list, declared: Optional[dict] = None) -> None:
    """Every tensor lies inside its storage (torch.load refuses otherwise: 'Trying to
    resize storage that is not resizable'); checked on meta, before anything is allocated.

    ``declared`` maps id(untyped storage) to the bytes the pickle declares for it: a meta
    storage silently grows to fit whatever tensor is built on it, so its own size proves
    nothing once a tensor reached past it.
    """
    for name, t in found:
        if not isinstance(t, torch.Tensor) or t.numel() == 0:
            continue
        if any(st < 0 for st in t.stride()) or t.storage_offset() < 0:
            raise CheckpointLayoutError(f"{path}: tensor {name}: {_fmt_shape(t)}: negative strides or offsets "
                                        "cannot come from torch.save. The file's header was edited or is damaged.")
        last = t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
        s = t.untyped_storage()
        nbytes = s.nbytes() if declared is None else declared.get(id(s), s.nbytes())
        have = nbytes // t.element_size()
        if last >= have:
            raise CheckpointLayoutError(
                f"{path}: tensor {name}: {_fmt_shape(t)} reaches element {last + 1} of a storage of "
                f"{have} {str(t.dtype).replace('torch.', '')} elements; torch.load refuses this file too "
                "('Trying to resize storage that is not resizable'). The file's header was edited or is "
                "damaged: copy it again from its source.")


def _check_zip(path: str, obj: Any, index: ZipIndex, data_pkl: bytes) -> None:
    """Check every storage the pickle names against its record and attach the verified data
    offsets that :func:`storage_byte_offset` returns."""
    refs = _storage_refs(data_pkl, path)
    found = list(_walk_tensors(obj, path))
    # A tensor torch.save wrote without data (a meta tensor: torch._utils.
    # _rebuild_meta_tensor_no_storage) has no record: torch's meta load gives every storage it
    # read from a record its place, and gives these none. They are marked, so that a load
    # never allocates what they declare (they hold nothing to load), and set aside.
    placed = [getattr(_untyped(t), "_checkpoint_offset", None) is not None for _, t in found]
    if any(placed) or (found and not refs):
        for (_, t), p in zip(found, placed):
            if not p:
                _untyped(t)._oneload_storageless = True
        found = [nt for nt, p in zip(found, placed) if p]
    keys = _storage_keys(found, refs, index)
    named: dict = {}
    if keys is not None:
        for name, t in found:
            named.setdefault(keys[id(_untyped(t))], name)
    for ref in refs:
        what = f"tensor {named[ref.key]}" if ref.key in named else f"a tensor stored as {index.folder}/data/{ref.key}"
        rec = index.records.get("data/" + ref.key)
        if rec is None:
            raise CheckpointLayoutError(
                f"{path}: {what}: the pickle refers to record {index.folder}/data/{ref.key}, which the archive "
                "does not hold. The file is incomplete or was re-packed wrongly: copy it again from its source.")
        if rec.size != ref.nbytes:
            raise CheckpointLayoutError(
                f"{path}: {what}: its storage record {index.folder}/data/{ref.key} holds {rec.size} bytes, but "
                f"the header declares {ref.numel} {str(ref.dtype).replace('torch.', '')} elements "
                f"({ref.nbytes} bytes); torch.load refuses it too ('record size ... does not match expected "
                "size'). The file is damaged or was edited: copy it again from its source.")
    declared = None
    if keys is not None:
        size_of = {ref.key: ref.nbytes for ref in refs}
        declared = {sid: size_of[key] for sid, key in keys.items()}
    _check_bounds(path, found, declared)
    in_place = index.why_not_range_readable is None
    for _, t in found:
        s = _untyped(t)
        key = None if keys is None else keys.get(id(s))
        # None: this file's tensors are read through torch.load (which reads the true offsets)
        s._oneload_offset = index.records["data/" + key].data_offset if in_place and key is not None else None


def range_readable(path: str) -> bool:
    """(local) Whether tensors of this torch file can be read in place (see RangeReader):
    a zip whose storage records are all stored uncompressed and little-endian."""
    try:
        return _file_kind(path) == "zip" and _zip_index(_stat_key(path)).why_not_range_readable is None
    except (OSError, CheckpointLayoutError):
        return False


def _torch_load(path: str, *, trust_pickle: bool, archive: Optional[tuple] = None, **kwargs) -> Any:
    """``torch.load`` through the allowlist, its errors as ours. Every unpickling of a file
    passes here, once (tests and bench/discovery_scale.py count the calls).

    ``archive``, (ZipIndex, pickle bytes) of a zip: the file's header onto ``meta``, checked
    against the archive: in one pass of the C unpickler where the pickle is a plain
    torch.save one (:mod:`._unpickle`), else by torch's own loader and :func:`_check_zip`,
    whose messages say what is wrong.
    """
    if archive is None:
        obj = _load_with_torch(path, trust_pickle=trust_pickle, **kwargs)
        _check_configs(path, obj)
        return obj
    obj, problem = (None, None) if trust_pickle else _unpickle.header(path, *archive)
    if obj is not None:  # (the one pass hands every omegaconf object to torch's loader)
        return obj
    obj = _load_with_torch(path, trust_pickle=trust_pickle, **kwargs)
    _check_configs(path, obj)
    _check_zip(path, obj, *archive)
    if problem:  # the one pass found what torch's loader and the checks above let through
        raise CheckpointLayoutError(f"{path}: {problem}; torch.load would read wrong bytes or refuse it. The "
                                    "file is damaged or was edited: copy it again from its source.")
    return obj


def _load_with_torch(path: str, *, trust_pickle: bool, **kwargs) -> Any:
    kind = _file_kind(path)
    src: Any = path
    if kind == "legacy" or _storage.is_url(path):
        kwargs.pop("mmap", None)  # legacy files and objects cannot be memory-mapped
    if _storage.is_url(path):
        # a zip's header onto meta: ranged reads of what torch asks for; anything else
        # (tensor data, a legacy pickle) is read whole, once
        src = (_storage.RemoteFile(path) if kind == "zip" and kwargs.get("map_location") == "meta"
               else io.BytesIO(_storage.read_all(path)))
    try:
        if trust_pickle:
            return torch.load(src, weights_only=False, **kwargs)
        with _allowlisted():
            return torch.load(src, weights_only=True, **kwargs)
    except pickle.UnpicklingError as e:
        if "weights only" in str(e).lower() or "weights_only" in str(e):
            raise UnsafeCheckpointError(
                f"{path}: refused to unpickle: {_describe_unsafe(path, str(e))}. Nothing "
                "from the file was executed. If you trust this file and its author, load it with "
                "trust_pickle=True (CLI: --trust-pickle); that runs whatever code the pickle holds."
            ) from None
        raise CheckpointLayoutError(f"{path}: the checkpoint's pickle is damaged ({_quote(e)}). Copy the file "
                                    "again from its source.") from e
    except OneloadError:  # a remote file's own refusal, already in our words
        raise
    except RuntimeError as e:
        msg = str(e)
        if "central directory" in msg or "zip archive" in msg or "PytorchStreamReader" in msg:
            raise CheckpointLayoutError(
                f"{path}: truncated or corrupted torch checkpoint ({msg.splitlines()[0]}). "
                "Copy the file again from its source."
            ) from None
        if any(s in msg for s in ("not resizable", "does not match expected size", "out of bounds for storage",
                                  "wrong byte size")):
            # where the header could not tie every tensor to its record (legacy files, a
            # tensor in a container the header walk does not enter), torch's own check speaks
            raise CheckpointLayoutError(
                f"{path}: a tensor's header and its stored bytes disagree ({msg.splitlines()[0]}); "
                "the file is damaged or was edited: copy it again from its source."
            ) from e
        raise _unrebuildable(path, e, trust_pickle) from e
    except OSError as e:
        raise CheckpointLayoutError(os_error_message(e, path)) from e
    except MemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever an allowlisted call or a crafted opcode raised in torch's loader
        raise _unrebuildable(path, e, trust_pickle) from e


def _quote(e: BaseException, limit: int = 300) -> str:
    """``type: message`` of an error raised on a file's behalf, cut to ``limit`` characters:
    a crafted pickle chooses the arguments a message quotes (a 100 KB string)."""
    text = f"{type(e).__name__}: {e}"
    return text if len(text) <= limit else text[:limit] + f"... ({len(text) - limit} more characters)"


def _unrebuildable(path: str, e: BaseException, trust_pickle: bool) -> CheckpointLayoutError:
    """The refusal of a pickle torch's loader fails on: an allowlisted function that failed on
    what the file handed it (bool() of a meta tensor, float() of a word), a memo entry never
    stored, nesting past the interpreter's recursion limit. torch.save never writes such a
    pickle."""
    how = "weights_only=False" if trust_pickle else "weights_only=True"
    what = (f"it refers to memo entry {e.args[0]!r}, which it never stored" if type(e) is KeyError and e.args
            else _quote(e))
    return CheckpointLayoutError(
        f"{path}: torch.load({how}) cannot rebuild the file's pickle ({what}). A pickle torch.save wrote "
        "rebuilds without error: the file was damaged or crafted, and nothing from it is used. Copy it again "
        "from its source, or re-save it with torch.save.")


def _stat_key(path: str) -> tuple:
    if _storage.is_url(path):  # (url, size, ETag or the store's version, -)
        st = _storage.stat(path)
        return (path, st.size, st.version, 0)
    st = os.stat(path)
    return (os.path.realpath(path), st.st_size, st.st_mtime_ns, st.st_ino)


@functools.lru_cache(maxsize=4096)
def _cached_header(key: tuple, trust_pickle: bool) -> Any:
    path = key[0]
    kind = _file_kind(path)
    index = None
    if kind == "zip":  # the archive first: its errors are clearer than torch's
        index = _zip_index(key)
        pkl = index.records.get("data.pkl")
        if pkl is None:
            raise _bad_zip(path, f"it holds no {index.folder}/data.pkl record (the pickle torch.load reads)")
        fd = _storage.open_ro(path)
        try:
            data_pkl = _record_bytes(fd, pkl, path, index.folder)
        finally:
            _storage.close(fd)
    obj = _torch_load(path, trust_pickle=trust_pickle, map_location="meta",
                      archive=None if index is None else (index, data_pkl))
    if index is None:  # legacy: read whole by torch.load, which checks its own sizes; the shapes still here
        _check_bounds(path, list(_walk_tensors(obj, path)))
    return obj


def read_header(path: str, *, trust_pickle: bool = False) -> Any:
    """(any rank, local) The file's pickled object with every tensor on ``meta``.

    Reads the pickle, the zip's central directory and one local header per record, never
    tensor data; cached per (path, size, mtime). Checks what ``torch.load`` checks when it
    reads the data: every storage the pickle names has its record, of exactly the storage's
    size, and every tensor's shape, stride and offset lie inside its storage. Each meta
    tensor's storage remembers where its record's bytes start in the file, as found through
    the record's own local header (:func:`storage_byte_offset`).

    A top-level ``last_optimizer_state`` comes back as a mapping that builds its meta
    tensors when it is first used (its records and bounds are checked here, like the
    rest): discovery never pays for the optimizer state, the optimizer paths read it as
    before. Copies and pickles of it are plain dicts.

    Raises:
        CheckpointLayoutError: the file is missing, empty, truncated or not a checkpoint; a
            record is missing, compressed in a way torch cannot read, or of the wrong size; a
            tensor reaches past its storage. The message names the file and the tensor.
        UnsafeCheckpointError: the pickle needs a class outside the allowlist.
    """
    try:
        key = _stat_key(path)
    except OSError as e:
        raise CheckpointLayoutError(os_error_message(e, path)) from e
    return _cached_header(key, bool(trust_pickle))


def load_object(path: str, *, trust_pickle: bool = False, mmap: bool = True, exclude: tuple = ()) -> Any:
    """(any rank, local) ``torch.load`` of the whole file onto CPU, memory-mapped where the
    format allows (pages are read only when touched), through the same allowlist.
    ``exclude``: top-level keys left out (an object store's file then never fetches them)."""
    # The header's checks first: a memory-mapped torch.load takes each record's bytes
    # without comparing its size to the storage's.
    header = read_header(path, trust_pickle=trust_pickle)
    if _storage.is_url(path) and range_readable(path):
        fetched = _fetched(path, header, exclude)
        if fetched is not None:
            return fetched
    # A compressed or big-endian zip cannot be memory-mapped; torch reads it whole.
    mmap = mmap and (_file_kind(path) != "zip" or range_readable(path))
    if _file_kind(path) == "zip" and not mmap:
        _check_deflated(_stat_key(path))
    obj = _torch_load(path, trust_pickle=trust_pickle, map_location="cpu", mmap=mmap)
    if exclude and isinstance(obj, dict):
        obj = {k: v for k, v in obj.items() if k not in exclude}
    return obj


def _fetched(url: str, header: Any, exclude: tuple) -> Any:
    """An object's file as ``torch.load`` gives it, from its (checked) header: each storage
    outside ``exclude`` fetched once by ranged reads into fresh CPU memory, everything else
    copied; None where a storage's place is unknown (then the file is read whole)."""
    src = {k: v for k, v in header.items() if k not in exclude} if isinstance(header, dict) else header
    memo: dict = {}
    storages: dict = {}
    for _, t in _walk_tensors(src, url):
        if not isinstance(t, torch.Tensor):
            return None
        s = t.untyped_storage()
        offset = getattr(s, "_oneload_offset", None)
        if offset is None:
            return None
        cpu = storages.get(id(s))
        if cpu is None:
            buf = torch.empty(s.nbytes(), dtype=torch.uint8)
            got = _storage.read_into(url, int(offset), _writable_buffer(buf)) if s.nbytes() else 0
            if got < s.nbytes():
                raise CheckpointLayoutError(f"{url}: truncated: a tensor's bytes end at {offset + got}, its record "
                                            f"at {offset + s.nbytes()}. Copy the file again from its source.")
            cpu = storages[id(s)] = buf.untyped_storage()
        memo[id(t)] = torch.empty(0, dtype=t.dtype).set_(cpu, t.storage_offset(), t.shape, t.stride())
    return copy.deepcopy(src, memo)


def storage_byte_offset(meta_tensor: torch.Tensor) -> Optional[int]:
    """Byte offset in its file of a tensor from :func:`read_header`, or None when it cannot
    be read in place (then the tensor is read through :func:`load_object`). The offset is the
    one :func:`read_header` verified against the archive, never torch's computed guess; None
    too for a tensor whose elements are not one run of consecutive bytes (non-contiguous)."""
    base = getattr(meta_tensor.untyped_storage(), "_oneload_offset", None)
    if base is None or not meta_tensor.is_contiguous():
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


_PAGE = 4096
_MIN_PIECE = 1 << 20  # below this a read is not worth a thread hand-off


def _env_number(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"${name}={raw!r}: expected a number.") from None


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def direct_by_default() -> bool:
    """Whether a RangeReader made without ``direct`` reads with ``O_DIRECT``
    (``$METASEQ_ONELOAD_O_DIRECT``)."""
    return _env_flag("METASEQ_ONELOAD_O_DIRECT")


class RangeReader:
    """(any rank, local) Reads element ranges of stored tensors into destination tensors.

    Holds one open descriptor per file. Reads go straight into the destination's memory
    when it is a contiguous CPU tensor of the stored dtype; otherwise (another dtype, a
    CUDA destination) through a staging buffer of at most ``chunk_bytes``.

    One large read is split at file offsets that are multiples of a piece size (at most
    ``split_bytes``, whole MiB) and the pieces go to ``read_threads`` threads at once:
    ``os.preadv`` lets go of the GIL, so one process keeps several requests in flight
    (what NVMe and network filesystems need to reach their bandwidth) and fills fresh
    pages of the destination on several cores. ``direct=True`` reads with ``O_DIRECT``
    through a page-aligned bounce buffer per thread (cold reads then skip the page cache;
    files where the filesystem refuses it are read the ordinary way). Defaults come from
    ``$METASEQ_ONELOAD_READ_THREADS`` (8), ``$METASEQ_ONELOAD_READ_SPLIT_MB`` (16) and
    ``$METASEQ_ONELOAD_O_DIRECT`` (off); ``read_threads=1`` is the serial reader.
    """

    def __init__(self, *, chunk_bytes: int = 64 << 20, trust_pickle: bool = False,
                 read_threads: Optional[int] = None, split_bytes: Optional[int] = None,
                 direct: Optional[bool] = None):
        self.chunk_bytes = max(int(chunk_bytes), 1 << 16)
        self.trust_pickle = trust_pickle
        self.bytes_read = 0
        if read_threads is None:
            read_threads = int(_env_number("METASEQ_ONELOAD_READ_THREADS", 8))
        if split_bytes is None:
            split_bytes = int(_env_number("METASEQ_ONELOAD_READ_SPLIT_MB", 16) * (1 << 20))
        if int(read_threads) < 1 or int(split_bytes) < 1:
            raise ValueError(f"read_threads={read_threads}, split_bytes={split_bytes}: both must be at least 1.")
        self.read_threads = int(read_threads)
        # whole MiB: every cut lies on a page (and O_DIRECT block) boundary of the file
        self.split_bytes = max(_MIN_PIECE, int(split_bytes) // _MIN_PIECE * _MIN_PIECE)
        self.direct = direct_by_default() if direct is None else bool(direct)
        self._fds: dict[str, int] = {}
        self._direct_fds: dict = {}  # path -> O_DIRECT descriptor, or None where refused
        self._objects: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._spans: dict = {}
        self._pool = None
        self._pool_pid = None
        self._bounce = threading.local()
        self.readahead = True

    def set_readahead(self, on: bool) -> None:
        """(local) Whether the kernel may read ahead of this reader's requests
        (``POSIX_FADV_RANDOM`` when not), on descriptors open now and later. Off where other
        nodes read the rest of each file: read-ahead past a rank's ranges (8 MiB on a virtio
        disk, more on network filesystems) would fetch what the storage also serves them."""
        with self._lock:
            self.readahead = bool(on)
            for fd in self._fds.values():
                self._advise(fd)

    def _advise(self, fd: int) -> None:
        if hasattr(os, "posix_fadvise"):
            with contextlib.suppress(OSError):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_NORMAL if self.readahead else os.POSIX_FADV_RANDOM)

    def __enter__(self) -> "RangeReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._pool is not None:
            if self._pool_pid == os.getpid():
                self._pool.shutdown(wait=True)
            self._pool = None
        for fd in list(self._fds.values()) + [d for d in self._direct_fds.values() if d is not None]:
            os.close(fd)
        self._fds.clear()
        self._direct_fds.clear()
        self._objects.clear()
        self._spans.clear()

    def _fd(self, path: str) -> int:
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                try:
                    fd = os.open(path, os.O_RDONLY)
                except OSError as e:
                    raise CheckpointLayoutError(f"{path}: cannot open the file ({e.strerror or e}).") from e
                if not self.readahead:
                    self._advise(fd)
                self._fds[path] = fd
            return fd

    def _direct_fd(self, path: str) -> Optional[int]:
        """An O_DIRECT descriptor of ``path``, or None where the platform or filesystem
        refuses one (tmpfs, macOS, some FUSE mounts): those files are read the usual way."""
        with self._lock:
            if path not in self._direct_fds:
                fd = None
                if hasattr(os, "O_DIRECT"):
                    try:
                        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
                    except OSError:
                        fd = None
                self._direct_fds[path] = fd
            return self._direct_fds[path]

    def _give_up_direct(self, path: str, fd: int) -> None:
        with self._lock:
            if self._direct_fds.get(path) == fd:
                self._direct_fds[path] = None
                os.close(fd)

    def _executor(self):
        # A forked child inherits the pool object but none of its threads: start anew there.
        if self._pool is None or self._pool_pid != os.getpid():
            with self._lock:
                if self._pool is None or self._pool_pid != os.getpid():
                    import concurrent.futures

                    self._pool = concurrent.futures.ThreadPoolExecutor(  # the caller is the last reader
                        max_workers=max(1, self.read_threads - 1), thread_name_prefix="oneload-read")
                    self._pool_pid = os.getpid()
        return self._pool

    def _pieces(self, offset: int, n: int) -> list:
        """(start, stop) within a read of ``n`` bytes at file ``offset``: cut at multiples of
        the piece size in the file, so pieces fall on the same boundaries whoever asks."""
        if self.read_threads <= 1 or n < 2 * _MIN_PIECE:
            return [(0, n)]
        size = min(self.split_bytes, -(-n // self.read_threads))
        size = -(-size // _MIN_PIECE) * _MIN_PIECE
        cuts = list(range(-(-(offset + 1) // size) * size - offset, n, size))
        edges = [0] + cuts + [n]
        return list(zip(edges, edges[1:]))

    def _read_piece(self, path: str, offset: int, view: memoryview) -> int:
        """Bytes of ``view`` filled from file ``offset`` on; fewer than asked only where the
        file ends first."""
        if _storage.is_url(path):  # ranged requests, written into ``view`` as they arrive
            return _storage.read_into(path, offset, view)
        if self.direct:
            dfd = self._direct_fd(path)
            if dfd is not None:
                try:
                    return self._read_direct(dfd, offset, view)
                except OSError as e:
                    import errno

                    if e.errno != errno.EINVAL:  # alignment the device wants is not ours
                        raise
                    self._give_up_direct(path, dfd)
        fd = self._fd(path)
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], offset + done)
            if n <= 0:
                break
            done += n
        return done

    def _read_direct(self, fd: int, offset: int, view: memoryview) -> int:
        """O_DIRECT wants page-aligned memory, file offsets and lengths: read the pages that
        cover the range into this thread's bounce buffer, and copy out the asked bytes."""
        buf = getattr(self._bounce, "buf", None)
        if buf is None:
            import mmap

            buf = self._bounce.buf = mmap.mmap(-1, min(self.split_bytes, 4 << 20) + 2 * _PAGE)
        window = len(buf) - 2 * _PAGE
        done = 0
        while done < len(view):
            pos = offset + done
            take = min(window, len(view) - done)
            a0 = pos // _PAGE * _PAGE
            a1 = -(-(pos + take) // _PAGE) * _PAGE
            mv = memoryview(buf)
            got = 0
            while got < a1 - a0:
                want = a1 - a0 - got
                n = os.preadv(fd, [mv[got: a1 - a0]], a0 + got)
                got += max(n, 0)
                if n < want:  # short: the file ends here (and an unaligned retry would fail)
                    break
            have = max(0, min(take, got - (pos - a0)))
            view[done: done + have] = mv[pos - a0: pos - a0 + have]
            mv.release()
            done += have
            if have < take:
                break
        return done

    def _record_spans(self, path: str) -> Optional[tuple]:
        """(starts, ends) of the storage records of a torch zip, sorted; None for other files."""
        if path not in self._spans:
            spans = None
            if not path.endswith(".safetensors") and _file_kind(path) == "zip":
                index = _zip_index(_stat_key(path))
                recs = sorted((r.data_offset, r.data_offset + r.size) for r in index.records.values()
                              if r.name.startswith("data/") and r.stored)
                spans = ([a for a, _ in recs], [b for _, b in recs])
            self._spans[path] = spans
        return self._spans[path]

    def _pread(self, path: str, offset: int, out: torch.Tensor) -> None:
        view = _writable_buffer(out)
        spans = self._record_spans(path)
        if spans is not None:  # every read lies inside one storage record, whatever computed it
            i = bisect.bisect_right(spans[0], offset) - 1
            if i < 0 or offset + len(view) > spans[1][i]:
                raise CheckpointLayoutError(
                    f"{path}: asked to read bytes {offset}..{offset + len(view)}, which do not lie inside one "
                    "tensor record of the file (its header and the layout disagree, or the file changed since "
                    "it was inspected). Nothing was loaded from it; inspect the checkpoint again.")
        pieces = self._pieces(offset, len(view))
        if len(pieces) == 1:
            got = [self._read_piece(path, offset, view)]
        else:
            import concurrent.futures

            pool = self._executor()
            futures = [pool.submit(self._read_piece, path, offset + a, view[a:b]) for a, b in pieces[1:]]
            try:  # this thread reads the first piece itself: one hand-off fewer per read
                first = self._read_piece(path, offset, view[: pieces[0][1]])
            finally:  # every piece finishes before anything is raised: they write into ``out``
                concurrent.futures.wait(futures)
            got = [first] + [f.result() for f in futures]
        for (a, b), n in zip(pieces, got):
            if n < b - a:  # the first short piece is where the file ends
                raise CheckpointLayoutError(
                    f"{path}: truncated: needed bytes {offset}..{offset + len(view)} but the file "
                    f"ends at {offset + a + n}. Copy the file again from its source."
                )
        with self._lock:
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
        self._staged(ext.path, offset, out, dtype, itemsize)

    def _staged(self, path: str, offset: int, out: torch.Tensor, dtype: torch.dtype, itemsize: int) -> None:
        """Read through staging buffers of at most ``chunk_bytes`` each, then copy (and cast)
        into ``out``. Onto CUDA: two pinned buffers, each copy to the device issued without
        waiting (``non_blocking``), so the read of the next chunk runs while the last one
        travels; a buffer is refilled only after its copy's event has completed, and every
        copy is complete on return. (A copy that also casts converts on the host first, into
        pageable memory, so it waits.) Host memory: two chunks (three where a copy casts);
        device memory: ``out``."""
        n = out.numel()
        step = max(1, self.chunk_bytes // itemsize)
        cuda = out.device.type == "cuda" and torch.cuda.is_available()
        bufs = [torch.empty(min(step, n), dtype=dtype, pin_memory=cuda) for _ in range(2 if cuda and n > step else 1)]
        done: list = [None] * len(bufs)  # the CUDA event of the copy out of each buffer
        try:
            for i, lo in enumerate(range(0, n, step)):
                hi, b = min(n, lo + step), i % len(bufs)
                if done[b] is not None:
                    done[b].synchronize()
                buf = bufs[b][: hi - lo]
                self._pread(path, offset + lo * itemsize, buf)
                out[lo:hi].copy_(buf, non_blocking=cuda)
                if cuda:
                    done[b] = torch.cuda.Event()
                    done[b].record(torch.cuda.current_stream(out.device))  # the stream copy_ used
        finally:
            for ev in done:
                if ev is not None:
                    ev.synchronize()

    def read_from_mmap(self, ext: Extent, start: int, n: int) -> torch.Tensor:
        """The same elements through ``torch.load(mmap=True)``: an independent path used by
        ``verify=True`` to check the byte arithmetic of :meth:`read_extent`."""
        return self._object_tensor(ext)[start: start + n]


def key_path(*parts: str) -> str:
    """Join the keys that lead to a tensor inside a checkpoint's pickle (see Extent.key)."""
    return "\x00".join(parts)

