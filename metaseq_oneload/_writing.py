"""How bytes go out: checkpoint files written in place, in bounded memory, under temporary names.

A torch checkpoint is a zip archive that stores every tensor storage uncompressed at a
64-byte aligned offset (see :mod:`._reading`). So a file of any size is written in two steps:

1. ``torch.save`` of the object with every large tensor an unfilled ``torch.empty``, under
   ``torch.serialization.skip_data()``: torch writes the pickle, the zip directory and a
   hole for each storage in milliseconds, without touching those pages (RSS unchanged);
2. each storage's bytes are produced chunk by chunk into one bounded buffer and
   ``os.pwrite``-n at the storage's offset, read back from the file's own header. The
   CRC-32 that ``skip_data`` leaves at zero is computed on the way and patched into the zip
   headers, so every zip reader (Python's ``zipfile`` included) accepts the result.

Safetensors files (an 8-byte length, a JSON header, then raw bytes) are written the same way.

Every output goes to a temporary name in its destination folder (``.NAME.tmp-PID``, which no
checkpoint grammar matches) and :class:`OutputSet` renames them only when all are complete,
so an interruption, ``kill -9`` included, leaves no file at any final name.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import json
import os
import re
import struct
import sys
import threading
import zipfile
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence

import torch

from ._errors import ConversionError, OutputExistsError

__all__ = [
    "ConversionError",
    "OutputExistsError",
    "Piece",
    "Record",
    "write_torch",
    "write_safetensors",
    "write_json",
    "storage_key",
    "OutputSet",
    "progress_bar",
]

_DATA_RECORD = re.compile(r"/data/\d+$")

Fill = Callable[[Any, torch.Tensor, int], None]
Progress = Callable[[int, int], None]  # (bytes written since the last call, tensors completed)

SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}


class Cancelled(Exception):
    """Raised inside a writer when another writer failed: stop early, clean up."""


@dataclass(frozen=True)
class Piece:
    """``numel`` elements of ``dtype`` from ``source`` starting at its element ``start``;
    ``source`` None means zeros (fairscale's padding at the tail of a flat shard)."""

    source: Any
    start: int
    numel: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)


@dataclass(frozen=True)
class Record:
    """What one output storage holds, in order."""

    pieces: tuple

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def storage_key(t: torch.Tensor) -> int:
    """Identity of a tensor's storage (shared by views and tied names)."""
    return t.untyped_storage()._cdata


def _buffer_view(t: torch.Tensor) -> memoryview:
    """A memoryview over a contiguous CPU tensor's bytes (any dtype, bf16 too)."""
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B") if n else memoryview(b"")


def _storage_view(s: torch.UntypedStorage) -> memoryview:
    n = s.nbytes()
    return memoryview((ctypes.c_char * n).from_address(s.data_ptr())).cast("B") if n else memoryview(b"")


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


