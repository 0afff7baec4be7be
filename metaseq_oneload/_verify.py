"""``verify``: two checkpoints of any layouts compared tensor by tensor, streaming both.

Both sides are planned as the full model (model parallel 1, unflattened, metaseq's names,
split ``k/v/q_proj`` fused into ``qkv_proj``), then each tensor is read one chunk of each side
at a time: each side is a list of read items that the one executor (``_execute.stream``:
only the byte ranges a chunk needs) carries out into the running comparison. Identical
bytes need no arithmetic, the common case after a conversion; otherwise the chunk is
compared in float64.

Both sides' bytes are hashed as they pass (``_digest``), so the report carries each side's
content digest. ``other`` may also be a digest (``blake3:...``, or a file ``digest --json``
wrote): then only ``path`` is read, and its digests are compared with the given ones. What a
set records about itself is reported as a claim next to what its bytes were found to hold.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .formats import discover
from ._claims import recorded
from ._digest import model_digest
from ._digest_verb import Canonical, compute, digest_reference
from ._execute import ReadItem, stream
from ._options import check_option
from ._plan import TargetTensor, plan_part
from ._reading import RangeReader
from ._writing import Meter

__all__ = ["TensorDiff", "VerifyReport", "verify"]

_MiB = 1 << 20


@dataclass(frozen=True)
class TensorDiff:
    """How one tensor of ``a`` differs from the same tensor of ``b``."""

    name: str
    shape: tuple
    dtype_a: str
    dtype_b: str
    max_abs: float  # max |a - b| (inf where only one side is NaN or infinite)
    max_rel: float  # max |a - b| / |b| over elements with a finite, non-zero b
    mismatched: int  # elements with |a - b| > atol + rtol * |b| (NaN == NaN counts as equal)
    identical: bool  # same dtype and the same bytes

    @property
    def numel(self) -> int:
        return math.prod(self.shape) if self.shape else 1


@dataclass(frozen=True)
class VerifyReport:
    """The result of :func:`verify`; ``match`` is what the CLI's exit code reports."""

    a: str
    b: str
    source_a: str
    source_b: str
    atol: float
    rtol: float
    diffs: tuple  # of TensorDiff, in a's order
    only_in_a: tuple
    only_in_b: tuple
    shape_mismatches: tuple  # (name, shape in a, shape in b)
    seconds: float
    digest_a: Optional[str] = None  # a's content digest (None: not every tensor of a was read)
    digest_b: Optional[str] = None  # b's, computed from its bytes or (against_digest) as given
    against_digest: bool = False  # b is a digest given, not a checkpoint: only a was read
    digest_mismatches: tuple = ()  # names whose digests differ (against a digest that names tensors)
    claims: tuple = ()  # (side, source, writer, recorded model digest, whether a's/b's bytes have it)

    @property
    def match(self) -> bool:
        if self.against_digest:
            return self.digest_a == self.digest_b and not (self.only_in_a or self.only_in_b or self.digest_mismatches)
        return not (self.only_in_a or self.only_in_b or self.shape_mismatches
                    or any(d.mismatched for d in self.diffs))

    @property
    def identical(self) -> bool:
        if self.against_digest:
            return self.match
        return self.match and all(d.identical for d in self.diffs)

    @property
    def elements(self) -> int:
        return sum(d.numel for d in self.diffs)

    def largest(self, n: int = 10) -> list:
        """The ``n`` tensors with the largest absolute difference, largest first."""
        return sorted(self.diffs, key=lambda d: (-d.max_abs if not math.isnan(d.max_abs) else -math.inf, d.name))[:n]

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(match=self.match, identical=self.identical, elements=self.elements,
                 mismatched_tensors=sum(1 for x in self.diffs if x.mismatched))
        return d



class _Scratch:
    """Buffers reused for every chunk of every tensor: fresh pages cost more than the
    arithmetic on many machines. ``elements`` per chunk: each side's raw bytes (8 bytes an
    element at most) and four float64 work arrays, 48 bytes an element in all."""

    BYTES_PER_ELEMENT = 2 * 8 + 4 * 8

    def __init__(self, elements: int):
        self.elements = elements
        self.raw_a = torch.empty(elements * 8, dtype=torch.uint8)
        self.raw_b = torch.empty(elements * 8, dtype=torch.uint8)
        self._f64: list = []

    def f64(self, i: int, n: int) -> torch.Tensor:
        while len(self._f64) <= i:
            self._f64.append(torch.empty(self.elements, dtype=torch.float64))
        return self._f64[i][:n]


