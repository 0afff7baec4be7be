"""The items of a ``.distcp`` file, checked as ``torch.load`` checks a file.

``torch.distributed.checkpoint``'s default writer (``SerializationFormat.TORCH_SAVE``) puts
each chunk of each tensor in a ``.distcp`` file as one whole ``torch.save`` archive, one after
the other; the ``.metadata`` says where each lies (:class:`._dcp_meta.Item`). An item is
parsed here as the zip it is (:func:`._zip.parse_archive` through a window onto the file, so
no byte outside the item is ever taken for it), its pickle read by the one-pass header
reader under torch's ``weights_only`` allowlist (:func:`._unpickle.header`), and its one
tensor checked against the chunk the ``.metadata`` declares: dtype, shape, contiguous, every
element inside its storage record. What comes back is the absolute byte offset of the
chunk's elements in the ``.distcp`` file, which the engine then reads in place.

(local) throughout; results are cached per file version.
"""

from __future__ import annotations

import collections
import functools
import io
import json
import math
import os
import struct
import threading
from typing import Optional

import torch

from . import _storage
from ._dcp_meta import Item, metadata_of
from ._errors import CheckpointLayoutError, UnsafeCheckpointError
from ._unpickle import header, last_element
from ._zip import ZipIndex, ZipRecord, parse_archive, record_bytes, stat_key

__all__ = ["item_label", "chunk_data_offset", "data_spans", "chunk_tensor", "chunk_key", "parse_chunk_key",
           "item_value", "prefetch_items", "vouch", "vouched_spans"]


class _Window:
    """Bytes ``base .. base+size`` of an open file, read as if they were a file of their own
    (what :func:`._zip.parse_archive` reads through)."""

    def __init__(self, fd, base: int, size: int):
        self.fd, self.base, self.size = fd, base, size
        self.ends: tuple = ()  # ((offset in the window, bytes), ...) read ahead by read_ends

    def read_ends(self) -> None:
        """(a local file) Read the item's first and last bytes now, what parsing it reads
        (a dozen small reads: the end record, the central directory, each local header, the
        pickle), in one or two reads; a read they do not hold goes to the file."""
        if not isinstance(self.fd, int):
            return
        if self.size <= _ITEM_HEAD + _ITEM_TAIL:
            self.ends = ((0, _storage.pread(self.fd, self.size, self.base)),)
        else:
            tail = self.size - _ITEM_TAIL
            self.ends = ((0, _storage.pread(self.fd, _ITEM_HEAD, self.base)),
                         (tail, _storage.pread(self.fd, _ITEM_TAIL, self.base + tail)))

    def pread(self, n: int, offset: int) -> bytes:
        n = max(0, min(n, self.size - offset))
        for at, buf in self.ends:
            if at <= offset and offset + n <= at + len(buf):
                return buf[offset - at:offset - at + n]
        if n and not isinstance(self.fd, int) and n < _ITEM_TAIL and offset + n > self.size - _ITEM_TAIL:
            # the archive's end record, then its central directory and ZIP64 locator before
            # it: one fetch of the item's last bytes (none where prefetch_items took them)
            tail = min(self.size, _ITEM_TAIL)
            self.prefetch([(self.size - tail, tail)])
        return _storage.pread(self.fd, n, self.base + offset) if n else b""

    def prefetch(self, ranges) -> None:
        if not isinstance(self.fd, int):
            self.fd.prefetch([(self.base + a, n) for a, n in ranges])

    def close(self) -> None:
        pass


def item_label(path: str, fqn: str, item: Item) -> str:
    """How messages name one item: the file, the tensor and the bytes."""
    return f"{path} (the item of {fqn} at bytes {item.offset}..{item.offset + item.length})"


def chunk_key(fqn: str, offsets: tuple) -> str:
    """The Extent key of one chunk: its FQN and its offsets (how the ``.metadata`` finds it)."""
    return fqn + "\x00" + ",".join(map(str, offsets))


def parse_chunk_key(key: str) -> tuple:
    fqn, _, offs = key.rpartition("\x00")
    return fqn, tuple(int(x) for x in offs.split(",")) if offs else ()


