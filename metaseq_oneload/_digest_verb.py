"""``digest``: a checkpoint's content digest (``_digest.py``), computed from its bytes.

The checkpoint is planned as the full model exactly as a one-process ``load_state_dict``
returns it (model parallel 1, unflattened, padding dropped, the known renames, tied names
included), and each tensor is read in leaf-aligned chunks through the one executor
(``_execute.stream``: only the byte ranges a chunk needs). Reading stays on this thread (the
reader spreads a large read over its own threads); each chunk, once landed, is hashed on a
small pool (BLAKE3 lets go of the GIL) while the next chunk is read into another buffer, so
hashing hides behind the read.

What the set records about itself (the index beside a ``convert``/``consolidate`` output,
an ``export-hf`` folder's safetensors metadata) is a claim: it is compared with what was
computed, never used instead of reading.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Mapping, NamedTuple, Optional

import torch

from .formats import discover
from ._claims import Claim, recorded
from ._digest import LEAF, PREFIX, TensorHasher, dtype_name, model_digest, name_bytes, parse_digest, tensor_digest
from ._errors import DigestError
from ._execute import ReadItem, stream
from ._layout import CheckpointLayout
from ._options import check_option
from ._plan import TargetTensor, plan_part
from ._reading import RangeReader
from ._writing import Meter

__all__ = ["TensorDigest", "Recorded", "DigestReport", "digest", "compute", "compare_claim", "FORMAT",
           "read_digest_file", "digest_reference", "Canonical"]

_MiB = 1 << 20
FORMAT = "metaseq-oneload/digest/v1"  # the "format" field of ``digest --json``
_MAX_FILE = 256 << 20  # a digest file: 100 bytes a tensor


class TensorDigest(NamedTuple):
    """One canonical tensor: ``(name, dtype, shape, nbytes, digest)``."""

    name: str
    dtype: str
    shape: tuple
    nbytes: int
    digest: str


@dataclass(frozen=True)
class Recorded:
    """A set's recorded digests (:class:`~._claims.Claim`, a claim) against the computed ones."""

    claim: Claim
    differing: tuple = ()  # names whose recorded digest is not the computed one
    unrecorded: tuple = ()  # computed tensors the claim does not name (when it names any)
    unknown: tuple = ()  # names the claim has that the checkpoint does not
    model_matches: Optional[bool] = None  # None when no model digest was recorded

    @property
    def compared(self) -> bool:
        """Whether the claim held canonical digests to compare (not only stored ones)."""
        return self.claim.model is not None or bool(self.claim.tensors)

    @property
    def matched(self) -> bool:
        return self.model_matches is not False and not (self.differing or self.unrecorded or self.unknown)

    def to_dict(self) -> dict:
        return {"claim": self.claim.to_dict(), "compared": self.compared, "matched": self.matched,
                "differing": list(self.differing), "unrecorded": list(self.unrecorded), "unknown": list(self.unknown),
                "model_matches": self.model_matches}


@dataclass(frozen=True)
class DigestReport:
    """The result of :func:`digest`. ``match`` is what the CLI's exit code reports."""

    path: str
    model: str
    tensors: tuple  # of TensorDigest, in the checkpoint's order
    files: tuple  # ((tensor name, (file, ...)), ...): where each tensor's bytes were read
    seconds: float
    bytes_read: int
    recorded: Optional[Recorded] = None

    @property
    def match(self) -> bool:
        """False only when the set records a digest that the bytes do not have."""
        return self.recorded is None or self.recorded.matched

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def files_of(self, name: str) -> tuple:
        return dict(self.files).get(name, ())

    def to_dict(self) -> dict:
        """The ``digest --json`` document; :func:`read_digest_file` reads it back."""
        d = {"format": FORMAT, "path": self.path, "model": self.model,
             "tensors": [t._asdict() | {"shape": list(t.shape)} for t in self.tensors],
             "seconds": self.seconds, "bytes_read": self.bytes_read, "match": self.match, "recorded": None}
        if self.recorded is not None:
            d["recorded"] = self.recorded.to_dict()
        return d


def _files(t: TargetTensor) -> tuple:
    return tuple(dict.fromkeys(e.path for c in t.copies for e in c.src.extents))