class _Comparison:
    """(local) The comparison sink: the running difference of one tensor, a chunk of each
    side at a time."""

    def __init__(self, atol: float, rtol: float, scratch: _Scratch, same_dtype: bool):
        self.atol, self.rtol, self.scratch = atol, rtol, scratch
        self.max_abs, self.max_rel, self.bad = 0.0, 0.0, 0
        self.identical = same_dtype

    def add(self, xa: torch.Tensor, xb: torch.Tensor) -> None:
        if xa.dtype == xb.dtype and torch.equal(xa.view(torch.uint8), xb.view(torch.uint8)):
            return  # the common case after a conversion: no arithmetic needed
        self.identical = False
        da, db, diff, tmp = (self.scratch.f64(i, xa.numel()) for i in range(4))
        da.copy_(xa)
        db.copy_(xb)
        torch.sub(da, db, out=diff).abs_()
        diff.masked_fill_(torch.eq(da, db), 0.0)  # equal infinities
        diff.masked_fill_(da.isnan().logical_and_(db.isnan()), 0.0)  # NaN equals NaN
        diff.nan_to_num_(nan=math.inf)  # NaN on one side only, or inf - inf
        torch.abs(db, out=tmp)
        nonzero = (tmp != 0).logical_and_(tmp.isfinite())
        if bool(nonzero.any()):
            self.max_rel = max(self.max_rel, float((diff[nonzero] / tmp[nonzero]).max()))
        tmp.mul_(self.rtol).add_(self.atol).nan_to_num_(nan=0.0, posinf=0.0)  # no tolerance against NaN or inf
        self.bad += int((diff > tmp).sum())
        self.max_abs = max(self.max_abs, float(diff.max()))


