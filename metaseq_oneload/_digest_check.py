"""A load that checks what it read against the set's recorded digests (``verify="digest"``).

A digest recorded beside a set (``StoredTensor.digest``: the signed index ``convert`` and
``consolidate`` write; ``export-hf``'s safetensors metadata, :func:`with_claims`) is a claim;
this module checks it against the bytes a load reads, and reads nothing twice to do so:

* each reading rank hashes the stored bytes it reads as they land, on the thread that read
  them (:class:`Hashing` wraps the load's reader; ``RangeReader`` hands each piece to a
  sink before any cast): the 1 MiB leaves wholly inside a contiguous read, and at most two
  boundary fragments per read (``_digest.leaf_hashes``); fragments that complete a leaf on
  this rank are joined and hashed at once (:class:`Pieces`), so a rank holds fragments only
  of leaves whose other bytes another rank read (or a piece still in flight);
* :func:`check` gathers every rank's leaves and fragments (over the data-parallel group,
  then the model-parallel group: a stored tensor's bytes may have been read by ranks of
  several target parts), and each stored tensor is combined and compared on one rank, the
  tensors spread over the readers of every group. What one rank sends is 40 bytes per leaf
  it hashed, plus its fragments (< 1 MiB each, at most two per contiguous run it read);
  every rank receives the sum of those over the world: about ``model bytes / 26000`` plus
  the fragments (a 2 GiB model: ~82 KiB of leaves);
* bytes of a read tensor that no rank read (a target that covers a stored tensor in part)
  are read by its checker, so every leaf is hashed exactly once; a leaf read whole twice,
  or the same fragment bytes read twice, must agree (a leaf read whole once and in part
  again is checked through its whole read);
* a mismatch is a :class:`DigestError` on every rank, naming the tensor, the file(s) and
  byte ranges that hold it, and what to do; a set with no recorded digests fails before
  any tensor is read.
"""

from __future__ import annotations

import dataclasses
import functools
import struct
import threading
from typing import Iterator, Mapping, Optional, Sequence

import torch

from ._claims import recorded
from ._digest import LEAF, leaf_hashes, tensor_digest
from ._dist import Group, settle
from ._errors import DigestError, DistributedLoadError, cap_list
from ._execute import read_stored
from ._layout import CheckpointLayout, StoredTensor

__all__ = ["Hashing", "Pieces", "check", "claims_missing", "settle_digest", "stored_tensors", "with_claims"]

_HOW = ("`metaseq-oneload convert` records digests in the index it writes beside its output; "
        "`metaseq-oneload digest PATH` computes a set's digest from its bytes")


def stored_tensors(layout: CheckpointLayout) -> list:
    """(local) Every stored tensor of the layout, in the one order every rank numbers them."""
    return [t for p in layout.parts for _, t in sorted(p.tensors.items())]


def with_claims(layout: Optional[CheckpointLayout]) -> Optional[CheckpointLayout]:
    """(local) ``layout``, its stored tensors carrying the digests a one-part set records
    outside an index too (``export-hf``'s safetensors metadata, ``convert``'s safetensors
    sidecar): there a stored tensor is the canonical one, and the claim names it so."""
    if layout is None or layout.model_parallel_size != 1 or all(t.digest for t in stored_tensors(layout)):
        return layout
    claim = recorded(layout)
    named = dict(claim.tensors) if claim is not None else {}
    if not named:
        return layout
    part = layout.parts[0]
    tensors = {n: t if t.digest or n not in named else dataclasses.replace(t, digest=named[n])
               for n, t in part.tensors.items()}
    return dataclasses.replace(layout, parts=(dataclasses.replace(part, tensors=tensors),) + layout.parts[1:])


def claims_missing(layout: Optional[CheckpointLayout], path) -> Optional[DigestError]:
    """(local) Why ``layout`` cannot be checked by digest (no recorded digest for some
    tensors), or None. Checked before any tensor is read."""
    if layout is None:
        return None
    missing = [t.name if layout.model_parallel_size == 1 else f"{t.name} (part {t.part})"
               for t in stored_tensors(layout) if not t.digest]
    if not missing:
        return None
    where = (f"the index beside it ({layout.index})" if layout.index
             else "no index beside it (or one that was not used: see inspect's warnings)")
    if len(missing) == len(stored_tensors(layout)):
        what = "records no digest for any of its tensors"
    else:
        what = f"records no digest for {len(missing)} tensor(s) ({cap_list(missing)})"
    return DigestError(f"verify='digest': {path}: {where} {what}, so its tensors cannot be "
                       f"checked. Nothing was loaded. {_HOW}; or load with verify=False or verify=True.")