class _Sink:
    """(local, one thread) Writes records into an open file through one bounded buffer."""

    def __init__(self, fd: int, fill: Fill, chunk_bytes: int, progress: Optional[Progress],
                 cancel: Optional[threading.Event]):
        self.fd = fd
        self.fill = fill
        self.chunk_bytes = max(1 << 12, chunk_bytes // 64 * 64)
        self.progress = progress
        self.cancel = cancel
        self.buffer: Optional[torch.Tensor] = None
        self.written = 0

    def _buf(self) -> torch.Tensor:
        if self.buffer is None:
            self.buffer = torch.empty(self.chunk_bytes, dtype=torch.uint8)
        return self.buffer

    def _emit(self, view: memoryview, offset: int, crc: int) -> int:
        if self.cancel is not None and self.cancel.is_set():
            raise Cancelled()
        _pwrite_all(self.fd, view, offset)
        self.written += len(view)
        if self.progress:
            self.progress(len(view), 0)
        return zlib.crc32(view, crc)

    def record(self, rec: Record, offset: int) -> int:
        """Write ``rec`` at ``offset``; returns its CRC-32."""
        crc = 0
        for p in rec.pieces:
            item = _itemsize(p.dtype)
            step = max(1, self.chunk_bytes // item)
            for lo in range(0, p.numel, step):
                n = min(step, p.numel - lo)
                raw = self._buf()[: n * item]
                out = raw.view(p.dtype)
                if p.source is None:
                    raw.zero_()
                else:
                    self.fill(p.source, out, p.start + lo)
                crc = self._emit(_buffer_view(raw), offset, crc)
                offset += n * item
        if self.progress:
            self.progress(0, 1)
        return crc

    def raw(self, view: memoryview, offset: int) -> int:
        crc = 0
        for lo in range(0, len(view), self.chunk_bytes):
            part = view[lo: lo + self.chunk_bytes]
            crc = self._emit(part, offset + lo, crc)
        return crc


# --------------------------------------------------------------------------- torch zip


def _walk(obj: Any, path: tuple = ()) -> Iterator[tuple]:
    """(path, tensor) for every tensor in a checkpoint object, in a fixed order."""
    if torch.is_tensor(obj):
        yield path, obj
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from _walk(v, path + (k,))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _walk(v, path + (i,))
    elif isinstance(obj, argparse.Namespace):
        for k, v in vars(obj).items():
            yield from _walk(v, path + (k,))


def _data_records(path: str) -> tuple:
    """(infos of the zip's non-empty tensor records, central directory offset)."""
    with zipfile.ZipFile(path) as zf:
        infos = zf.infolist()
        start_dir = zf.start_dir
    return infos, start_dir


def _patch_crcs(fd: int, path: str, crcs: Mapping[int, int]) -> None:
    """Write the CRC-32 of each record whose data starts at a key of ``crcs`` into its local
    header and its central directory entry (``skip_data`` left them at zero)."""
    infos, start_dir = _data_records(path)
    pos = start_dir
    patched = 0
    for info in infos:
        cd = os.pread(fd, 46, pos)
        if cd[:4] != b"PK\x01\x02":
            raise ConversionError(f"{path}: unexpected zip central directory entry at byte {pos}.")
        n, e, c = struct.unpack("<HHH", cd[28:34])
        local = os.pread(fd, 30, info.header_offset)
        ln, le = struct.unpack("<HH", local[26:30])
        data_offset = info.header_offset + 30 + ln + le
        crc = crcs.get(data_offset)
        if crc is not None:
            packed = struct.pack("<I", crc)
            os.pwrite(fd, packed, info.header_offset + 14)
            os.pwrite(fd, packed, pos + 16)
            patched += 1
        pos += 46 + n + e + c
    if patched != len(crcs):
        raise ConversionError(f"{path}: found {patched} of {len(crcs)} tensor records in the zip directory.")


def write_torch(path: str, obj: Any, records: Mapping[int, Record], fill: Fill, *, chunk_bytes: int,
                progress: Optional[Progress] = None, cancel: Optional[threading.Event] = None) -> int:
    """(local) Write ``obj`` as a torch checkpoint at ``path`` in bounded memory.

    Every tensor in ``obj`` whose storage (:func:`storage_key`) is a key of ``records`` is a
    placeholder (an unfilled ``torch.empty``): its bytes come from the record's pieces via
    ``fill(source, out_1d, start)``. Any other tensor (small ones: meters, scalars) is
    written from its own memory. Returns the bytes of tensor data written.

    Raises:
        ConversionError: the written file's tensors could not all be located.
    """
    with torch.serialization.skip_data():
        torch.save(obj, path)
    # The pickle is the one just written, from objects already unpickled under the
    # caller's rules: the full unpickler is safe here, and far faster than the weights-only
    # one on headers with thousands of meters.
    header = torch.load(path, map_location="meta", weights_only=False)
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
    infos, _ = _data_records(path)
    expected = sum(1 for i in infos if _DATA_RECORD.search(i.filename) and i.file_size > 0)
    if expected != len(storages):
        raise ConversionError(
            f"{path}: located {len(storages)} of the {expected} tensor storages the file holds; "
            "a tensor sits in a container this writer does not walk (dict, list, tuple, Namespace)."
        )
    fd = os.open(path, os.O_RDWR)
    try:
        sink = _Sink(fd, fill, chunk_bytes, progress, cancel)
        crcs = {}
        for offset in sorted(storages):
            p, t, s = storages[offset]
            rec = records.get(storage_key(t))
            if rec is not None:
                if rec.nbytes != s.nbytes():
                    raise ConversionError(f"{path}: {'.'.join(map(str, p))}: planned {rec.nbytes} bytes "
                                          f"for a storage of {s.nbytes()}.")
                crcs[offset] = sink.record(rec, offset)
            else:
                crcs[offset] = sink.raw(_storage_view(s), offset)
        _patch_crcs(fd, path, crcs)
        os.fsync(fd)
    finally:
        os.close(fd)
    return sink.written


# --------------------------------------------------------------------------- safetensors


def write_safetensors(path: str, entries: Sequence[tuple], metadata: Mapping[str, str], fill: Fill, *,
                      chunk_bytes: int, progress: Optional[Progress] = None,
                      cancel: Optional[threading.Event] = None) -> int:
    """(local) Write ``entries`` of (name, shape, dtype, Record) as one safetensors file.

    Tensors are laid out back to back in the given order (the format allows no holes);
    ``metadata`` goes into the header's ``__metadata__`` (strings only).
    """
    header: dict = {"__metadata__": {str(k): str(v) for k, v in metadata.items()}}
    offset = 0
    for name, shape, dtype, rec in entries:
        if dtype not in SAFETENSORS_DTYPES:
            raise ConversionError(f"{name}: dtype {dtype} has no safetensors code; use --format torch.")
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": [int(s) for s in shape],
                        "data_offsets": [offset, offset + rec.nbytes]}
        offset += rec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    start = 8 + len(raw)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _pwrite_all(fd, memoryview(struct.pack("<Q", len(raw)) + raw), 0)
        os.ftruncate(fd, start + offset)
        sink = _Sink(fd, fill, chunk_bytes, progress, cancel)
        for name, shape, dtype, rec in entries:
            sink.record(rec, start + header[name]["data_offsets"][0])
        os.fsync(fd)
    finally:
        os.close(fd)
    return sink.written


def write_json(path: str, obj: Any) -> None:
    """(local) A small JSON file, fsync'd (the sidecar of a safetensors file)."""
    data = json.dumps(obj, indent=1, sort_keys=False).encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _pwrite_all(fd, memoryview(data), 0)
        os.fsync(fd)
    finally:
        os.close(fd)


def progress_bar(enabled: Any, total_bytes: int, total_tensors: int, desc: str) -> tuple:
    """(callback(bytes, tensors) or None, closer): a tqdm bar of bytes with a count of
    tensors, when ``enabled`` (None: stderr is a terminal); a callable is used as is."""
    if callable(enabled):
        return enabled, lambda: None
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        return None, lambda: None
    from tqdm import tqdm

    bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, leave=False,
               file=sys.stderr, postfix=f"0/{total_tensors} tensors")
    lock = threading.Lock()
    done = [0]

    def update(nbytes: int, tensors: int) -> None:
        with lock:
            if tensors:
                done[0] += tensors
                bar.set_postfix_str(f"{done[0]}/{total_tensors} tensors", refresh=False)
            if nbytes:
                bar.update(nbytes)

    return update, bar.close


