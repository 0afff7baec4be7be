"""How bytes go out: checkpoint files written in place, in bounded memory (the file sink).

A torch checkpoint is a zip archive that stores every tensor storage uncompressed at a
64-byte aligned offset (see :mod:`._reading`). So a file of any size is written in two steps:

1. ``torch.save`` of the object with every large tensor an unfilled ``torch.empty``, under
   ``torch.serialization.skip_data()``: torch writes the pickle, the zip directory and a
   hole for each storage in milliseconds, without touching those pages (RSS unchanged);
2. each storage's bytes, described by a :class:`Record` (the :class:`~._execute.ReadItem`
   runs it holds, then zero padding), come chunk by chunk from the one executor
   (:func:`executor_chunks`: ``_execute.stream`` through one reusable buffer) and are
   ``os.pwrite``-n at the storage's offset, read back from the file's own header. The
   CRC-32 that ``skip_data`` leaves at zero is computed on the way and patched into the zip
   headers, so every zip reader (Python's ``zipfile`` included) accepts the result.

Safetensors files (an 8-byte length, a JSON header, then raw bytes) are written the same way.
Where the files go (temporary names, exclusive creation, the all-or-nothing commit) is
:mod:`._outputs`.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import io
import json
import os
import re
import struct
import sys
import threading
import weakref
import zipfile
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import torch

from ._allowlist import allowlisted
from ._errors import ConversionError, UnsafeCheckpointError
from ._execute import ReadItem, stream
from ._outputs import open_for_writing, pwrite_all, write_new

__all__ = [
    "Cancelled",
    "Record",
    "whole_record",
    "Meter",
    "executor_chunks",
    "write_torch",
    "append_torch",
    "write_safetensors",
    "LateHeader",
    "write_json",
    "storage_key",
    "SAFETENSORS_DTYPES",
]

_DATA_RECORD = re.compile(r"/data/\d+$")
_DEFAULT_CHUNK = 64 << 20

# (record) -> the 1-D chunks of its items' elements, in order, each valid until the next.
Chunks = Callable[["Record"], Iterator[torch.Tensor]]

SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}


class Cancelled(Exception):
    """Raised inside a writer when another writer failed: stop early, clean up."""


@dataclass(frozen=True)
class Record:
    """What one output storage holds, in order: the elements of ``items``
    (:class:`~._execute.ReadItem`, names of the sources the chunks come from), then ``pad``
    zeros (fairscale's padding at the tail of a flat shard). Every item is of ``dtype``."""

    items: tuple
    dtype: torch.dtype
    pad: int = 0

    @property
    def numel(self) -> int:
        return sum(i.numel for i in self.items) + self.pad

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)


def whole_record(name: str, t: Any) -> Record:
    """The record of all of planned tensor ``t`` (a ``TargetTensor``), the source ``name``."""
    return Record((ReadItem(name, 0, t.numel),), t.dtype)


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def storage_key(t: torch.Tensor) -> int:
    """Identity of a tensor's storage (shared by views and tied names)."""
    return t.untyped_storage()._cdata


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A memoryview over a contiguous CPU tensor's bytes (any dtype, bf16 too)."""
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B") if n else memoryview(b"")


def _storage_bytes(s: torch.UntypedStorage) -> memoryview:
    n = s.nbytes()
    return memoryview((ctypes.c_char * n).from_address(s.data_ptr())).cast("B") if n else memoryview(b"")