class _Hashing:
    """(local) Chunks hashed on a pool, each chunk's leaves split among the threads, while
    the next chunk is read into the other buffer. Small tensors share a buffer; a buffer is
    handed back to the reader once everything hashed from it is done."""

    _ALIGN = 64  # where a tensor's bytes start in a shared buffer: any dtype can view them

    def __init__(self, threads: int, chunk: int, meter: Meter):
        self.threads = threads
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="oneload-digest")
        self.free = deque(torch.empty(chunk, dtype=torch.uint8) for _ in range(2))
        self.pending: deque = deque()  # (futures, buffer) of buffers being hashed, oldest first
        self.meter = meter
        self.buf, self.pos, self.futures = None, 0, []

    def take(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` (at most a chunk) of the buffer being filled, or of the next one."""
        if self.buf is None or self.pos + nbytes > self.buf.numel():
            self._retire()
            if not self.free:
                self._wait()
            self.buf, self.pos = self.free.popleft(), 0
        view = self.buf[self.pos: self.pos + nbytes]
        self.pos += -(-nbytes // self._ALIGN) * self._ALIGN
        return view

    def _retire(self) -> None:
        if self.buf is not None:
            self.pending.append((self.futures, self.buf))
        self.buf, self.futures = None, []

    def _wait(self) -> None:
        futures, buf = self.pending.popleft()
        for f in futures:
            f.result()
        self.free.append(buf)

    def submit(self, hasher: TensorHasher, offset: int, data: torch.Tensor) -> None:
        raw = memoryview(data.view(torch.uint8).numpy())
        last = offset + len(raw) == hasher.nbytes  # the tensor's last chunk
        # Whole leaves per thread (a chunk starts on a leaf boundary), so no fragments.
        per = max(1, -(-len(raw) // LEAF) // self.threads) * LEAF
        cuts = list(range(0, len(raw), per))

        def work(lo: int, hi: int, closing: bool) -> None:
            hasher.update(offset + lo, raw[lo:hi])
            self.meter.add(hi - lo, 1 if closing else 0)

        self.futures += [self.pool.submit(work, lo, min(len(raw), lo + per), last and lo == cuts[-1]) for lo in cuts]

    def drain(self) -> None:
        self._retire()
        while self.pending:
            self._wait()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def compute(layout: CheckpointLayout, *, chunk_mb: float = 64, threads: Optional[int] = None,
            trust_pickle: bool = False, progress=None) -> tuple:
    """(local, one process) ``(tensors, targets, bytes_read)``: the canonical digest of every
    tensor of ``layout``, as :class:`TensorDigest` in the checkpoint's order.

    Memory: two buffers of ``chunk_mb`` (rounded down to whole MiB leaves, at least one):
    one being read, one being hashed (small tensors share one); plus 32 bytes per MiB of every tensor (its leaf
    hashes, kept until the digests are combined at the end), plus what the reader holds of
    files that cannot be range-read (legacy ``torch.save`` files are read whole).
    """
    targets = plan_part(layout, 1, 0)
    threads = int(threads or min(4, os.cpu_count() or 1))
    chunk = max(LEAF, int(chunk_mb * _MiB) // LEAF * LEAF)
    real = [n for n, t in targets.items() if t.alias_of is None]
    meter = Meter(progress, sum(targets[n].nbytes for n in real), len(real), "digest")
    hashers: dict = {}
    hashing = _Hashing(threads, chunk, meter)
    try:
        with RangeReader(chunk_bytes=chunk, trust_pickle=trust_pickle) as reader:
            for n in real:
                t = targets[n]
                h = hashers[n] = TensorHasher(n, t.dtype, t.shape)
                itemsize = h.nbytes // t.numel if t.numel else 1
                per = chunk // itemsize  # a chunk starts on a leaf boundary of the tensor
                for lo in range(0, t.numel if h.nbytes else 0, per):
                    item = ReadItem(n, lo, min(t.numel, lo + per))
                    buf = hashing.take(item.numel * itemsize)
                    for got, data in stream((item,), targets, reader, buf.numel(), buf):
                        hashing.submit(h, got.start * itemsize, data)
                if not h.nbytes:
                    meter.add(0, 1)
            hashing.drain()
            bytes_read = reader.bytes_read
    finally:
        hashing.close()
        meter.close()
    out = []
    for n, t in targets.items():
        src = hashers[t.alias_of if t.alias_of is not None else n]
        d = tensor_digest(n, t.dtype, t.shape, src.leaves())
        out.append(TensorDigest(n, dtype_name(t.dtype), tuple(t.shape), src.nbytes, d))
    return tuple(out), targets, bytes_read


class Canonical:
    """(local) A layout's canonical digests, hashed from the streams of another view of it:
    ``verify`` reads metaseq's fused ``qkv_proj`` (rows k, v, q) where the canonical
    tensors of a fairseq set keep ``k/v/q_proj`` apart. Each target's byte stream is routed
    to the canonical tensors it holds: all of it, or each third of a fused projection."""

    def __init__(self, layout: CheckpointLayout, targets: Mapping[str, TargetTensor]):
        canon = plan_part(layout, 1, 0)
        self.canon = canon
        self.hashers = {n: TensorHasher(n, t.dtype, t.shape) for n, t in canon.items() if t.alias_of is None}
        self.routes: dict = {}  # target name -> ((hasher, first byte, end byte in the target's stream), ...)
        for n, t in targets.items():
            if t.alias_of is not None:
                continue
            h = self.hashers.get(n)
            if h is not None and h.shape == tuple(t.shape) and h.dtype == dtype_name(t.dtype):
                self.routes[n] = ((h, 0, h.nbytes),)
                continue
            leaf = n.rsplit(".qkv_proj.", 1)
            thirds = [self.hashers.get(f"{leaf[0]}.{k}.{leaf[1]}") for k in ("k_proj", "v_proj", "q_proj")] \
                if len(leaf) == 2 else [None]
            if all(x is not None and x.dtype == dtype_name(t.dtype) for x in thirds) and \
                    sum(x.nbytes for x in thirds) == t.nbytes:
                bounds = [0, thirds[0].nbytes, thirds[0].nbytes + thirds[1].nbytes, t.nbytes]
                self.routes[n] = tuple((x, bounds[i], bounds[i + 1]) for i, x in enumerate(thirds))

    def feed(self, name: str, offset: int, data) -> None:
        """Bytes ``data`` at ``offset`` of target ``name``'s stream, into what they belong to."""
        mv = memoryview(data).cast("B")
        for h, lo, hi in self.routes.get(name, ()):
            a, b = max(lo, offset), min(hi, offset + len(mv))
            if a < b:
                h.update(a - lo, mv[a - offset: b - offset])

    def model(self, read: "set | frozenset") -> Optional[str]:
        """The model digest, when the targets in ``read`` were read whole and cover every
        canonical tensor; else None (a tensor only one side of a comparison has is not read)."""
        covered = {id(h) for n in read for h, _, _ in self.routes.get(n, ())}
        if any(id(h) not in covered for h in self.hashers.values()):
            return None
        return model_digest({n: tensor_digest(n, t.dtype, t.shape, self.hashers[t.alias_of or n].leaves())
                             for n, t in self.canon.items()})


def compare_claim(claim: Claim, tensors: tuple) -> Recorded:
    """(local) A set's claim against the digests computed from its bytes."""
    named = dict(claim.tensors)
    computed = {t.name: t.digest for t in tensors}
    return Recorded(
        claim,
        differing=tuple(n for n in computed if n in named and named[n] != computed[n]),
        unrecorded=tuple(n for n in computed if named and n not in named),
        unknown=tuple(sorted(n for n in named if n not in computed)),
        model_matches=None if claim.model is None else claim.model == model_digest(computed),
    )


def digest(
    path: "str | os.PathLike",
    *,
    chunk_mb: float = 64,
    threads: Optional[int] = None,
    trust_pickle: bool = False,
    progress: "Optional[bool] | Callable[[int, int], None]" = None,
) -> DigestReport:
    """(local, one process) The content digest of a checkpoint of any layout (docs/digest.md).

    Every tensor is read as a one-process ``load_state_dict(path)`` returns it and hashed
    as its bytes arrive; the model digest covers every tensor (tied names too). Where the
    set records a digest (the index a ``convert``/``consolidate`` leaves, an ``export-hf``
    folder's metadata), it is compared with the computed one, never used instead.

    Args:
        path: the checkpoint (any file of the set, a folder, a prefix, a URL).
        chunk_mb: MiB read at a time; memory is two such buffers (one read, one hashed).
        threads: hashing threads (default: up to 4, one per core).
        trust_pickle: allow pickles outside the allowlist (only for checkpoints you trust).
        progress: a bar (default: when stderr is a terminal) or a callable of (bytes
            hashed so far, bytes in all).

    Returns:
        A :class:`DigestReport`; ``.match`` is False when a recorded digest differs.

    Raises:
        DigestError: a tensor's digest could not be combined (a bug, never a guess).
        OneloadError: the checkpoint cannot be read (as every verb raises).
    """
    t0 = time.perf_counter()
    check_option("chunk_mb", chunk_mb)
    check_option("threads", threads, "count")
    layout = discover(path, trust_pickle=trust_pickle)
    tensors, targets, bytes_read = compute(layout, chunk_mb=chunk_mb, threads=threads, trust_pickle=trust_pickle,
                                           progress=progress)
    model = model_digest({t.name: t.digest for t in tensors})
    claim = recorded(layout)
    files = tuple((n, _files(t)) for n, t in targets.items())
    return DigestReport(layout.display_name, model, tensors, files, time.perf_counter() - t0, bytes_read,
                        compare_claim(claim, tensors) if claim else None)


def read_digest_file(path: "str | os.PathLike") -> tuple:
    """(local) ``(model digest, {name: digest} or None, where it came from)`` from a
    ``blake3:...`` string or a file ``digest --json`` wrote. Anything else is a DigestError."""
    text = os.fspath(path)
    if text.startswith(PREFIX):
        parse_digest(text, "the digest given")
        return text, None, "a digest given, not re-read"
    try:
        with open(text, "rb") as f:
            d = json.loads(f.read(_MAX_FILE))
    except (OSError, ValueError) as e:
        raise DigestError(f"{text}: cannot read it as a digest file ({e}); expected a file written by "
                          "`metaseq-oneload digest PATH --json` or a 'blake3:<64 hex>' digest") from e
    return _from_document(d, text)


def _from_document(d, text: str) -> tuple:
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise DigestError(f"{text}: not a digest file (its \"format\" is "
                          f"{d.get('format') if isinstance(d, dict) else type(d).__name__!r}, expected "
                          f"{FORMAT!r}); write one with `metaseq-oneload digest PATH --json > FILE`")
    model = d.get("model")
    parse_digest(model, f"{text}: model digest")
    named = {}
    entries = d.get("tensors")
    if entries is not None and not isinstance(entries, list):
        raise DigestError(f"{text}: its \"tensors\" field is a {type(entries).__name__} ({str(entries)[:40]}), "
                          "expected a list of {\"name\", \"dtype\", \"shape\", \"nbytes\", \"digest\"}; "
                          "write the file again with `metaseq-oneload digest PATH --json > FILE`")
    for t in entries or ():
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise DigestError(f"{text}: a tensor entry {str(t)[:80]!r} has no name; expected "
                              "{\"name\", \"dtype\", \"shape\", \"nbytes\", \"digest\"}")
        try:
            name_bytes(t["name"])
        except DigestError as e:
            raise DigestError(f"{text}: {e}") from None
        parse_digest(t.get("digest"), f"{text}: digest of {t['name']!r}")
        named[t["name"]] = t["digest"]
    if named and model_digest(named) != model:
        raise DigestError(f"{text}: its model digest {model} is not the one its tensor digests give "
                          f"({model_digest(named)}); the file was edited or damaged: write it again")
    return model, named or None, f"{text} (the digest of {d.get('path')!s} by metaseq-oneload digest, not re-read)"


def digest_reference(other: "str | os.PathLike") -> Optional[tuple]:
    """(local) :func:`read_digest_file`'s answer when ``other`` is a digest (a ``blake3:``
    string, or a JSON file whose ``format`` is a digest file's), else None: a checkpoint."""
    text = os.fspath(other)
    if text.startswith(PREFIX):
        return read_digest_file(text)
    if not (text.endswith(".json") and os.path.isfile(text)):
        return None
    try:
        with open(text, "rb") as f:
            d = json.loads(f.read(_MAX_FILE))
    except (OSError, ValueError):
        return None  # not ours to judge: the checkpoint readers say what it is
    if isinstance(d, dict) and str(d.get("format", "")).startswith("metaseq-oneload/digest/"):
        return _from_document(d, text)
    return None