@functools.lru_cache(maxsize=1 << 16)
def _archive(key: tuple, offset: int, length: int, label: str) -> tuple:
    """(the item's ZipIndex with absolute offsets, its pickle's bytes)."""
    path = key[0]
    fd = _storage.open_ro(path)
    try:
        size = _storage.fsize(fd)
        if offset + length > size:
            raise CheckpointLayoutError(
                f"{label}: the .metadata places it past the end of the file ({size} bytes). The folder is "
                "incomplete or the file was cut short: copy the folder again from where it was saved.")
        window = _Window(fd, offset, length)
        window.read_ends()
        index = parse_archive(window, label)
        pkl = index.records.get("data.pkl")
        if pkl is None:
            raise CheckpointLayoutError(f"{label}: the archive holds no {index.folder}/data.pkl (the pickle "
                                        "torch.load reads).")
        data = bytes(record_bytes(window, pkl, label, index.folder))
    finally:
        _storage.close(fd)
    # (each record's fields as parse_archive gave them, two of them moved; dataclasses.replace,
    # which looks the fields up each call, cost a fifth of the parse)
    moved = {n: ZipRecord(**{**vars(r), "header_offset": r.header_offset + offset,
                              "data_offset": r.data_offset + offset}) for n, r in index.records.items()}
    return ZipIndex(path, index.folder, moved, index.byteorder), data


def _index_of(path: str, item: Item, label: str) -> tuple:
    try:
        key = stat_key(path)
    except OSError as e:
        raise CheckpointLayoutError(f"{label}: cannot read the file ({e.strerror or e}).") from e
    return _archive(key, item.offset, item.length, label)


@functools.lru_cache(maxsize=1 << 12)
def _head(key: tuple, offset: int) -> bytes:
    fd = _storage.open_ro(key[0])
    try:
        return _storage.pread(fd, 4, offset)
    finally:
        _storage.close(fd)


@functools.lru_cache(maxsize=1 << 10)
def _safetensors_header(key: tuple, offset: int) -> tuple:
    """(header, first data byte, file size) of a safetensors blob at ``offset`` of a file
    (once per blob: every tensor item of a file points at the same one)."""
    label = f"{key[0]} (the safetensors blob at byte {offset})"
    fd = _storage.open_ro(key[0])
    try:
        size = _storage.fsize(fd)
        raw = _storage.pread(fd, 8, offset)
        n = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
        if not 0 < n <= min(size - offset - 8, 100 << 20):
            raise CheckpointLayoutError(f"{label}: neither a torch.save archive nor a safetensors blob (the two "
                                        "serializations torch.distributed.checkpoint writes); the file is damaged.")
        try:
            header = json.loads(_storage.pread(fd, n, offset + 8))
        except (ValueError, UnicodeDecodeError) as e:
            raise CheckpointLayoutError(f"{label}: a damaged safetensors header ({e}).") from None
    finally:
        _storage.close(fd)
    if not isinstance(header, dict):
        raise CheckpointLayoutError(f"{label}: a damaged safetensors header.")
    try:
        info = json.loads((header.get("__metadata__") or {}).get("DCP_SHARDING_INFO", "{}"))
    except (AttributeError, TypeError, ValueError):
        info = None
    return header, info if isinstance(info, dict) else {}, offset + 8 + n, size


def _safetensors_chunk(path: str, fqn: str, item: Item, dtype: torch.dtype, offsets: tuple, sizes: tuple,
                       label: str) -> int:
    """SerializationFormat.SAFETENSORS: every tensor item of a file points at one safetensors
    blob (after the file's pickled values), which holds each chunk under its FQN and the
    chunk's offsets in its DCP_SHARDING_INFO. (torch 2.13 writes it and cannot read it back.)"""
    header, info, start, size = _safetensors_header(stat_key(path), item.offset)
    entry = header.get(fqn)
    try:
        saved = info.get(fqn, {}).get("saved_offsets")
        b, e = entry["data_offsets"]
        found = (entry["dtype"], tuple(entry["shape"]), tuple(saved or ()))
    except (AttributeError, KeyError, TypeError, ValueError):
        raise CheckpointLayoutError(f"{label}: its safetensors blob holds no chunk of {fqn} with DCP_SHARDING_INFO "
                                    "offsets; the file is damaged or of another save.") from None
    want = (_ST_NAMES.get(dtype), tuple(sizes), tuple(offsets))
    if found != want or not (type(b) is int and type(e) is int and 0 <= b and e - b == item.length
                             and start + e <= size):
        raise CheckpointLayoutError(
            f"{label}: its safetensors blob holds {found[0]} {list(found[1])} at offsets {list(found[2])} (bytes "
            f"{b}..{e}), the .metadata declares {want[0]} {list(sizes)} at {list(offsets)} ({item.length} bytes). "
            "The folder mixes two saves or was edited: copy it again from where it was saved.")
    return start + b