def executor_chunks(sources: Mapping[str, Any], reader, chunk_bytes: int,
                    tap: Optional[Callable[[ReadItem, torch.Tensor], None]] = None) -> Chunks:
    """(local) The chunks of records whose items name ``sources`` (planned target tensors):
    ``_execute.stream`` carries the items out through one buffer of ``chunk_bytes``, which
    every record of one writer reuses. ``tap`` sees each chunk, ``(item, data)``, while it
    is written (the writers' digests, :mod:`._digest_record`: hashed as the bytes pass), on a
    thread of its own (BLAKE3 and the file writes release the GIL); the buffer is refilled
    only once the tap is done with it."""
    buffer = torch.empty(max(1 << 12, chunk_bytes // 64 * 64), dtype=torch.uint8)
    pool = None
    if tap is not None:
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="oneload-digest")

    def chunks(rec: Record) -> Iterator[torch.Tensor]:
        for item, data in stream(rec.items, sources, reader, buffer.numel(), buffer):
            if data.dtype != rec.dtype:
                raise ConversionError(f"{item.name}: planned as {data.dtype} inside a storage of {rec.dtype}.")
            if pool is None:
                yield data
                continue
            tapped = pool.submit(tap, item, data)
            try:
                yield data
            finally:
                concurrent.futures.wait([tapped])
            tapped.result()

    if pool is not None:
        weakref.finalize(chunks, pool.shutdown, wait=False)
    return chunks


class Meter:
    """(local, thread-safe) Bytes done of a verb's ``total``, told to ``progress``: a
    callable gets ``(bytes done so far, bytes in all)``; True (None: stderr is a terminal)
    shows a tqdm bar of bytes with a count of tensors; False nothing."""

    def __init__(self, progress: Any, total: int, tensors: int, desc: str):
        self.total, self.tensors, self.done, self.finished = int(total), tensors, 0, 0
        self._lock = threading.Lock()
        self._call = progress if callable(progress) else None
        self._bar = None
        if progress is None:
            progress = sys.stderr.isatty()
        if self._call is None and progress:
            from tqdm import tqdm

            self._bar = tqdm(total=self.total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc,
                             leave=False, file=sys.stderr, postfix=f"0/{tensors} tensors")

    def add(self, nbytes: int, tensors: int = 0) -> None:
        with self._lock:
            self.done += nbytes
            self.finished += tensors
            if self._bar is not None:
                if tensors:
                    self._bar.set_postfix_str(f"{self.finished}/{self.tensors} tensors", refresh=False)
                if nbytes:
                    self._bar.update(nbytes)
            elif self._call is not None and nbytes:
                self._call(self.done, self.total)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


class _FileSink:
    """(local, one thread) Writes records into an open file from their chunks."""

    def __init__(self, fd: int, chunks: Optional[Chunks], meter: Optional[Meter], cancel: Optional[threading.Event]):
        self.fd = fd
        self.chunks = chunks
        self.meter = meter
        self.cancel = cancel
        self.written = 0

    def _emit(self, view: memoryview, offset: int, crc: int, planned: bool = True) -> int:
        if self.cancel is not None and self.cancel.is_set():
            raise Cancelled()
        pwrite_all(self.fd, view, offset)
        self.written += len(view)
        if self.meter is not None and planned:  # the verb's total counts its records only
            self.meter.add(len(view))
        return zlib.crc32(view, crc)

    def record(self, rec: Record, offset: int) -> int:
        """Write ``rec`` at ``offset``; returns its CRC-32."""
        crc, start, end = 0, offset, offset + rec.nbytes
        read = end - rec.pad * itemsize(rec.dtype)
        for data in self.chunks(rec) if rec.items else ():
            view = _bytes_of(data)
            crc = self._emit(view, offset, crc)
            offset += len(view)
        if offset != read:  # never leave part of a storage unwritten, nor write past it
            raise ConversionError(f"the chunks of a storage came to {offset - start} bytes, planned {read - start}.")
        if offset < end:
            zeros = memoryview(bytes(min(end - offset, _DEFAULT_CHUNK)))
            while offset < end:
                part = zeros[: end - offset]
                crc = self._emit(part, offset, crc)
                offset += len(part)
        if self.meter is not None:
            self.meter.add(0, 1)
        return crc

    def raw(self, view: memoryview, offset: int) -> int:
        crc = 0
        for lo in range(0, len(view), _DEFAULT_CHUNK):
            crc = self._emit(view[lo: lo + _DEFAULT_CHUNK], offset + lo, crc, planned=False)
        return crc


# --------------------------------------------------------------------------- torch zip


def _walk(obj: Any, path: tuple = (), seen: Optional[set] = None) -> Iterator[tuple]:
    """(path, tensor) for every tensor in a checkpoint object, in a fixed order. A container
    shared along many paths is walked once (a cfg of shared lists has 2**60 paths in a few
    hundred bytes), and an OmegaConf container's values are read raw: iterating one
    resolves the file's interpolations."""
    from ._layout import raw_get, raw_keys  # (cfg reading lives there)

    if torch.is_tensor(obj):
        yield path, obj
        return
    if seen is None:
        seen = set()
    if type(obj).__module__.startswith("omegaconf."):
        if id(obj) not in seen:
            seen.add(id(obj))
            for k in raw_keys(obj) if hasattr(obj, "keys") else range(len(getattr(obj, "_content", None) or ())):
                yield from _walk(raw_get(obj, k), path + (k,), seen)
    elif isinstance(obj, (Mapping, list, tuple, argparse.Namespace)) and id(obj) not in seen:
        seen.add(id(obj))
        items = (obj.items() if isinstance(obj, Mapping) else vars(obj).items()
                 if isinstance(obj, argparse.Namespace) else enumerate(obj))
        for k, v in items:
            yield from _walk(v, path + (k,), seen)


def _data_records(file: Any) -> tuple:
    """(infos of the zip's records, central directory offset) of a path or an open file."""
    with zipfile.ZipFile(file) as zf:
        infos = zf.infolist()
        start_dir = zf.start_dir
    return infos, start_dir


def _patch_crcs(fd: int, path: str, infos: Sequence, start_dir: int, crcs: Mapping[int, int], base: int = 0) -> None:
    """Write the CRC-32 of each record whose data starts at a key of ``crcs`` into its local
    header and its central directory entry (``skip_data`` left them at zero); the archive
    starts at byte ``base`` of the file."""
    pos = start_dir
    patched = 0
    for info in infos:
        cd = os.pread(fd, 46, base + pos)
        if cd[:4] != b"PK\x01\x02":
            raise ConversionError(f"{path}: unexpected zip central directory entry at byte {base + pos}.")
        n, e, c = struct.unpack("<HHH", cd[28:34])
        local = os.pread(fd, 30, base + info.header_offset)
        ln, le = struct.unpack("<HH", local[26:30])
        data_offset = info.header_offset + 30 + ln + le
        crc = crcs.get(data_offset)
        if crc is not None:
            packed = struct.pack("<I", crc)
            os.pwrite(fd, packed, base + info.header_offset + 14)
            os.pwrite(fd, packed, base + pos + 16)
            patched += 1
        pos += 46 + n + e + c
    if patched != len(crcs):
        raise ConversionError(f"{path}: found {patched} of {len(crcs)} tensor records in the zip directory.")


class _Window(io.RawIOBase):
    """(local) Bytes ``base .. base + size`` of an open file, read as a file of their own (a
    torch archive inside a longer file, for zipfile and ``torch.load``)."""

    def __init__(self, f: Any, base: int, size: int):
        super().__init__()
        self.f, self.base, self.size, self.pos = f, base, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self.pos = max(0, offset + (0, self.pos, self.size)[whence])
        return self.pos

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), self.size - self.pos))
        data = os.pread(self.f.fileno(), n, self.base + self.pos) if n else b""
        memoryview(b).cast("B")[: len(data)] = data
        self.pos += len(data)
        return len(data)


