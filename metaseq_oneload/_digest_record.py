"""Digests a writer records: the content identity of what it wrote, hashed as the bytes pass.

``convert``, ``consolidate`` and ``export-hf`` write every tensor from the chunks the one
executor streams (:mod:`._writing`); a :class:`WriteDigests` sees each chunk on its way to the
file (``executor_chunks(..., tap=...)``) and hashes it into the leaves of every digest it
belongs to (:mod:`._digest`), so digesting costs no read. A chunk is a contiguous run of one
output tensor's elements; it is *routed* to

* the output's stored tensor (per model part: the digest a digest-checked load compares its
  reads with), at the run's own byte offset;
* a canonical tensor (the logical tensor an MP=1 ``load_state_dict`` returns), at that offset
  plus the tensor's place in it: 0 for most, ``j x nbytes`` for the ``j``-th of a split
  k/v/q projection of a fused ``qkv_proj``; a tied alias gets its source's bytes under its own
  name.

Where two routes of a run are a whole number of leaves apart, the leaves are hashed once and
shifted (the stored and the canonical digest of an MP=1 output cost one hash of each byte).

Memory: 32 bytes per leaf of every digest, plus the boundary fragments (< 1 MiB each, two per
run at most) of leaves whose other bytes are still to come; a leaf is hashed and its fragments
dropped as soon as it is complete (:class:`_Joiner`), so a flat shard set holds, at most, one
leaf per FSDP group per shard boundary not yet written on both sides.

Canonical digests need every byte of a canonical tensor to pass through one writer process. A
row-parallel weight of a model-parallel output is interleaved row by row across part files
that independent jobs write in any order, so for outputs with more than one model part the
canonical digests are not computed (stored digests are); ``metaseq-oneload digest`` computes
them by reading the set.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from typing import Callable, Mapping, Optional, Sequence

import blake3
import torch

from ._digest import LEAF, PREFIX, TensorHasher, dtype_name, leaf_hashes, model_digest, tensor_bytes
from ._errors import DigestError
from ._placement import split_qkv_name

__all__ = ["WriteDigests", "ExportDigests", "canonical_routes", "with_stored_digests"]


class _Joiner:
    """(local, thread-safe) A :class:`TensorHasher` that hashes a leaf as soon as its
    fragments cover it, so fragments are held only while a leaf waits for its other side."""

    def __init__(self, name: str, dtype: torch.dtype, shape: Sequence[int], part: Optional[int]):
        self.hasher = TensorHasher(name, dtype, shape, part=part)
        self.nbytes = self.hasher.nbytes
        self._pending: dict = {}  # leaf index -> [(offset, bytes)]
        self._lock = threading.Lock()

    def add(self, leaves: Mapping[int, bytes], fragments: Sequence[tuple]) -> None:
        if leaves:
            self.hasher.add_leaves(leaves)
        for off, data in fragments:
            if off < 0 or off + len(data) > self.nbytes:
                self.hasher.add_fragment(off, data)  # raises, naming the tensor
            i = off // LEAF
            want = min(LEAF, self.nbytes - i * LEAF)
            with self._lock:
                frags = self._pending.setdefault(i, [])
                frags.append((off, data))
                if sum(len(d) for _, d in frags) < want:
                    continue
                del self._pending[i]
            frags.sort(key=lambda f: f[0])
            pos, ok = i * LEAF, True
            for o, d in frags:
                ok = ok and o == pos
                pos += len(d)
            if ok and pos == i * LEAF + want:
                self.hasher.add_leaves(leaf_hashes(i * LEAF, b"".join(d for _, d in frags))[0]
                                       if want == LEAF else {i: _short_leaf(b"".join(d for _, d in frags))})
            else:  # overlapping or doubled bytes: the hasher's digest() says so
                for o, d in frags:
                    self.hasher.add_fragment(o, d)

    def digest(self) -> str:
        with self._lock:
            pending, self._pending = self._pending, {}
        for frags in pending.values():
            for o, d in frags:
                self.hasher.add_fragment(o, d)
        return self.hasher.digest()


def _short_leaf(data: bytes) -> bytes:
    """The hash of a tensor's last leaf, shorter than ``LEAF`` (``leaf_hashes`` hands it
    over as a fragment: it cannot know where the stream ends)."""
    return blake3.blake3(data).digest()


class WriteDigests:
    """(local, thread-safe) The digests of what one writer process writes, fed by the
    chunks of its records as they pass (:meth:`tap`), in any order, from any thread.

    ``stored(part, name, ...)`` and ``canonical(name, ...)`` declare a digest; ``route``
    sends the elements of read items named ``item`` (in output ``part``'s sources) to it at
    a byte offset ``base``. Items that no route names (optimizer state) are not hashed.
    """

    def __init__(self):
        self._stored: dict = {}  # (part, name) -> _Joiner
        self._canonical: dict = {}  # name -> _Joiner
        self._routes: dict = {}  # (part, item name) -> [(joiner, base bytes, shard or None)]

    def stored(self, part: int, name: str, dtype: torch.dtype, shape: Sequence[int], *, multi_part: bool) -> _Joiner:
        j = self._stored[(part, name)] = _Joiner(name, dtype, shape, part if multi_part else None)
        return j

    def canonical(self, name: str, dtype: torch.dtype, shape: Sequence[int]) -> _Joiner:
        j = self._canonical[name] = _Joiner(name, dtype, shape, None)
        return j

    def route(self, part: int, item: str, joiner: _Joiner, base: int = 0, *, shard: Optional[int] = None) -> None:
        """Send items ``item`` of output ``part`` (of its file ``shard`` only, where every
        shard file holds the whole tensor: a flat set's buffers) to ``joiner`` at ``base``."""
        self._routes.setdefault((part, item), []).append((joiner, int(base), shard))

    def joiner(self, name: str) -> _Joiner:
        """The canonical digest ``name`` declared."""
        return self._canonical[name]

    @property
    def has_canonical(self) -> bool:
        return bool(self._canonical)

    def drop_canonical(self) -> None:
        """Stop computing the canonical digests (they cannot all be had from this stream)."""
        gone = set(map(id, self._canonical.values()))
        self._canonical = {}
        for key, rs in self._routes.items():
            self._routes[key] = [r for r in rs if id(r[0]) not in gone]

    def tap(self, part: int, shard: int = 0) -> Callable:
        """The callable ``executor_chunks`` gives every chunk of output (``part``, ``shard``)'s
        records: ``(item, data)``, ``data`` the 1-D elements ``item.start..item.stop`` of
        ``item.name``."""

        def tap(item, data: torch.Tensor) -> None:
            routes = [(j, b) for j, b, s in self._routes.get((part, item.name), ()) if s is None or s == shard]
            if routes:
                self.feed(routes, item.start * data.element_size(), tensor_bytes(data))

        return tap

    @staticmethod
    def feed(routes: Sequence[tuple], offset: int, view: memoryview) -> None:
        """Hash ``view`` (bytes at ``offset`` of the item's stream) into each route, once per
        leaf alignment."""
        done: dict = {}  # leaf alignment -> (base, leaves, fragments) hashed at it
        for joiner, base in routes:
            key = (offset + base) % LEAF
            if key not in done:
                done[key] = (base, *leaf_hashes(offset + base, view))
            b0, leaves, frags = done[key]
            shift = base - b0
            if shift:
                leaves = {i + shift // LEAF: h for i, h in leaves.items()}
                frags = [(o + shift, d) for o, d in frags]
            joiner.add(leaves, frags)

    def spec(self, part: int, name: str) -> Optional[tuple]:
        """(dtype name, shape) a stored digest was declared with, or None."""
        j = self._stored.get((part, name))
        return None if j is None else (j.hasher.dtype, j.hasher.shape)

    def stored_digests(self) -> dict:
        """{(part, name): stored digest}; DigestError when a tensor's bytes did not all pass."""
        return {k: j.digest() for k, j in self._stored.items()}

    def mismatch(self, expected: Mapping) -> Optional[str]:
        """Why the canonical digests declared do not describe the tensors ``expected`` (name ->
        planned tensor of the written set's own MP=1 plan: what ``load_state_dict`` returns), or None."""
        have = {n: (j.hasher.dtype, j.hasher.shape) for n, j in self._canonical.items()}
        want = {n: (dtype_name(t.dtype), tuple(t.shape)) for n, t in expected.items()}
        if have == want:
            return None
        differ = sorted(n for n in set(have) | set(want) if have.get(n) != want.get(n))
        return (f"the written set loads as other tensors than were hashed ({', '.join(differ[:3])}"
                f"{' ...' if len(differ) > 3 else ''})")

    def canonical_digests(self) -> Optional[dict]:
        """{"model": ..., "tensors": {name: digest}}, or None when none were declared."""
        if not self._canonical:
            return None
        tensors = {n: j.digest() for n, j in self._canonical.items()}
        return {"model": model_digest(tensors), "tensors": dict(sorted(tensors.items()))}


def canonical_routes(digests: WriteDigests, canon: Mapping, written: Mapping, *, part: int = 0,
                     item: Callable[[str], str] = str, once: Sequence[str] = ()) -> list:
    """Declare the canonical tensors ``canon`` (name -> ``TargetTensor`` of an MP=1 plan,
    ``alias_of`` for tied names) and route to them the output tensors ``written`` (name ->
    planned tensor whose elements are written under read items ``item(name)``): a tensor of
    the same name, shape and dtype lands at offset 0; a split ``k/v/q_proj`` at its third of
    the fused ``qkv_proj``. Names in ``once`` are written whole into every shard file: hashed
    from shard 0's. Returns the canonical names no written tensor covers (their bytes must be
    streamed separately, or the canonical digests dropped)."""
    joiners = {}
    for n, c in canon.items():
        if c.alias_of is None:
            joiners[n] = digests.canonical(n, c.dtype, c.shape)
    covered: dict = {}  # canonical name -> bytes routed
    sources: dict = {}  # canonical name -> [(item, base, shard)]
    for n, t in written.items():
        if getattr(t, "alias_of", None) is not None:
            continue
        c = canon.get(n)
        if c is not None and c.alias_of is None and tuple(c.shape) == tuple(t.shape) and c.dtype == t.dtype:
            target, base = n, 0
        else:
            split = split_qkv_name(n)
            c = canon.get(split[0]) if split else None
            if c is None or c.alias_of is not None or c.dtype != t.dtype or c.shape[0] != 3 * t.shape[0] \
                    or tuple(c.shape[1:]) != tuple(t.shape[1:]):
                continue
            target, base = split[0], split[1] * t.nbytes
        shard = 0 if n in once else None
        digests.route(part, item(n), joiners[target], base, shard=shard)
        sources.setdefault(target, []).append((item(n), base, shard))
        covered[target] = covered.get(target, 0) + t.nbytes
    for n, c in canon.items():  # a tied name hashes its source's bytes under its own name
        if c.alias_of is not None and c.alias_of in joiners:
            j = digests.canonical(n, c.dtype, c.shape)
            for it, base, shard in sources.get(c.alias_of, ()):
                digests.route(part, it, j, base, shard=shard)
            covered[n] = covered.get(c.alias_of, 0)
    return [n for n, c in canon.items()
            if covered.get(n, 0) != (canon[c.alias_of] if c.alias_of else c).nbytes]


def with_stored_digests(layout, stored: Mapping, digests: WriteDigests):
    """(local) ``layout`` (the set just written, as discovery describes it) with each stored
    tensor's ``digest`` set from ``stored`` ({(part, name): digest}) where it was hashed as
    that very tensor (same name, part, dtype and shape)."""
    parts = []
    for p in layout.parts:
        tensors = {}
        for n, t in p.tensors.items():
            d = stored.get((t.part, n))
            if d is not None and digests.spec(t.part, n) == (dtype_name(t.dtype), tuple(t.shape)):
                t = dataclasses.replace(t, digest=d)
            tensors[n] = t
        parts.append(dataclasses.replace(p, tensors=tensors))
    return dataclasses.replace(layout, parts=tuple(parts))


_PLACEHOLDER = PREFIX + "0" * 64
# Canonical tensors an export does not write (buffers such as decoder.version) are read for the
# source digest when they are this small a share of the source; otherwise (dtype= changed the
# bytes) the source digest is left out.
_EXTRA_SHARE = 0.01


class ExportDigests:
    """(local) What export-hf records in every file's ``__metadata__`` (docs/digest.md):

    ``oneload.tensor_digests``: {Hugging Face name: digest} of the file's tensors (a one-part
    set: stored digest = canonical); ``oneload.digest``: the model digest of all exported
    tensors; ``oneload.source_digest``: the source checkpoint's content digest (metaseq names,
    fused ``qkv_proj``: an MP=1 ``load_state_dict`` of the source), hashed from the same bytes
    where the export writes them unchanged (k/v/q at their thirds of ``qkv_proj``, tied names
    from their source), plus a read of the few small tensors OPT has no place for.
    """

    def __init__(self, plan):
        from ._plan import plan_part

        self.written = WriteDigests()
        for t in plan.tensors:
            self.written.route(0, t.name, self.written.stored(0, t.name, t.dtype, t.shape, multi_part=False))
        self.source = WriteDigests()
        self.canon = plan_part(plan.layout, 1, 0)
        hf = {t.source.name: t.name for t in plan.tensors}
        self.extra = canonical_routes(self.source, self.canon, {t.source.name: t.source for t in plan.tensors},
                                      item=hf.get)
        extra_bytes = sum(self.canon[n].nbytes for n in self.extra)
        self.notes: tuple = ()
        if extra_bytes > _EXTRA_SHARE * max(1, sum(c.nbytes for c in self.canon.values() if c.alias_of is None)):
            self.source.drop_canonical()
            self.extra = []
            self.notes = ("no oneload.source_digest recorded: the exported bytes are not the source's (dtype=); "
                          "`metaseq-oneload digest SOURCE` computes it",)
        for n in self.extra:  # read separately, under their own names
            self.source.route(1, n, self.source.joiner(n))
        self.digests: dict = {}
        self.model: Optional[str] = None
        self.source_digest: Optional[str] = None

    def tap(self, item, data: torch.Tensor) -> None:
        self.written.tap(0)(item, data)
        self.source.tap(0)(item, data)

    def finish(self, reader, chunk_bytes: int) -> None:
        """Read what the source digest still needs, then compute every digest."""
        from ._execute import ReadItem, stream

        source_tap = self.source.tap(1)
        for item, data in stream([ReadItem(n, 0, self.canon[n].numel) for n in self.extra], self.canon, reader,
                                 chunk_bytes):
            source_tap(item, data)
        self.digests = {n: d for (_, n), d in self.written.stored_digests().items()}
        self.model = model_digest(self.digests)
        try:
            content = self.source.canonical_digests()
        except DigestError as e:  # never a wrong claim: none
            content = None
            self.notes += (f"no oneload.source_digest recorded: {e}",)
        self.source_digest = content["model"] if content else None

    def placeholder(self, group) -> dict:
        """Metadata of the same length as :meth:`metadata`'s, to reserve the header's room."""
        return self._metadata(group, {t.name: _PLACEHOLDER for t in group}, _PLACEHOLDER,
                              _PLACEHOLDER if self.source.has_canonical else None)

    def metadata(self, group) -> dict:
        return self._metadata(group, self.digests, self.model, self.source_digest)

    def folder_metadata(self) -> dict:
        """The folder's digests, for ``model.safetensors.index.json``'s ``metadata``."""
        return {k: v for k, v in (("oneload.digest", self.model), ("oneload.source_digest", self.source_digest)) if v}

    @staticmethod
    def _metadata(group, digests: Mapping, model: str, source: Optional[str]) -> dict:
        md = {"oneload.digest": model,
              "oneload.tensor_digests": json.dumps({t.name: digests[t.name] for t in group}, separators=(",", ":"))}
        if source is not None:
            md["oneload.source_digest"] = source
        return md
