"""The content digest: one value per tensor and per model, the same whatever the layout.

The definition (``docs/digest.md`` states it for reimplementers; this module is it):

* a tensor's canonical bytes are the row-major bytes of the whole logical tensor, cut into
  leaves of ``LEAF`` (1 MiB) bytes, the last one shorter; a 0-byte tensor has no leaves;
* ``leaf_i = BLAKE3(chunk_i)``; tensor digest = ``BLAKE3(b"metaseq-oneload/tensor/v1\\n" + H
  + b"\\n" + leaf_0 + leaf_1 + ...)``, ``H`` the compact, key-sorted JSON of name, dtype,
  shape, nbytes, leaf size (and ``part`` for a stored tensor of a multi-part set);
* model digest = ``BLAKE3(b"metaseq-oneload/model/v1\\n" + name + b"\\0" + tensor_digest ...)``
  over the tensors in sorted name order; written ``blake3:`` + 64 hex characters.

Leaves are independent, so any holder of a contiguous byte range of a tensor hashes the
leaves wholly inside it and hands over at most two boundary fragments; whoever combines
joins fragments by offset (:class:`TensorHasher`). A leaf missing or given twice is a
:class:`DigestError`, never a guess. Every function here is (local): no collective.
"""

from __future__ import annotations

import json
import math
import threading
from typing import Iterable, Mapping, Optional, Sequence, Union

import blake3

from ._errors import DigestError

__all__ = [
    "LEAF",
    "PREFIX",
    "TensorHasher",
    "digest_tensor",
    "dtype_name",
    "format_digest",
    "leaf_hashes",
    "model_digest",
    "name_bytes",
    "parse_digest",
    "tensor_bytes",
    "tensor_digest",
]

LEAF = 1 << 20
PREFIX = "blake3:"
_TENSOR_TAG = b"metaseq-oneload/tensor/v1\n"
_MODEL_TAG = b"metaseq-oneload/model/v1\n"
_SIZE = 32


def format_digest(raw: bytes) -> str:
    """``blake3:`` + 64 lowercase hex characters, from 32 raw bytes. (local)"""
    return PREFIX + bytes(raw).hex()


def parse_digest(text: str, what: str = "digest") -> bytes:
    """The 32 raw bytes of a ``blake3:<64 hex>`` string; anything else is a DigestError. (local)"""
    if isinstance(text, str) and text.startswith(PREFIX):
        body = text[len(PREFIX):]
        if len(body) == 2 * _SIZE:
            try:
                return bytes.fromhex(body)
            except ValueError:
                pass
    shown = repr(text) if len(repr(text)) <= 90 else repr(text)[:87] + "..."
    raise DigestError(f"{what}: found {shown}, expected {PREFIX!r} followed by 64 hex "
                      "characters (as `metaseq-oneload digest` prints)")


def dtype_name(dtype) -> str:
    """A dtype's canonical name: torch's name without ``torch.`` (``"float16"``). (local)"""
    import torch

    name = str(dtype)
    name = name[len("torch."):] if name.startswith("torch.") else name
    if not isinstance(getattr(torch, name, None), torch.dtype):
        raise DigestError(f"dtype {dtype!r} is not a torch dtype; expected a name such as "
                          "'float16' or 'bfloat16'")
    return str(getattr(torch, name))[len("torch."):]  # aliases (half) take their canonical name


def _nbytes(dtype: str, shape: Sequence[int]) -> int:
    import torch

    return math.prod(shape) * getattr(torch, dtype).itemsize


def _header(name: str, dtype: str, shape: Sequence[int], nbytes: int, part: Optional[int]) -> bytes:
    h = {"name": name, "dtype": dtype, "shape": list(shape), "nbytes": nbytes, "leaf": LEAF}
    if part is not None:
        h["part"] = part
    return json.dumps(h, sort_keys=True, separators=(",", ":")).encode("utf-8")


def _leaf(data) -> bytes:
    return blake3.blake3(data).digest()