# --------------------------------------------------------------------------- output set


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class OutputSet:
    """(local, one process) The files of one conversion, all or nothing.

    Each final name gets a temporary name in the same folder (same file system, so the
    final ``os.replace`` is atomic). :meth:`commit` renames them back to back only after
    every file is complete and fsync'd; :meth:`abort` removes them. A process killed before
    :meth:`commit` leaves only hidden temporary files, which the next conversion to the same
    names removes (their pid is gone).
    """

    def __init__(self, finals: Sequence[str], *, overwrite: bool, protected: Iterable[str] = (),
                 replaces: Sequence[str] = ()):
        self.finals = [os.path.abspath(f) for f in finals]
        self.overwrite = overwrite
        self.replaces = [os.path.abspath(f) for f in replaces if os.path.abspath(f) not in self.finals]
        self._protected_paths = set()
        self._protected_ids = set()
        for p in protected:
            self._protected_paths.add(os.path.realpath(p))
            try:
                st = os.stat(p)
                self._protected_ids.add((st.st_dev, st.st_ino))
            except OSError:
                pass
        self.temps = {f: os.path.join(os.path.dirname(f), f".{os.path.basename(f)}.tmp-{os.getpid()}")
                      for f in self.finals}
        self.removed: list = []
        self.committed = False

    def _is_protected(self, path: str) -> bool:
        if os.path.realpath(path) in self._protected_paths:
            return True
        try:
            st = os.stat(path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) in self._protected_ids

    def check(self) -> None:
        """Refuse to write over a source file, ever, and over any existing file without
        ``overwrite``; make the folders."""
        for f in self.finals + self.replaces:
            if os.path.lexists(f) and self._is_protected(f):
                raise OutputExistsError(
                    f"{f}: is (or links to) a file of the source checkpoint; a conversion never writes "
                    "over its source. Choose another destination prefix or folder."
                )
        existing = [f for f in self.finals + self.replaces if os.path.lexists(f)]
        if existing and not self.overwrite:
            names = ", ".join(os.path.basename(f) for f in existing[:4]) + (" ..." if len(existing) > 4 else "")
            raise OutputExistsError(
                f"{os.path.dirname(existing[0])}: {len(existing)} destination file(s) exist ({names}); "
                "nothing was written. Pass overwrite=True (CLI: --overwrite) to replace them, or choose "
                "another destination prefix."
            )
        for d in sorted({os.path.dirname(f) for f in self.finals}):
            os.makedirs(d, exist_ok=True)

    def clean_stale(self) -> list:
        """Remove temporary files of these names left by a killed conversion (dead pid)."""
        removed = []
        for f in self.finals:
            d, base = os.path.split(f)
            stem = f".{base}.tmp-"
            try:
                names = os.listdir(d)
            except OSError:
                continue
            for n in names:
                if not n.startswith(stem) or not n[len(stem):].isdigit():
                    continue
                pid = int(n[len(stem):])
                if pid == os.getpid() or _pid_alive(pid):
                    continue
                try:
                    os.unlink(os.path.join(d, n))
                    removed.append(os.path.join(d, n))
                except FileNotFoundError:
                    pass
        return removed

    def temp(self, final: str) -> str:
        return self.temps[os.path.abspath(final)]

    def commit(self) -> None:
        """Rename every temporary file to its final name, then remove the replaced files
        of an older set (``replaces``), then fsync the folders."""
        missing = [t for t in self.temps.values() if not os.path.exists(t)]
        if missing:
            raise ConversionError(f"{missing[0]}: a finished output is missing before the rename; nothing was renamed.")
        for f in self.finals:
            os.replace(self.temps[f], f)
        self.committed = True
        for f in self.replaces:
            try:
                os.unlink(f)
                self.removed.append(f)
            except FileNotFoundError:
                pass
        for d in sorted({os.path.dirname(f) for f in self.finals}):
            try:
                dfd = os.open(d, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(dfd)
            except OSError as e:  # some file systems cannot fsync a folder
                if e.errno not in (errno.EINVAL, errno.EBADF):
                    raise
            finally:
                os.close(dfd)

    def abort(self) -> None:
        """Remove every temporary file (normal errors, Ctrl-C)."""
        if self.committed:
            return
        for t in self.temps.values():
            try:
                os.unlink(t)
            except FileNotFoundError:
                pass