def _read_back_header(f, trust_pickle: bool) -> Any:
    """The file just written, unpickled onto ``meta`` (offsets, no data) from the same open
    descriptor, with ``weights_only`` and the checkpoint allowlist (``trust_pickle``: the
    caller unpickled its source without the allowlist, so the object may hold more)."""
    f.seek(0)
    if trust_pickle:
        return torch.load(f, map_location="meta", weights_only=False)
    with allowlisted():
        return torch.load(f, map_location="meta", weights_only=True)


def write_torch(path: str, obj: Any, records: Mapping[int, Record], chunks: Optional[Chunks], *,
                progress: Optional[Meter] = None, cancel: Optional[threading.Event] = None,
                trust_pickle: bool = False) -> int:
    """(local) Write ``obj`` as a torch checkpoint at ``path`` in bounded memory.

    Every tensor in ``obj`` whose storage (:func:`storage_key`) is a key of ``records`` is a
    placeholder (an unfilled ``torch.empty``): its bytes are ``chunks(record)`` (usually
    :func:`executor_chunks`), then the record's zero padding. Any other tensor (small ones:
    meters, scalars) is written from its own memory. ``path`` is opened once, never through
    a link (use :func:`._outputs.make_temp` for a name nobody can take first); everything
    after ``torch.save`` goes through that descriptor. Returns the bytes of tensor data
    written; ``progress`` and ``cancel`` are checked at every chunk.

    Raises:
        ConversionError: the written file's tensors could not all be located.
        UnsafeCheckpointError: ``obj`` holds a class outside the checkpoint allowlist (and
            not ``trust_pickle``).
    """
    fd = open_for_writing(path)
    with os.fdopen(fd, "r+b") as f:
        written = append_torch(f, path, obj, records, chunks, progress=progress, cancel=cancel,
                               trust_pickle=trust_pickle)
        os.fsync(f.fileno())
    return written