class Pieces:
    """(local) What is known of one stored tensor's byte stream: leaf hashes by index,
    fragments of leaves held in part, and conflicts (a leaf read twice that differed)."""

    def __init__(self, t: StoredTensor):
        self.nbytes = t.nbytes
        self.count = -(-self.nbytes // LEAF)
        self.leaves: dict = {}
        self.frags: dict = {}  # leaf index -> [(offset, bytes)]
        self.conflicts: set = set()
        self.lock = threading.Lock()

    def add_range(self, offset: int, view) -> None:
        """Hash bytes found at ``offset`` (any thread; hashing runs outside the lock)."""
        mv = memoryview(view).cast("B")
        tail = self.nbytes % LEAF
        last = None
        # The stream's end is a leaf boundary too: a read reaching it hashes the short last leaf.
        if tail and len(mv) >= tail and offset + len(mv) == self.nbytes and offset <= self.nbytes - tail:
            last = _hash(mv[len(mv) - tail:])
            mv = mv[: len(mv) - tail]
        leaves, frags = leaf_hashes(offset, mv)
        if last is not None:
            leaves[self.count - 1] = last
        whole = []
        with self.lock:
            for i, h in leaves.items():
                self._leaf(i, h)
            for off, data in frags:
                i = off // LEAF
                held = self.frags.setdefault(i, [])
                held.append((off, data))
                if self._complete(i, held):  # joined at once: fragments held stay bounded
                    whole.append(self.frags.pop(i))
        for held in whole:
            h = _hash(b"".join(d for _, d in sorted(held, key=lambda f: f[0])))
            with self.lock:
                self._leaf(held[0][0] // LEAF, h)

    def _complete(self, i: int, held: list) -> bool:
        """Whether ``held`` covers leaf ``i`` exactly once (overlaps wait for :meth:`join`)."""
        pos, stop = i * LEAF, min((i + 1) * LEAF, self.nbytes)
        if sum(len(d) for _, d in held) != stop - pos:
            return False
        for off, data in sorted(held, key=lambda f: f[0]):
            if off != pos:
                return False
            pos += len(data)
        return pos == stop

    def _leaf(self, i: int, h: bytes) -> None:
        old = self.leaves.get(i)
        if old is not None and old != h:
            self.conflicts.add(i)
        self.leaves[i] = h

    def join(self) -> None:
        """Hash every leaf whose fragments cover it; merge the others' fragments."""
        with self.lock:
            for i in list(self.frags):
                lo, hi = i * LEAF, min((i + 1) * LEAF, self.nbytes)
                buf = bytearray(hi - lo)
                spans: list = []  # covered (start, stop), relative to lo, sorted, disjoint
                for off, data in sorted(self.frags[i], key=lambda f: f[0]):
                    a, b = off - lo, off - lo + len(data)
                    for s0, s1 in spans:  # overlapping bytes from two reads must agree
                        o0, o1 = max(a, s0), min(b, s1)
                        if o0 < o1 and bytes(buf[o0:o1]) != data[o0 - a: o1 - a]:
                            self.conflicts.add(i)
                    buf[a:b] = data
                    spans = _merge(spans + [(a, b)])
                if spans == [(0, hi - lo)]:
                    del self.frags[i]
                    self._leaf(i, _hash(buf))
                else:
                    self.frags[i] = [(lo + s0, bytes(buf[s0:s1])) for s0, s1 in spans]

    def missing(self) -> list:
        """Byte ranges [a, b) of the stream no piece covers (after :meth:`join`)."""
        out: list = []
        for i in range(self.count):
            if i in self.leaves:
                continue
            lo, hi = i * LEAF, min((i + 1) * LEAF, self.nbytes)
            pos = lo
            for off, data in sorted(self.frags.get(i, ())):
                if off > pos:
                    out.append((pos, off))
                pos = max(pos, off + len(data))
            if pos < hi:
                out.append((pos, hi))
        return _merge(out)

    def bytes_held(self) -> int:
        return sum(min(LEAF, self.nbytes - i * LEAF) for i in self.leaves) + sum(
            len(d) for f in self.frags.values() for _, d in f)


def _hash(data) -> bytes:
    import blake3

    return blake3.blake3(data).digest()


def _merge(spans: Sequence) -> list:
    out: list = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


class Hashing:
    """(local) The load's reader, hashing every stored byte it reads into :class:`Pieces`,
    on the thread that read it. Anything else is the wrapped reader's."""

    def __init__(self, inner, layout: CheckpointLayout):
        self.inner = inner
        self.chunk_bytes = inner.chunk_bytes
        self.read_threads = getattr(inner, "read_threads", 1)
        self.tensors = stored_tensors(layout)
        self.pieces: dict = {}  # tensor number -> Pieces
        self._where: dict = {}  # Extent -> [(tensor number, its first element's place in the tensor)]
        for tid, t in enumerate(self.tensors):
            pos = 0
            for e in t.extents:
                self._where.setdefault(e, []).append((tid, pos))
                pos += e.numel
        self._lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _pieces(self, tid: int) -> Pieces:
        with self._lock:
            p = self.pieces.get(tid)
            if p is None:
                p = self.pieces[tid] = Pieces(self.tensors[tid])
            return p

    def read_extent(self, ext, start: int, out: torch.Tensor, dtype: torch.dtype) -> None:
        at = self._where.get(ext)
        if not at:  # not a stored tensor of the layout's parts (nothing recorded for it)
            self.inner.read_extent(ext, start, out, dtype)
            return
        size = torch.empty((), dtype=dtype).element_size()
        self.inner.read_extent(ext, start, out, dtype, sink=self._sink(at, start, size))

    def _sink(self, where: Sequence[tuple], first: int, size: int):
        """What hashes the bytes read from element ``first`` of an extent on, into the pieces of
        every stored tensor ``where`` lists there."""
        return functools.partial(_feed, [(self._pieces(tid), (pos + first) * size) for tid, pos in where])

    reads_runs = True  # fill_all's runs come here, with their extents, not to the inner reader

    def read_runs(self, runs: Sequence[tuple], progress=None) -> None:
        """(local: this thread and the inner reader's pool) ``runs`` of
        ``(path, offset, out, extent, its first element)`` (``byte_runs(..., sources=True)``),
        read in file order by the inner reader and hashed as each piece lands, as
        :meth:`read_extent` hashes."""
        plain, sinks = [], []
        for path, offset, out, ext, at in runs:
            plain.append((path, offset, out))
            where = self._where.get(ext)
            sinks.append(self._sink(where, at, out.element_size()) if where else None)
        self.inner.read_runs(plain, progress, sinks=sinks)


def _feed(into: list, off: int, view) -> None:
    for p, base in into:
        p.add_range(base + off, view)


class _Into:
    """(local) Reads the rest of one stored tensor into its :class:`Pieces` (its checker)."""

    def __init__(self, inner, t: StoredTensor, pieces: Pieces):
        self.inner, self.t, self.pieces = inner, t, pieces
        self.chunk_bytes = inner.chunk_bytes
        self.size = torch.empty((), dtype=t.dtype).element_size()

    def read_extent(self, ext, start: int, out: torch.Tensor, dtype: torch.dtype) -> None:
        pos = 0
        for e in self.t.extents:
            if e is ext:
                break
            pos += e.numel
        base = (pos + start) * self.size
        self.inner.read_extent(ext, start, out, dtype, sink=lambda off, v: self.pieces.add_range(base + off, v))


# --------------------------------------------------------------------------- the wire

_HEAD = struct.Struct("<IIII")  # tensor number, leaves, fragments, conflicting leaves
_LEAF = struct.Struct("<Q")
_FRAG = struct.Struct("<QI")


def _encode(pieces: Mapping[int, Pieces]) -> bytes:
    out = []
    for tid, p in sorted(pieces.items()):
        p.join()
        frags = [f for i in sorted(p.frags) for f in p.frags[i]]
        out.append(_HEAD.pack(tid, len(p.leaves), len(frags), len(p.conflicts)))
        for i, h in sorted(p.leaves.items()):
            out += [_LEAF.pack(i), h]
        for off, data in frags:
            out += [_FRAG.pack(off, len(data)), data]
        out += [_LEAF.pack(i) for i in sorted(p.conflicts)]
    return b"".join(out)


def _decode(blob: bytes, keep, tensors: Sequence[StoredTensor]) -> tuple:
    """({tensor number: Pieces} for the numbers ``keep`` accepts, every number seen)."""
    got: dict = {}
    seen: set = set()
    for tid, rec in _records(blob):
        seen.add(tid)
        if keep(tid):
            p = got.get(tid)
            if p is None:
                p = got[tid] = Pieces(tensors[tid])
            _parse(rec, p)
    return got, seen


def _records(blob: bytes) -> Iterator[tuple]:
    """(tensor number, a view of its encoded record) of every record in ``blob`` (:func:`_encode`'s): the
    one walk of the format, which routing (the records whole) and :func:`_decode` share."""
    pos, mv = 0, memoryview(blob)
    while pos < len(blob):
        try:
            tid, nl, nf, nc = _HEAD.unpack_from(blob, pos)
            end = pos + _HEAD.size + nl * 40
            for _ in range(nf):
                end += _FRAG.size + _FRAG.unpack_from(blob, end)[1]
            end += nc * _LEAF.size
        except struct.error:  # a header past the end
            end = None
        if end is None or end > len(blob):  # (a view would stop at the blob's end, silently short)
            raise RuntimeError(f"digest check: the record at byte {pos} runs past the end of the {len(blob)} "
                               "bytes of leaves the peers sent")
        yield tid, mv[pos:end]
        pos = end


def _parse(rec: memoryview, p: Pieces) -> None:
    """Add one record's leaves, fragments and conflicting leaves to ``p``."""
    _, nl, nf, nc = _HEAD.unpack_from(rec, 0)
    pos = _HEAD.size
    for _ in range(nl):
        p._leaf(_LEAF.unpack_from(rec, pos)[0], bytes(rec[pos + 8: pos + 40]))
        pos += 40
    for _ in range(nf):
        off, n = _FRAG.unpack_from(rec, pos)
        p.frags.setdefault(off // LEAF, []).append((off, bytes(rec[pos + 12: pos + 12 + n])))
        pos += 12 + n
    for _ in range(nc):
        p.conflicts.add(_LEAF.unpack_from(rec, pos)[0])
        pos += 8


# --------------------------------------------------------------------------- the check


def check(dp: Group, mp: Group, layout: Optional[CheckpointLayout], hashing: Optional[Hashing],
          readers: Sequence[int], reader, path) -> tuple:
    """(collective over ``mp``, then ``dp``) Send each read stored tensor's leaves to the one
    rank that checks it: over ``mp`` to the model-parallel rank ``tid % mp_size``, then over
    that rank's ``dp`` to its reader ``(tid // mp_size) % len(readers)``, and check them there
    against the recorded digest. (In that order: ``readers``, the ranks of a data-parallel group
    that see the files, differ between groups, and the second step uses the checker's group's
    own.) Returns
    (this rank's DigestError or other failure, or None; how many stored tensors the load
    checked in all). Never raises but for a lost peer.

    Each rank sends only what its checkers need (an all-to-all): the partial leaves at a
    rank's ends of every flat parameter (up to 1 MiB each) went to every rank before, padded
    to the largest rank's (35 MB received by each rank of a 2 GiB model on 4 ranks)."""
    error = None
    mp_size, mp_rank = (mp.size, mp.rank) if mp.active else (1, 0)
    dp_size, dp_rank = (dp.size, dp.rank) if dp.active else (1, 0)
    readers = list(readers) or [dp_rank]

    def checker(tid: int) -> int:
        return readers[(tid // mp_size) % len(readers)]

    def mine_(tid: int) -> bool:
        return tid % mp_size == mp_rank and checker(tid) == dp_rank

    try:
        pieces = hashing.pieces if hashing is not None else {}
        to_mp = [_encode({tid: p for tid, p in pieces.items() if tid % mp_size == m}) for m in range(mp_size)]
    except Exception as e:  # still take part: the others wait in the exchanges
        error, to_mp = e, [b""] * mp_size
    mp.at(f"loading {path}: checking digests (sending leaves to their checkers)")
    got_mp = b"".join(mp.exchange_bytes(to_mp))
    try:  # (a rank that cannot see the files forwards what it got, as any other)
        to_dp = [b"".join(rec for tid, rec in _records(got_mp) if checker(tid) == d) for d in range(dp_size)]
    except Exception as e:
        error, to_dp = error or e, [b""] * dp_size
    dp.at(f"loading {path}: checking digests (sending leaves to their checkers)")
    blob = b"".join(dp.exchange_bytes(to_dp))
    try:
        tensors = stored_tensors(layout) if layout is not None else ()
        # (a rank that cannot see the files reads nothing and checks nothing)
        got, seen = _decode(blob, mine_ if layout is not None else (lambda tid: False), tensors)
        if layout is not None and any(not mine_(tid) for tid in seen):
            raise RuntimeError(f"digest check: leaves of tensors {sorted(t for t in seen if not mine_(t))[:5]} "
                               "reached a rank that does not check them")
    except Exception as e:
        error, got, seen = error or e, {}, set()
    # every tensor's leaves end on one rank: the load's count is the sum of the ranks'
    checked = sum(mp.all_gather_json(len(seen))) if mp.active and mp.size > 1 else len(seen)
    checked = sum(dp.all_gather_json(checked)) if dp.active and dp.size > 1 else checked
    if error is not None:
        return error, 0
    try:
        bad = []
        for tid, p in sorted(got.items()):
            why = _check_one(layout, tensors[tid], p, reader)
            if why:
                bad.append(why)
        if bad:
            more = f" (and {len(bad) - 3} more tensor(s))" if len(bad) > 3 else ""
            return DigestError("verify='digest': " + "; ".join(bad[:3]) + more + ". " + _FIX), checked
        return None, checked
    except Exception as e:
        return e, 0


_FIX = ("The file(s) changed since the digests were recorded, or the index's claim is wrong: nothing loaded "
        "here can be trusted; copy the set again from its source (or run again the conversion that wrote it). "
        "`metaseq-oneload digest PATH` computes the set's digest from its bytes.")


def _check_one(layout: CheckpointLayout, t: StoredTensor, p: Pieces, reader) -> Optional[str]:
    """(local) Why stored tensor ``t`` fails its check, or None. Reads what no rank read."""
    p.join()
    size = torch.empty((), dtype=t.dtype).element_size()
    step = max(1, reader.chunk_bytes // size)
    into = _Into(reader, t, p)
    for a, b in p.missing():
        for e0 in range(a // size, -(-b // size), step):
            e1 = min(-(-b // size), e0 + step)
            read_stored(t, e0, torch.empty(e1 - e0, dtype=t.dtype), into)
    p.join()
    where = t.name if layout.model_parallel_size == 1 else f"{t.name} (model part {t.part})"
    if p.conflicts:
        i = min(p.conflicts)
        return (f"{where}: bytes {i * LEAF}..{min((i + 1) * LEAF, p.nbytes)} of it were read twice and differed "
                f"(in {_files(t, i * LEAF, min((i + 1) * LEAF, p.nbytes))}): a file changed during the load")
    got = tensor_digest(t.name, t.dtype, t.shape, p.leaves, part=t.part if layout.model_parallel_size > 1 else None)
    if got == t.digest:
        return None
    claimed = (f"the index beside the set ({layout.index})" if layout.index
               else "the set's own metadata (export-hf's safetensors header)")
    return (f"{where} ({str(t.dtype).replace('torch.', '')} {list(t.shape)}): its bytes hash to {got}, {claimed} "
            f"records {t.digest}; the tensor lies in {_files(t, 0, p.nbytes)}")


def _files(t: StoredTensor, a: int, b: int) -> str:
    """Where bytes ``a..b`` of stored tensor ``t`` lie: file name and byte range, by file."""
    import os

    size = torch.empty((), dtype=t.dtype).element_size()
    runs, pos = [], 0
    for e in t.extents:
        lo, hi = max(a, pos * size), min(b, (pos + e.numel) * size)
        if lo < hi:
            name = os.path.basename(e.path)
            if e.byte_offset is None:
                runs.append(f"{name} ({e.key.replace(chr(0), '.')}, elements {lo // size}..{hi // size})")
            else:
                f0 = e.byte_offset + lo - pos * size
                runs.append(f"{name} bytes {f0}..{f0 + hi - lo}")
        pos += e.numel
    return cap_list(runs, 4, sep="; ")


def settle_digest(groups: Sequence[Group], error: Optional[BaseException], what: str) -> None:
    """(collective over every group given) ``settle``, raising a :class:`DigestError` on
    every rank where the failure was one (a digest mismatch is no lost rank)."""
    try:
        settle(groups, error, what)
    except DistributedLoadError as e:
        if any(str(m).startswith("DigestError") for m in e.failures.values()):
            d = DigestError(str(e))
            d.settled = True
            raise d from e
        raise