# What torch.save writes for one plain tensor (torch's own pickler, protocol 2): every byte
# fixed but the storage class, the record's key, the numbers and the memo indices. An item
# whose pickle is exactly this is read here, without the general one-pass reader (a fifth of
# describing a folder went there); any other pickle goes to that reader. The same checks
# follow either way: the record, the tensor inside its storage, dtype, shape, strides.
_STORAGES = {n + "Storage": getattr(torch, d) for n, d in (
    ("Float", "float32"), ("Double", "float64"), ("Half", "float16"), ("BFloat16", "bfloat16"), ("Long", "int64"),
    ("Int", "int32"), ("Short", "int16"), ("Char", "int8"), ("Byte", "uint8"), ("Bool", "bool"),
    ("ComplexFloat", "complex64"), ("ComplexDouble", "complex128"))}
_TENSOR_HEAD = b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\nq\x00((X\x07\x00\x00\x00storageq\x01ctorch\n"
_TENSOR_TAIL = b"\x89ccollections\nOrderedDict\n"


class _NotPlain(Exception):
    pass


class _Cursor:
    __slots__ = ("data", "i")

    def __init__(self, data: bytes, i: int):
        self.data, self.i = data, i

    def expect(self, b: bytes) -> None:
        if not self.data.startswith(b, self.i):
            raise _NotPlain
        self.i += len(b)

    def memo(self, n: int) -> None:  # BINPUT n: torch's pickler numbers its memo 0, 1, ...
        self.expect(bytes((0x71, n)))

    def int(self) -> int:
        d, i = self.data, self.i
        op = d[i:i + 1]
        if op == b"K":
            self.i = i + 2
            return d[i + 1]
        if op == b"M":
            self.i = i + 3
            return int.from_bytes(d[i + 1:i + 3], "little")
        if op == b"J":
            self.i = i + 5
            return int.from_bytes(d[i + 1:i + 5], "little", signed=True)
        if op == b"\x8a" and i + 1 < len(d) and 1 <= d[i + 1] <= 8:
            n = d[i + 1]
            self.i = i + 2 + n
            return int.from_bytes(d[i + 2:i + 2 + n], "little", signed=True)
        raise _NotPlain

    def ints(self, memo: int) -> tuple:
        """A tuple of ints as torch's pickler writes a size or a stride (memoized unless empty)."""
        op = self.data[self.i:self.i + 1]
        if op == b")":
            self.i += 1
            return (), memo
        if op == b"(":
            self.i += 1
            out = []
            while self.data[self.i:self.i + 1] != b"t":
                out.append(self.int())
            self.i += 1
            if len(out) < 4:  # (TUPLE1..3 would have been written)
                raise _NotPlain
        else:
            out = []
            while self.data[self.i:self.i + 1] not in (b"\x85", b"\x86", b"\x87"):
                out.append(self.int())
                if len(out) > 3:
                    raise _NotPlain
            if self.data[self.i] - 0x84 != len(out):
                raise _NotPlain
            self.i += 1
        self.memo(memo)
        return tuple(out), memo + 1


def _plain_tensor(data: bytes):
    """(storage class's dtype, record key, storage elements, storage offset, size, stride)
    of an item's pickle that is exactly torch.save's of one tensor on the CPU; None for any
    other (the general reader then reads it)."""
    if not data.startswith(_TENSOR_HEAD) or len(data) > 4096:
        return None
    try:
        c = _Cursor(data, len(_TENSOR_HEAD))
        end = data.index(b"\n", c.i)
        dtype = _STORAGES.get(data[c.i:end].decode("ascii", "replace"))
        if dtype is None:
            return None
        c.i = end + 1
        c.memo(2)
        c.expect(b"X")
        n = int.from_bytes(data[c.i:c.i + 4], "little")
        key = data[c.i + 4:c.i + 4 + n]
        if not (0 < n <= 20 and key.isdigit() and len(key) == n):
            return None
        c.i += 4 + n
        c.memo(3)
        c.expect(b"X\x03\x00\x00\x00cpuq\x04")
        numel = c.int()
        c.expect(b"tq\x05Q")
        offset = c.int()
        size, memo = c.ints(6)
        stride, memo = c.ints(memo)
        c.expect(_TENSOR_TAIL)
        c.memo(memo)
        c.expect(b")R")
        c.memo(memo + 1)
        c.expect(b"t")
        c.memo(memo + 2)
        c.expect(b"R")
        c.memo(memo + 3)
        c.expect(b".")
        if c.i != len(data) or len(size) != len(stride) or offset < 0 or min(stride, default=0) < 0:
            return None  # (what torch.save never writes: the general reader says why)
    except (_NotPlain, IndexError, ValueError):
        return None
    return dtype, key.decode(), numel, offset, size, stride


def _contiguous(size: tuple, stride: tuple) -> bool:
    """As ``Tensor.is_contiguous``: row-major strides, any stride for a dim of size 1."""
    if 0 in size:
        return True
    want = 1
    for n, st in zip(reversed(size), reversed(stride)):
        if n != 1 and st != want:
            return False
        want *= n
    return True


_ST_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
             torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
             torch.bool: "BOOL"}


def chunk_data_offset(path: str, fqn: str, item: Item, dtype: torch.dtype, offsets: tuple, sizes: tuple,
                      versions: Optional[dict] = None) -> int:
    """(local) Where in ``path`` the elements of the chunk ``item`` holds start, once its
    archive and its pickle agree with the ``.metadata`` (dtype ``dtype``, shape ``sizes``;
    a safetensors-serialized item: its header, and the chunk's ``offsets``). ``versions``
    (path -> :func:`._zip.stat_key`), kept by a caller that checks many items of a file in
    one pass, takes each file's version once per pass instead of once per item.

    Raises:
        CheckpointLayoutError: naming the file, the tensor and the item's bytes.
    """
    label = item_label(path, fqn, item)
    key = versions.get(path) if versions is not None else None
    if key is None:
        try:
            key = stat_key(path)
        except OSError as e:
            raise CheckpointLayoutError(f"{label}: cannot read the file ({e.strerror or e}).") from e
        if versions is not None:
            versions[path] = key
    if item.offset + item.length > key[1]:
        raise CheckpointLayoutError(
            f"{label}: the .metadata places it past the end of the file ({key[1]} bytes). The folder is "
            "incomplete or the file was cut short: copy the folder again from where it was saved.")
    if _head(key, item.offset) != b"PK\x03\x04":
        if item.length == math.prod(sizes) * dtype.itemsize:
            return _safetensors_chunk(path, fqn, item, dtype, offsets, sizes, label)
        raise CheckpointLayoutError(
            f"{label}: not a torch.save archive, and not the bytes of the chunk. The .metadata places it "
            "elsewhere than the item is, or the file is damaged: copy the folder again from where it was saved.")
    index, data = _archive(key, item.offset, item.length, label)  # the version checked above
    why = index.why_not_range_readable
    if why:
        raise CheckpointLayoutError(f"{label}: {why}; metaseq-oneload reads DCP items in place. Load the folder "
                                    "with torch.distributed.checkpoint.load.")
    plain = _plain_tensor(data)
    if plain is not None:
        return _plain_offset(label, index, plain, dtype, sizes)
    obj, problem = header(label, index, data)
    if problem:
        raise CheckpointLayoutError(f"{label}: {problem}; torch.load would read wrong bytes or refuse it. The "
                                    "file is damaged or was edited: copy the folder again from where it was saved.")
    if type(obj) is not torch.Tensor:
        raise CheckpointLayoutError(
            f"{label}: not a plain torch.save of one tensor, what torch.distributed.checkpoint writes for a "
            f"tensor's chunk (found {type(obj).__name__ if obj is not None else 'a pickle this reader does not read'})."
            " The file is damaged or was written by another writer: load it with torch.distributed.checkpoint.load.")
    found = (obj.dtype, tuple(obj.shape))
    if found != (dtype, tuple(sizes)):
        raise CheckpointLayoutError(
            f"{label}: holds a {str(obj.dtype).replace('torch.', '')} tensor of shape {list(obj.shape)}, the "
            f".metadata declares {str(dtype).replace('torch.', '')} {list(sizes)} for this chunk. The folder mixes "
            "two saves or was edited: copy it again from where it was saved.")
    base = getattr(obj.untyped_storage(), "_oneload_offset", None)  # the record's verified place
    offset = None if base is None or not obj.is_contiguous() else int(base) + obj.storage_offset() * obj.element_size()
    if offset is None and obj.numel() > 0:
        raise CheckpointLayoutError(f"{label}: its tensor's elements are not one run of bytes (strides "
                                    f"{list(obj.stride())}); torch.distributed.checkpoint saves contiguous chunks.")
    return offset if offset is not None else item.offset


def _plain_offset(label: str, index: ZipIndex, plain: tuple, dtype: torch.dtype, sizes: tuple) -> int:
    """:func:`chunk_data_offset`'s checks, and its answer, for a pickle :func:`_plain_tensor`
    read: those the general reader and then chunk_data_offset make, in the same words."""
    found_dtype, key, numel, offset, size, stride = plain
    rec = index.records.get("data/" + key)
    problem = None
    if rec is None:
        problem = f"the pickle refers to record {index.folder}/data/{key}, which the archive does not hold"
    elif rec.size != numel * found_dtype.itemsize:
        problem = (f"storage record {index.folder}/data/{key} holds {rec.size} bytes, the header declares "
                   f"{numel * found_dtype.itemsize}")
    elif 0 not in size:
        last = last_element(offset, size, stride)
        if last is None:
            problem = "a tensor with negative strides or offsets"
        elif last >= numel:
            problem = f"a tensor reaches element {last + 1} of a storage of {numel} elements"
    if problem:
        raise CheckpointLayoutError(f"{label}: {problem}; torch.load would read wrong bytes or refuse it. The "
                                    "file is damaged or was edited: copy the folder again from where it was saved.")
    if (found_dtype, size) != (dtype, tuple(sizes)):
        raise CheckpointLayoutError(
            f"{label}: holds a {str(found_dtype).replace('torch.', '')} tensor of shape {list(size)}, the "
            f".metadata declares {str(dtype).replace('torch.', '')} {list(sizes)} for this chunk. The folder mixes "
            "two saves or was edited: copy it again from where it was saved.")
    if not _contiguous(size, stride):
        if math.prod(size) > 0:
            raise CheckpointLayoutError(f"{label}: its tensor's elements are not one run of bytes (strides "
                                        f"{list(stride)}); torch.distributed.checkpoint saves contiguous chunks.")
    return rec.data_offset + offset * found_dtype.itemsize


# What parsing an item reads of it: its first bytes (the local headers, the pickle: about
# 1 KiB for one tensor) and its last (the trailing records, the central directory and the
# end record: under 1 KiB; torch.save writes no comment, so the zip parser reads the last
# 22 bytes, not 64 KiB). An item that needs more (a long pickle) costs another request, no
# check less.
_ITEM_HEAD = 4 << 10
_ITEM_TAIL = 4 << 10
_PREFETCH_BATCH = 64  # items per batch: a batch's ranges stay few MB in the segment cache


def prefetch_items(path: str, items) -> None:
    """(local) On an object store, fetch what :func:`chunk_data_offset` will parse of each of
    ``items`` (of the file ``path``) concurrently, neighbouring ranges in one request (one
    item's tail and the next one's head), into the shared segment cache: describing a folder
    then waits for a few rounds of requests instead of two per item in turn. Checks
    nothing (the parse does, from the cache); a no-op for local files."""
    if not _storage.is_url(path):
        return
    fd = _storage.open_ro(path)
    try:
        todo = sorted({(it.offset, it.length) for it in items
                       if it.length > 0 and 0 <= it.offset and it.offset + it.length <= fd.size})
        for i in range(0, len(todo), _PREFETCH_BATCH):
            ranges = []
            for offset, length in todo[i:i + _PREFETCH_BATCH]:
                tail = min(length, _ITEM_TAIL)
                ranges += [(offset, min(length, _ITEM_HEAD)), (offset + length - tail, tail)]
            fd.prefetch(ranges)
    finally:
        _storage.close(fd)


# (starts, ends) of the chunks of .distcp files that the rank which described the folder
# checked (chunk_data_offset) and sent in the layout: a rank that adopts the layout takes
# them instead of parsing every item again. Only ever a subset of what data_spans finds: a
# read outside them is checked against the parsed items (RangeReader). By file, with the
# version they were checked at: a file changed since has another version, is parsed, and
# its entry goes; the least recently vouched files go past _VOUCHED_MAX (a long-lived
# process that loads checkpoint after checkpoint keeps the spans of its last few thousand
# files, as _archive keeps items and _zip.zip_index archives).
_VOUCHED: "collections.OrderedDict[str, tuple]" = collections.OrderedDict()  # path -> (version, spans)
_VOUCHED_MAX = 1 << 12
_VOUCHED_LOCK = threading.Lock()  # (RangeReader's pool threads read it while a describe adds)


def vouch(spans: dict) -> None:
    """(local) Record ``{path: (starts, ends)}`` a describing rank verified (see above)."""
    for path, se in spans.items():
        try:
            key = stat_key(path)
        except OSError:
            continue
        with _VOUCHED_LOCK:
            _VOUCHED.pop(key[0], None)
            _VOUCHED[key[0]] = (key, (list(se[0]), list(se[1])))
            while len(_VOUCHED) > _VOUCHED_MAX:
                _VOUCHED.popitem(last=False)


def vouched_spans(path: str):
    """(local) The spans :func:`vouch` recorded for this version of ``path``, or None (and
    those of another version are dropped)."""
    try:
        key = stat_key(path)
    except OSError:
        return None
    with _VOUCHED_LOCK:
        entry = _VOUCHED.get(key[0])
        if entry is None:
            return None
        if entry[0] != key:
            del _VOUCHED[key[0]]
            return None
        return entry[1]


def data_spans(path: str) -> tuple:
    """(local) (starts, ends) of the chunks' elements in a ``.distcp`` file, sorted, from the
    ``.metadata`` beside it, each item checked: every read of the file must lie inside one."""
    folder, name = os.path.split(path)
    meta = metadata_of(folder)
    spans = []
    versions: dict = {}
    for t in meta.tensors.values():
        for c in t.chunks:
            item = meta.item(t.fqn, c.offsets)
            if item is None or item.relative_path != name or item.transforms or not math.prod(c.sizes):
                continue
            start = chunk_data_offset(path, t.fqn, item, t.dtype, c.offsets, c.sizes, versions)
            spans.append((start, start + math.prod(c.sizes) * t.dtype.itemsize))
    spans.sort()
    return [a for a, _ in spans], [b for _, b in spans]


def chunk_tensor(path: str, key: str) -> torch.Tensor:
    """(local) The chunk an Extent key names, read by ``torch.load(weights_only=True)`` from
    its item's bytes: the independent path ``verify=True`` checks the in-place reads with."""
    fqn, offsets = parse_chunk_key(key)
    item = metadata_of(os.path.dirname(path)).item(fqn, offsets)
    if item is None:
        raise CheckpointLayoutError(f"{path}: the .metadata beside it no longer lists chunk {offsets} of {fqn}.")
    label = item_label(path, fqn, item)
    if _head(stat_key(path), item.offset) != b"PK\x03\x04":  # a safetensors blob: safetensors' own reader
        from safetensors.torch import load as st_load

        _safetensors_header(stat_key(path), item.offset)  # its checks first
        fd = _storage.open_ro(path)
        try:
            header_and_data = _storage.pread(fd, _storage.fsize(fd) - item.offset, item.offset)
        finally:
            _storage.close(fd)
        return st_load(header_and_data)[fqn].reshape(-1)
    _index_of(path, item, label)  # the archive's checks first
    fd = _storage.open_ro(path)
    try:
        blob = _storage.pread(fd, item.length, item.offset)
    finally:
        _storage.close(fd)
    return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True).reshape(-1)