def _compare(name: str, ta: TargetTensor, tb: TargetTensor, ra: RangeReader, rb: RangeReader, atol: float,
             rtol: float, scratch: _Scratch, ca: Canonical, cb: Canonical) -> TensorDiff:
    """(local) One tensor: both sides' read items carried out by the executor in chunks of
    the same elements (each side's buffer sized for its dtype), into the comparison and
    each side's canonical digests."""
    items = (ReadItem(name, 0, ta.numel),)
    n = scratch.elements
    ia, ib = _itemsize(ta.dtype), _itemsize(tb.dtype)
    side_a = stream(items, {name: ta}, ra, n * ia, scratch.raw_a[: n * ia])
    side_b = stream(items, {name: tb}, rb, n * ib, scratch.raw_b[: n * ib])
    sink = _Comparison(atol, rtol, scratch, ta.dtype == tb.dtype)
    for (got_a, xa), (got_b, xb) in zip(side_a, side_b):
        if got_a != got_b:  # the same elements of both sides, or nothing is compared
            raise RuntimeError(f"{name}: chunks {got_a} and {got_b} do not line up")
        sink.add(xa, xb)
        ca.feed(name, got_a.start * ia, xa.view(torch.uint8).numpy())
        cb.feed(name, got_b.start * ib, xb.view(torch.uint8).numpy())
    return TensorDiff(name, tuple(ta.shape), str(ta.dtype).replace("torch.", ""), str(tb.dtype).replace("torch.", ""),
                      sink.max_abs, sink.max_rel, sink.bad, sink.identical)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def verify(
    path: "str | os.PathLike",
    other: "str | os.PathLike",
    *,
    atol: float = 1e-8,
    rtol: float = 1e-5,
    chunk_mb: float = 64,
    trust_pickle: bool = False,
    progress: "Optional[bool] | Callable[[int, int], None]" = None,
) -> VerifyReport:
    """(local, one process) Compare the weights of two checkpoints of any layouts.

    Both are read as the full (model parallel 1, unflattened) model with metaseq's names
    (split ``k/v/q_proj`` fused to ``qkv_proj``), tensor by tensor, one chunk of each at a
    time. A tensor matches when every element satisfies ``|a - b| <= atol + rtol * |b|``
    (``torch.allclose``'s rule; NaN equals NaN), ``a`` from ``path`` and ``b`` from
    ``other``. Optimizer state is not compared.

    Both sides' bytes are hashed as they are compared: the report gives each side's content
    digest (docs/digest.md) where every tensor of it was read. ``other`` may instead be a
    digest, ``blake3:...`` or a file written by ``metaseq-oneload digest --json``: then only
    ``path`` is read, and it matches when its digest is the one given (tolerances do not
    apply; a digest file that lists tensors lets the report name the ones that differ).
    What a set records about its own content is reported as a claim (``claims``) beside
    what its bytes hold, and never read instead of them.

    Memory: ``chunk_mb`` of scratch in all (``chunk_mb / 48`` elements a chunk: both sides'
    raw bytes and four float64 work arrays), plus each side's reader staging of at most
    a chunk's raw bytes where a dtype is cast, plus under 1 MiB a side for a partial digest
    leaf. ``progress``: a bar (default: when stderr is a terminal) or a callable of (bytes
    compared so far, bytes in all).

    Returns:
        A :class:`VerifyReport`; ``.match`` is True when the names, shapes and every value
        agree (against a digest: when ``path``'s digest is the one given).
    """
    t0 = time.perf_counter()
    check_option("atol", atol)
    check_option("rtol", rtol)
    check_option("chunk_mb", chunk_mb)
    reference = digest_reference(other)
    if reference is not None:
        return _against_digest(path, reference, float(atol), float(rtol), chunk_mb, trust_pickle, progress, t0)
    la, lb = discover(path, trust_pickle=trust_pickle), discover(other, trust_pickle=trust_pickle)
    ta, tb = plan_part(la, 1, 0, qkv="fused"), plan_part(lb, 1, 0, qkv="fused")
    only_a = tuple(n for n in ta if n not in tb)
    only_b = tuple(n for n in tb if n not in ta)
    common = [n for n in ta if n in tb]
    shapes = tuple((n, tuple(ta[n].shape), tuple(tb[n].shape)) for n in common if tuple(ta[n].shape) != tuple(tb[n].shape))
    bad_shape = {s[0] for s in shapes}
    todo = [n for n in common if n not in bad_shape]
    scratch = _Scratch(max(1 << 13, int(chunk_mb * _MiB) // _Scratch.BYTES_PER_ELEMENT))
    meter = Meter(progress, sum(ta[n].nbytes + tb[n].nbytes for n in todo), len(todo), "verify")
    diffs = []
    ca, cb = Canonical(la, ta), Canonical(lb, tb)  # each side's digests, as `digest` gives them
    try:
        with RangeReader(chunk_bytes=scratch.raw_a.numel(), trust_pickle=trust_pickle) as ra, \
                RangeReader(chunk_bytes=scratch.raw_b.numel(), trust_pickle=trust_pickle) as rb:
            for n in todo:
                diffs.append(_compare(n, ta[n], tb[n], ra, rb, atol, rtol, scratch, ca, cb))
                meter.add(ta[n].nbytes + tb[n].nbytes, 1)
    finally:
        meter.close()
    # A side's digest covers all its tensors, or it is not given.
    digest_a, digest_b = ca.model(set(todo)), cb.model(set(todo))
    claims = _claims("a", la, digest_a) + _claims("b", lb, digest_b)
    return VerifyReport(la.display_name, lb.display_name, _desc(la), _desc(lb), float(atol), float(rtol), tuple(diffs),
                        only_a, only_b, shapes, time.perf_counter() - t0, digest_a, digest_b, claims=claims)


def _desc(layout) -> str:
    return f"{layout.model_parallel_size}x{layout.shards_per_part} {'flat' if layout.flat else 'unflattened'}"


def _claims(side: str, layout, computed: Optional[str]) -> tuple:
    """(local) What ``layout``'s set records about its content, and whether its bytes have it."""
    c = recorded(layout)
    if c is None or c.model is None:
        return ()
    return ((side, c.source, c.writer, c.model, None if computed is None else c.model == computed),)


def _against_digest(path, reference: tuple, atol: float, rtol: float, chunk_mb: float, trust_pickle: bool,
                    progress, t0: float) -> VerifyReport:
    """(local, one process) ``path``'s digests computed from its bytes, against a digest
    given (``(model, {name: digest} or None, where it came from)``): nothing else is read."""
    model, named, source = reference
    la = discover(path, trust_pickle=trust_pickle)
    tensors, _, _ = compute(la, chunk_mb=chunk_mb, trust_pickle=trust_pickle, progress=progress)
    computed = {t.name: t.digest for t in tensors}
    digest_a = model_digest(computed)
    only_a = only_b = differ = ()
    if named is not None:
        only_a = tuple(n for n in computed if n not in named)
        only_b = tuple(n for n in named if n not in computed)
        differ = tuple(n for n in computed if n in named and named[n] != computed[n])
    return VerifyReport(la.display_name, source, _desc(la), "digest", atol, rtol, (), only_a, only_b, (),
                        time.perf_counter() - t0, digest_a, model, True, differ, _claims("a", la, digest_a))