def leaf_hashes(offset: int, data) -> "tuple[dict[int, bytes], list[tuple[int, bytes]]]":
    """Hash the leaves of the bytes ``data`` found at ``offset`` of a tensor's stream. (local)

    Returns ``(leaves, fragments)``: the 32-byte hash of each leaf wholly inside the range,
    by leaf index, and the bytes of the (at most two) leaves it covers only in part, as
    ``(absolute offset, bytes)``. The GIL is released while hashing, so threads scale.
    """
    mv = memoryview(data).cast("B")
    end = offset + len(mv)
    leaves: dict = {}
    fragments: list = []
    first = -(-offset // LEAF) * LEAF  # the first leaf boundary at or after offset
    if first >= end:
        if len(mv):
            fragments.append((offset, bytes(mv)))
        return leaves, fragments
    if first > offset:
        fragments.append((offset, bytes(mv[: first - offset])))
    pos = first
    while pos + LEAF <= end:
        leaves[pos // LEAF] = _leaf(mv[pos - offset: pos - offset + LEAF])
        pos += LEAF
    if pos < end:
        fragments.append((pos, bytes(mv[pos - offset:])))
    return leaves, fragments


class TensorHasher:
    """The digest of one tensor from pieces of its byte stream, fed in any order. (local)

    ``update(offset, data)`` hashes a contiguous range (thread-safe: hashing runs outside
    the lock); ``add_leaves`` / ``add_fragment`` take what another holder hashed with
    :func:`leaf_hashes`. ``digest()`` needs every leaf exactly once. The last leaf of a
    tensor is shorter than ``LEAF``; a range that reaches it whole hashes it as a leaf.
    Fragments that complete a leaf are hashed and dropped at once: fed in order, in pieces
    of any size, a hasher holds at most one partial leaf (under 1 MiB) and 32 bytes a leaf.
    """

    def __init__(self, name: str, dtype, shape: Sequence[int], part: Optional[int] = None):
        self.name = str(name)
        self.dtype = dtype_name(dtype)
        self.shape = tuple(int(s) for s in shape)
        self.part = part
        self.nbytes = _nbytes(self.dtype, self.shape)
        self.count = -(-self.nbytes // LEAF)
        self._leaves: dict = {}
        self._fragments: dict = {}  # leaf index -> [(offset, bytes)]
        self._duplicates: set = set()
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return (f"TensorHasher({self.name!r}, {self.dtype}, {list(self.shape)}, "
                f"{len(self._leaves)}/{self.count} leaves)")

    def _where(self) -> str:
        return self.name if self.part is None else f"{self.name} (model part {self.part})"

    def _check_range(self, offset: int, size: int) -> None:
        if offset < 0 or offset + size > self.nbytes:
            raise DigestError(
                f"{self._where()}: bytes [{offset}, {offset + size}) fed to its digest, "
                f"expected a range inside its {self.nbytes} bytes ({self.dtype} "
                f"{list(self.shape)}); this is a bug in the caller")

    def update(self, offset: int, data) -> None:
        """Hash the bytes ``data`` found at byte ``offset`` of the tensor's stream."""
        mv = memoryview(data).cast("B")
        self._check_range(offset, len(mv))
        # The stream's end is a leaf boundary too: a range reaching it hashes the short last
        # leaf itself instead of handing it over as a fragment.
        tail = self.nbytes % LEAF
        if tail and len(mv) and offset <= self.nbytes - tail and offset + len(mv) == self.nbytes:
            head, last = mv[: len(mv) - tail], mv[len(mv) - tail:]
            leaves, fragments = leaf_hashes(offset, head)
            leaves[self.count - 1] = _leaf(last)
        else:
            leaves, fragments = leaf_hashes(offset, mv)
        self.add_leaves(leaves)
        for off, frag in fragments:
            self.add_fragment(off, frag)

    def add_leaves(self, leaves: Mapping[int, bytes]) -> None:
        """Take leaf hashes by index (as :func:`leaf_hashes` returns them)."""
        with self._lock:
            for i, h in leaves.items():
                if not 0 <= i < self.count or len(h) != _SIZE:
                    raise DigestError(f"{self._where()}: leaf {i} of {len(h)} bytes given, "
                                      f"expected an index below {self.count} and 32 bytes")
                if i in self._leaves:
                    self._duplicates.add(i)
                self._leaves[i] = bytes(h)

    def add_fragment(self, offset: int, data) -> None:
        """Take bytes of a leaf that a holder had only in part, at their absolute offset."""
        data = bytes(data)
        self._check_range(offset, len(data))
        if not data:
            return
        i = offset // LEAF
        if (offset + len(data) - 1) // LEAF != i:
            raise DigestError(f"{self._where()}: fragment [{offset}, {offset + len(data)}) "
                              "crosses a leaf boundary; expected bytes of one leaf")
        size = min(LEAF, self.nbytes - i * LEAF)
        with self._lock:
            frags = self._fragments.setdefault(i, [])
            frags.append((offset, data))
            if sum(len(d) for _, d in frags) != size:
                return
            del self._fragments[i]  # complete: hash it now, so an in-order stream holds one partial leaf
        try:
            h = self._join(i, frags)
        except DigestError:  # overlapping pieces: left for digest() to report
            with self._lock:
                self._fragments.setdefault(i, []).extend(frags)
            return
        with self._lock:
            if i in self._leaves:
                self._duplicates.add(i)
            self._leaves[i] = h

    def _join(self, i: int, frags: list) -> bytes:
        start, stop = i * LEAF, min((i + 1) * LEAF, self.nbytes)
        pos, parts = start, []
        for off, data in sorted(frags, key=lambda f: f[0]):
            if off != pos:
                what = "gives twice" if off < pos else "misses"
                raise DigestError(f"{self._where()}: leaf {i}'s fragments {what} bytes "
                                  f"[{min(off, pos)}, {max(off, pos)}); every byte of a leaf "
                                  "must be given exactly once")
            parts.append(data)
            pos += len(data)
        if pos != stop:
            raise DigestError(f"{self._where()}: leaf {i} is missing bytes [{pos}, {stop})")
        return _leaf(b"".join(parts))

    def digest(self) -> str:
        """The tensor digest; DigestError when a leaf is missing or was given twice."""
        return tensor_digest(self.name, self.dtype, self.shape, self.leaves(), part=self.part)

    def leaves(self) -> list:
        """Every leaf hash in order, fragments joined; DigestError as :meth:`digest`. A
        tied name (one tensor under two names) reuses them: only the header differs."""
        with self._lock:
            leaves = dict(self._leaves)
            duplicates = set(self._duplicates)
            fragments = {i: list(f) for i, f in self._fragments.items()}
        duplicates |= set(fragments) & set(leaves)
        if duplicates:
            raise DigestError(f"{self._where()}: leaves {_ranges(duplicates)} given more than "
                              "once; each leaf must come from exactly one holder")
        for i, frags in fragments.items():
            leaves[i] = self._join(i, frags)
        missing = set(range(self.count)) - set(leaves)
        if missing:
            raise DigestError(f"{self._where()}: {self.nbytes} bytes need leaves 0-{self.count - 1}; "
                              f"missing {_ranges(missing)}")
        return [leaves[i] for i in range(self.count)]


def _ranges(indices: Iterable[int], cap: int = 5) -> str:
    out, items = [], sorted(indices)
    while items and len(out) < cap:
        lo = hi = items.pop(0)
        while items and items[0] == hi + 1:
            hi = items.pop(0)
        out.append(str(lo) if lo == hi else f"{lo}-{hi}")
    return ", ".join(out) + (", ..." if items else "")


def tensor_digest(name: str, dtype, shape: Sequence[int],
                  leaves: "Union[Mapping[int, bytes], Sequence[bytes]]",
                  part: Optional[int] = None) -> str:
    """A tensor's digest from all its leaf hashes (by index, or a list in order). (local)"""
    dtype = dtype_name(dtype)
    shape = tuple(int(s) for s in shape)
    nbytes = _nbytes(dtype, shape)
    count = -(-nbytes // LEAF)
    if not isinstance(leaves, Mapping):
        leaves = dict(enumerate(leaves))
    where = name if part is None else f"{name} (model part {part})"
    if set(leaves) != set(range(count)):
        missing = set(range(count)) - set(leaves)
        extra = set(leaves) - set(range(count))
        raise DigestError(f"{where}: {nbytes} bytes need leaves 0-{count - 1}; "
                          + (f"missing {_ranges(missing)}" if missing else "")
                          + ("; " if missing and extra else "")
                          + (f"unexpected {_ranges(extra)}" if extra else ""))
    h = blake3.blake3(_TENSOR_TAG)
    h.update(_header(str(name), dtype, shape, nbytes, part))
    h.update(b"\n")
    for i in range(count):
        if len(leaves[i]) != _SIZE:
            raise DigestError(f"{where}: leaf {i} has {len(leaves[i])} bytes, expected 32")
        h.update(leaves[i])
    return format_digest(h.digest())


def name_bytes(name: str) -> bytes:
    """A tensor name as the model digest writes it (UTF-8), or DigestError for a name it
    cannot write: one holding NUL (its separator) or a lone surrogate (no UTF-8). (local)"""
    if not isinstance(name, str):
        raise DigestError(f"tensor name {name!r} is a {type(name).__name__}, expected a string")
    if "\0" in name:
        raise DigestError(f"tensor name {name!r} contains a NUL character, which the model "
                          "digest uses as its separator; rename the tensor")
    try:
        return name.encode("utf-8")
    except UnicodeEncodeError:
        raise DigestError(f"tensor name {name!r} is not valid Unicode (it holds a lone surrogate), "
                          "so it has no UTF-8 bytes for the model digest; rename the tensor") from None


def model_digest(tensors: Mapping[str, str]) -> str:
    """The model digest over ``{name: tensor digest}``, in sorted name order. (local)"""
    h = blake3.blake3(_MODEL_TAG)
    for name in sorted(tensors):
        h.update(name_bytes(name) + b"\0" + parse_digest(tensors[name], f"digest of {name!r}"))
    return format_digest(h.digest())


def tensor_bytes(tensor) -> memoryview:
    """A tensor's canonical bytes: row-major, as stored (little-endian hosts). (local)"""
    import torch

    t = tensor.detach()
    if t.layout != torch.strided or t.is_quantized:
        raise DigestError(f"a {t.layout} tensor has no canonical bytes; expected a dense tensor")
    t = t.cpu().contiguous().reshape(-1)
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


def digest_tensor(name: str, tensor, part: Optional[int] = None) -> str:
    """The digest of a tensor held in memory: the reference every other path is tested
    against. (local)"""
    data = tensor_bytes(tensor)
    leaves = [_leaf(data[i: i + LEAF]) for i in range(0, len(data), LEAF)]
    return tensor_digest(name, tensor.dtype, tuple(tensor.shape), leaves, part=part)