# What a pickled value of a DCP folder (an optimizer's param_groups, a step counter) may be.
_PLAIN = (int, float, bool, str, type(None), bytes)


# Nodes _plain visits at most, shared ones once per path: a pickle's memo lets a few KB
# name a list nested 14 deep 40 times over (40**14 paths); torch.load builds it in 1 ms.
PLAIN_BUDGET = 100_000


class _TooBig(Exception):
    pass


def _plain(x, depth: int = 0, budget: list = None) -> bool:
    budget = [PLAIN_BUDGET] if budget is None else budget
    budget[0] -= 1
    if budget[0] < 0:
        raise _TooBig
    if type(x) in _PLAIN:
        return True
    if depth > 16:
        return False
    if type(x) in (list, tuple):
        return all(_plain(v, depth + 1, budget) for v in x)
    if type(x) is dict:
        return all(type(k) in _PLAIN and _plain(v, depth + 1, budget) for k, v in x.items())
    return False


def item_value(folder: str, fqn: str) -> object:
    """(local) The non-tensor value a DCP folder saved under ``fqn`` (a ``BytesStorageMetadata``
    item: one ``torch.save`` archive), read by the allowlisted one-pass reader only and only
    when it is plain data (numbers, strings, bools, None, lists, tuples, dicts of them).

    Raises:
        UnsafeCheckpointError: the item needs anything else (a class, a function, a tensor);
            nothing from it was built.
        CheckpointLayoutError: the item is missing or damaged.
    """
    meta = metadata_of(folder)
    item = meta.item(fqn, None)
    if item is None or fqn not in meta.values:
        raise CheckpointLayoutError(f"{meta.path}: lists no pickled value {fqn}. The .metadata is damaged: copy "
                                    "the folder again from where it was saved.")
    path = folder.rstrip("/") + "/" + item.relative_path if _storage.is_url(folder) else os.path.join(
        folder, item.relative_path)
    rel = item.relative_path
    outside = rel in ("", ".", "..") or "/" in rel or "\\" in rel or "\0" in rel or (
        not _storage.is_url(folder) and os.path.dirname(os.path.realpath(path)) != os.path.realpath(folder))
    if item.transforms or outside:
        what = ", ".join(item.transforms) or f"a path outside the folder ({item.relative_path!r})"
        raise CheckpointLayoutError(f"{item_label(path, fqn, item)}: written with {what}, which metaseq-oneload does "
                                    "not read; load it with torch.distributed.checkpoint.load.")
    label = item_label(path, fqn, item)
    try:
        key = stat_key(path)
    except OSError as e:
        raise CheckpointLayoutError(f"{label}: cannot read the file ({e.strerror or e}).") from e
    if item.offset + item.length > key[1] or _head(key, item.offset) != b"PK\x03\x04":
        raise CheckpointLayoutError(f"{label}: not a torch.save archive inside the file. The folder is damaged or "
                                    "incomplete: copy it again from where it was saved.")
    index, data = _index_of(path, item, label)
    obj, problem = header(label, index, data)
    if problem:
        raise CheckpointLayoutError(f"{label}: {problem}. The file is damaged or was edited.")
    # header() answers (None, None) both for a pickled None and for a pickle it does not read
    none = len(data) in (2, 4) and data[-2:] == b"N." and (len(data) == 2 or data[0] == 0x80)
    try:
        plain = _plain(obj)
    except _TooBig:
        raise UnsafeCheckpointError(
            f"{label}: the value saved as {fqn} holds more than {PLAIN_BUDGET} values (counting each shared "
            "list or dict once per place it appears), far more than an optimizer's param_groups; refused, "
            "nothing of it was built. Re-save it from a trusted copy.") from None
    if (obj is None and not none) or not plain:
        raise UnsafeCheckpointError(
            f"{label}: the value saved as {fqn} is not plain data (numbers, strings, bools, None, lists, tuples, dicts "
            "of them), what an optimizer's param_groups hold; refused, nothing of it was built. Re-save it from a "
            "trusted copy, or load it with torch.distributed.checkpoint.load if you trust the file.")
    return obj