def append_torch(f: Any, path: str, obj: Any, records: Mapping[int, Record], chunks: Optional[Chunks], *,
                 progress: Optional[Meter] = None, cancel: Optional[threading.Event] = None,
                 trust_pickle: bool = False) -> int:
    """(local) ``obj`` as a torch checkpoint written at ``f``'s position, its storages filled
    as :func:`write_torch` fills them, ``f`` left at its end (``f``: a file of
    :func:`._outputs.open_for_writing`). A torch zip archive counts its offsets from its own
    first byte, so archives can follow each other in one file: what a
    ``torch.distributed.checkpoint`` ``.distcp`` file holds. Returns the tensor bytes written."""
    base = f.tell()
    with torch.serialization.skip_data():
        torch.save(obj, f)
    f.flush()
    end = f.tell()
    blob = _Window(f, base, end - base)
    try:
        header = _read_back_header(blob, trust_pickle)
    except Exception as e:  # noqa: BLE001
        import pickle

        if isinstance(e, pickle.UnpicklingError):
            raise UnsafeCheckpointError(
                f"{path}: the object written holds a class outside the checkpoint allowlist ({e}); pass "
                "trust_pickle=True only if its source is trusted."
            ) from None
        raise
    ours, theirs = list(_walk(obj)), list(_walk(header))
    if [p for p, _ in ours] != [p for p, _ in theirs]:
        raise ConversionError(f"{path}: the written file's tensors do not match the object saved.")
    storages: dict = {}
    for (p, t), (_, h) in zip(ours, theirs):
        s = t.untyped_storage()
        if s.nbytes() == 0:
            continue
        offset = int(h.untyped_storage()._checkpoint_offset)
        storages.setdefault(offset, (p, t, s))
    blob.seek(0)
    infos, start_dir = _data_records(blob)
    expected = sum(1 for i in infos if _DATA_RECORD.search(i.filename) and i.file_size > 0)
    if expected != len(storages):
        raise ConversionError(
            f"{path}: located {len(storages)} of the {expected} tensor storages the file holds; "
            "a tensor sits in a container this writer does not walk (dict, list, tuple, Namespace)."
        )
    fd = f.fileno()
    sink = _FileSink(fd, chunks, progress, cancel)
    crcs = {}
    for offset in sorted(storages):
        p, t, s = storages[offset]
        rec = records.get(storage_key(t))
        if rec is not None:
            if rec.nbytes != s.nbytes():
                raise ConversionError(f"{path}: {'.'.join(map(str, p))}: planned {rec.nbytes} bytes "
                                      f"for a storage of {s.nbytes()}.")
            crcs[offset] = sink.record(rec, base + offset)
        else:
            crcs[offset] = sink.raw(_storage_bytes(s), base + offset)
    _patch_crcs(fd, path, infos, start_dir, crcs, base)
    f.seek(end)
    return sink.written


# --------------------------------------------------------------------------- safetensors


class LateHeader:
    """(local) A safetensors file whose data is written and whose ``__metadata__`` is known
    only later (the digests of a whole export): :meth:`finish` writes the final header over
    the one written first, through the descriptor that wrote the file, and closes it. The
    final header may not be longer than the first (placeholders of the same length reserve
    its room); a shorter one is padded with spaces, as the format allows."""

    def __init__(self, fd: int, path: str, header: Mapping, size: int):
        self.fd, self.path, self.header, self.size = fd, path, dict(header), size

    def finish(self, metadata: Mapping[str, str]) -> None:
        self.header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        raw = json.dumps(self.header, separators=(",", ":")).encode()
        if len(raw) > self.size:
            raise ConversionError(f"{self.path}: the final header needs {len(raw)} bytes, {self.size} were reserved.")
        pwrite_all(self.fd, memoryview(raw + b" " * (self.size - len(raw))), 8)
        os.fsync(self.fd)
        self.close()

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def write_safetensors(path: str, entries: Sequence[tuple], metadata: Mapping[str, str], chunks: Optional[Chunks], *,
                      progress: Optional[Meter] = None, cancel: Optional[threading.Event] = None,
                      late: Optional[list] = None) -> int:
    """(local) Write ``entries`` of (name, shape, dtype, Record) as one safetensors file, the
    records' bytes from ``chunks`` as for :func:`write_torch`.

    Tensors are laid out back to back in the given order (the format allows no holes);
    ``metadata`` goes into the header's ``__metadata__`` (strings only). With ``late`` (a
    list), the file stays open once its data is written and a :class:`LateHeader` is appended
    to ``late``: its ``finish`` replaces ``metadata`` (placeholders) with the final values.
    """
    header: dict = {"__metadata__": {str(k): str(v) for k, v in metadata.items()}}
    offset = 0
    for name, shape, dtype, rec in entries:
        if dtype not in SAFETENSORS_DTYPES:
            raise ConversionError(f"{name}: dtype {dtype} has no safetensors code; use format='torch' (CLI: --format torch).")
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": [int(s) for s in shape],
                        "data_offsets": [offset, offset + rec.nbytes]}
        offset += rec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    start = 8 + len(raw)
    fd = open_for_writing(path)
    try:
        pwrite_all(fd, memoryview(struct.pack("<Q", len(raw)) + raw), 0)
        os.ftruncate(fd, start + offset)
        sink = _FileSink(fd, chunks, progress, cancel)
        for name, shape, dtype, rec in entries:
            sink.record(rec, start + header[name]["data_offsets"][0])
        os.fsync(fd)
        if late is not None:
            late.append(LateHeader(fd, path, header, len(raw)))
            fd = -1
    finally:
        if fd >= 0:
            os.close(fd)
    return sink.written


def write_json(path: str, obj: Any) -> None:
    """(local) A small JSON file, fsync'd (the sidecar of a safetensors file); ``path`` as
    for :func:`write_torch`."""
    write_new(path, json.dumps(obj, indent=1, sort_keys=False).encode())

