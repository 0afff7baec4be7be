"""The verbs: :func:`load_state_dict`, :func:`load_checkpoint` and :func:`load_into`.

One engine serves them all. Each rank states what it wants as a list of :class:`Want`
(a target tensor, an element range of it, and the memory to fill); the engine agrees on
the layout with the other ranks, picks a strategy, and fills the wants:

``own_shard``
    The saved layout matches the world (same model-parallel size, one saved shard per
    data-parallel rank, same flattening): each rank reads only its own file.
    Peak extra CPU memory per rank = its output, ``B / (M' * W)`` for ``flat=True``
    (``B`` model bytes, ``M'`` target model-parallel size, ``W`` data-parallel size).
``reshard``
    Any saved shard count D onto any W, any saved model-parallel size onto any M': each
    rank reads exactly the byte ranges its wants cover, from whichever files hold them,
    with ``os.preadv`` straight into the destination (padding handled exactly).
    Peak extra = output + at most one staging chunk (``chunk_mb``, only for dtype/device
    conversion or a row-parallel weight whose model-parallel split changes).
``broadcast``
    On request (``auto`` sends ranks that cannot see the files to ``parallel``, which reads
    on every rank that can): data-parallel rank 0 of each
    model-parallel part reads (byte ranges, as above) and broadcasts buckets of at most
    ``bucket_mb``; receivers copy what they need out of each bucket (or, for ``flat=False``,
    receive straight into their output tensors).
    Peak extra = output + one bucket, on the reader and on every receiver.
``parallel``
    Read once, exchange: every byte some rank wants is read by one rank that sees the files
    (one that wants it where it can, balanced by bytes) and sent point to point to the
    others, a node's share crossing the network once (see ``_exchange``). ``auto`` picks it
    when ranks on different nodes want the same bytes (``flat=False``, replicated tensors)
    from shared storage (a network filesystem, an object store), or some cannot see the
    files; ``own_shard`` and ``reshard`` read bytes wanted by several ranks the same way.
    Ranks of one node whose page cache holds the files (checked:
    ``_exchange.page_cache_view``, ``cached_nodes``) each read what they want through it,
    so inside a node nothing travels but what crossed into it; a node with a copy on a disk
    of its own (``private_nodes``) reads what its ranks want there, and nothing crosses
    into it. Asked for by name, it reads every byte once in all, inside a node and across
    own copies too. Storage bytes read, summed over the cluster = the model's bytes (not W
    times; once per copy where nodes have their own). Peak extra = output + at most one
    bucket of staging per rank, + the node's shared-memory slots.

With no process group at all everything runs locally in one process (no collectives).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from ._dist import Group, PeerFailure, arrival_timeout, arrive, clip, first_failure, settle, tell_failed, tell_left
from ._exchange import (cached_nodes, chunk_bytes_for, exchange_loop, node_key, overlap, page_cache_view, plan_exchange,
                        private_nodes)
from ._errors import (CheckpointLayoutError, CheckpointNotFoundError, OneloadError, OptionError, StateDictMismatchError,
                      cap_list)
from ._layout import CheckpointLayout, StoredTensor
from .formats import adopt, discover, to_wire
from ._plan import BlockCopy, FlatCopy, FlatStructure, TargetTensor, flat_shard_range, plan_part, qkv_naming
from ._reading import RangeReader
from ._execute import fill, fill_all
from ._storage import is_url

__all__ = ["LoadReport", "LoadedCheckpoint", "load_state_dict", "load_checkpoint", "load_into", "STRATEGIES"]

logger = logging.getLogger("metaseq_oneload")

STRATEGIES = ("auto", "own_shard", "reshard", "broadcast", "parallel")
_ALIGN = 64


@dataclass(frozen=True)
class Want:
    """This rank needs elements ``start .. start + out.numel()`` of target ``name``
    (flattened) written into 1-D ``out``."""

    name: str
    start: int
    out: torch.Tensor

    @property
    def stop(self) -> int:
        return self.start + self.out.numel()


@dataclass(frozen=True)
class LoadReport:
    """What a load did, for logs, the demo table and tests."""

    path: str
    kind: str
    saved_model_parallel: int
    saved_shards: int
    saved_flat: bool
    target_model_parallel: int
    target_world: int
    flat: bool
    strategy: str
    reason: str
    bytes_read: int
    bytes_out: int
    seconds: float
    verified: bool = False
    bytes_received: int = 0  # from other ranks (parallel, broadcast)
    bytes_from_other_nodes: int = 0  # of bytes_received, what crossed between nodes
    bytes_sent: int = 0
    warnings: tuple = field(default=())
    unloaded: tuple = field(default=())  # load_into, strict=False: module tensors the checkpoint lacks

    def line(self) -> str:
        return (f"oneload: strategy={self.strategy} ({self.reason}); saved {self.saved_model_parallel}x"
                f"{self.saved_shards} {'flat' if self.saved_flat else 'unflattened'} -> target "
                f"{self.target_model_parallel}x{self.target_world} {'flat' if self.flat else 'unflattened'}")


@dataclass(frozen=True)
class LoadedCheckpoint:
    """The result of :func:`load_checkpoint`: this rank's model state dict and, for
    ``flat=True``, the fairscale ``shard_metadata`` that describes it."""

    model: "OrderedDict[str, torch.Tensor]"
    shard_metadata: Optional[dict]
    layout: Optional[CheckpointLayout]
    report: LoadReport


@dataclass(frozen=True)
class _Options:
    strategy: str = "auto"
    bucket_mb: float = 256
    chunk_mb: float = 64
    verify: bool = False
    trust_pickle: bool = False
    qkv: str = "auto"
    rules: Optional[Mapping] = None
    dtype: Optional[torch.dtype] = None
    progress: "Optional[bool] | Callable[[int], None]" = None
    arrival_timeout: Optional[float] = None  # seconds; None: $METASEQ_ONELOAD_ARRIVAL_TIMEOUT or 300

    def __post_init__(self):
        object.__setattr__(self, "arrival_timeout", arrival_timeout(self.arrival_timeout))
        if self.strategy not in STRATEGIES:
            raise OptionError(f"strategy={self.strategy!r}: expected one of {', '.join(STRATEGIES)}.")
        check_option("bucket_mb", self.bucket_mb)
        check_option("chunk_mb", self.chunk_mb)

    @property
    def bucket_bytes(self) -> int:
        return max(_ALIGN, int(self.bucket_mb * (1 << 20)) // _ALIGN * _ALIGN)

    @property
    def chunk_bytes(self) -> int:
        return max(1 << 16, int(self.chunk_mb * (1 << 20)))



# How each numeric option is checked, wherever it is taken (load, plan, convert, verify,
# export-hf and their flags): (what it must be, the test, an example of a good value).
_CHECKS = {
    "mb": ("a positive number of MiB", lambda v: 0 < v < float("inf"), "64"),
    "count": ("a whole number of at least 1", lambda v: v >= 1 and float(v).is_integer(), "4"),
    "tolerance": ("a finite number of at least 0", lambda v: 0 <= v < float("inf"), "1e-5"),
    "top": ("a whole number of at least 0", lambda v: v >= 0 and float(v).is_integer(), "10"),
}
_KINDS = {"bucket_mb": "mb", "chunk_mb": "mb", "jobs": "count", "world": "count", "model_parallel": "count",
          "shards": "count", "atol": "tolerance", "rtol": "tolerance", "top": "top"}


def check_option(name: str, value, kind: Optional[str] = None):
    """``value`` if option ``name`` may take it, else an :class:`OptionError` that names it
    as the API spells it, with the command line's flag in the ``(CLI: ...)`` form the CLI
    shows instead. ``None`` (the default) is always allowed."""
    if value is None:
        return value
    what, ok, example = _CHECKS[kind or _KINDS[name]]
    try:
        good = not isinstance(value, bool) and bool(ok(float(value)))
    except (TypeError, ValueError, OverflowError):
        good = False
    if not good:
        flag = "--" + name.replace("_", "-")
        shown = f"{value:g}" if isinstance(value, float) else str(value)
        raise OptionError(f"{name}={value!r} (CLI: {flag} {shown}): expected {what}, e.g. {name}={example} "
                          f"(CLI: {flag} {example}). Nothing was read or written.")
    return value


class _MmapReader:
    """Reads the same elements through ``torch.load(mmap=True)``: the independent path
    ``verify=True`` checks the byte arithmetic against."""

    def __init__(self, inner: RangeReader):
        self.inner = inner
        self.chunk_bytes = inner.chunk_bytes

    def read_extent(self, ext, start, out, dtype):
        out.copy_(self.inner.read_from_mmap(ext, start, out.numel()))


def _fingerprint(target: TargetTensor, start: int, stop: int, reader, chunk_bytes: int,
                 dtype: Optional[torch.dtype] = None) -> float:
    """float64 sum of ``target`` elements ``start..stop`` read through ``reader``, as they
    look once cast to ``dtype`` (the destination's; default the target's)."""
    itemsize = torch.empty((), dtype=target.dtype).element_size()
    step = max(1, min(chunk_bytes, _SUM_SCRATCH) // itemsize)
    # One scratch buffer, reused: a fresh chunk-sized buffer per step is a fresh mapping from
    # malloc (above its threshold), and its page faults cost more than the sums.
    scratch = _scratch(target.dtype, min(step, stop - start))
    total = 0.0
    for lo in range(start, stop, step):
        hi = min(stop, lo + step)
        tmp = scratch[: hi - lo]
        fill(target, tmp, lo, reader)
        total += _sum64(tmp if dtype in (None, target.dtype) else tmp.to(dtype))
    return total


_SUM_SCRATCH = 8 << 20
_scratches: dict = {}  # (pid, thread, dtype) -> buffer


def _scratch(dtype: torch.dtype, numel: int) -> torch.Tensor:
    key = (os.getpid(), threading.get_ident(), dtype)
    buf = _scratches.get(key)
    if buf is None or buf.numel() < numel:
        buf = _scratches[key] = torch.empty(max(numel, 1), dtype=dtype)
    return buf


def _sum64(t: torch.Tensor, step: int = 1 << 20) -> float:
    """float64 sum of a 1-D tensor, a chunk at a time (no float64 copy of the whole)."""
    t = t.detach()
    return sum(float(t[i: i + step].double().sum()) for i in range(0, t.numel(), step))


def _close(a: float, b: float, n: int) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9 * max(1, n))


# --------------------------------------------------------------------------- strategy


def _own_shard_fits(layout: CheckpointLayout, mp_size: int, world: int, flat: bool) -> tuple:
    """(fits, why) for the own-shard strategy."""
    if layout.model_parallel_size != mp_size:
        return False, f"saved model-parallel size {layout.model_parallel_size} != target {mp_size}"
    if layout.shards_per_part != world:
        return False, f"saved {layout.shards_per_part} shard(s) per part != {world} data-parallel rank(s)"
    if flat != layout.flat and layout.shards_per_part > 1:
        return False, "the target is unflattened but the saved shards are flat" if not flat else "saved shards are not flat"
    if flat:
        for part in layout.parts:
            for fp in part.flat_params:
                for d, real in enumerate(fp.real_numels):
                    lo, hi, size = flat_shard_range(fp.total_numel, d, world)
                    if real != hi - lo or fp.shard_numels[d] != size:
                        return False, f"{fp.key}: saved shard boundaries differ from fairscale's for {world} ranks"
    return True, "the saved layout matches the world: each rank reads its own file"


def _choose(opts: _Options, infos: Sequence[dict], layout: Optional[CheckpointLayout], mp_size: int,
            world: int, flat: bool, dp: Group) -> tuple:
    """(strategy, reason). Every rank of a data-parallel group computes the same answer
    from the same gathered ``infos``; raises (locally, on every rank alike) if impossible."""
    broken = [info for info in infos if not info["ok"] and not info["blind"]]
    if broken:
        raise CheckpointLayoutError(
            "the checkpoint is damaged as some ranks see it: "
            + cap_list([f"rank {info['rank']}: {info['err']}" for info in broken], 4, sep="; ")
        )
    blind = [i for i, info in enumerate(infos) if not info["ok"]]
    if not infos[0]["ok"]:
        raise CheckpointLayoutError(
            f"data-parallel rank 0 (rank {infos[0]['rank']}), the reader of this model part, cannot read "
            f"the checkpoint: {infos[0]['err']}"
        )
    fps = {info["fp"] for info in infos if info["ok"]}
    if len(fps) > 1:
        odd = [f"rank {info['rank']}: {info['desc']}" for info in infos if info["ok"]]
        raise CheckpointLayoutError(
            "the ranks see different checkpoint files (" + cap_list(odd, 4, sep="; ") + "). Every rank must see the "
            "same files (or none, with strategy='broadcast'); sync the folder or fix the path."
        )
    if blind:
        who = "rank" + ("s " if len(blind) > 1 else " ") + cap_list([infos[i]["rank"] for i in blind])
        if opts.strategy == "broadcast":
            return "broadcast", f"{who} cannot see the files; data-parallel rank 0 reads and broadcasts"
        if opts.strategy in ("auto", "parallel"):
            return "parallel", (f"{who} cannot see the files; the {len(infos) - len(blind)} rank(s) that can "
                                "read each byte once between them and send it on")
        raise CheckpointLayoutError(
            f"strategy={opts.strategy!r} needs every rank to read the files, but {who} cannot "
            f"({infos[blind[0]]['err']}). Use strategy='parallel' or strategy='auto' to read once among the "
            "ranks that can and send it on, or strategy='broadcast'."
        )
    if opts.strategy == "broadcast":
        return "broadcast", "requested: data-parallel rank 0 reads and broadcasts in buckets"
    if opts.strategy == "parallel":
        return "parallel", "requested: each byte read once, split among the ranks by bytes, and sent on"
    fits, why = _own_shard_fits(layout, mp_size, world, flat)
    if opts.strategy == "own_shard" and not fits:
        raise CheckpointLayoutError(
            f"strategy='own_shard' needs the saved layout to match the world, but {why}. "
            "Use strategy='reshard' or strategy='auto' to read byte ranges from any layout."
        )
    if fits and opts.strategy in ("auto", "own_shard"):
        return "own_shard", why
    mp_note = (f", model-parallel {layout.model_parallel_size}->{mp_size}"
               if layout.model_parallel_size != mp_size else "")
    return "reshard", (f"{'requested' if opts.strategy == 'reshard' else why}; each rank reads only its "
                       f"byte ranges{mp_note}")


# --------------------------------------------------------------------------- broadcast


@dataclass(frozen=True)
class _Entry:
    name: str
    start: int
    length: int
    offset: int  # bytes into the bucket


def _schedule(targets: Mapping[str, TargetTensor], bucket_bytes: int, direct: bool) -> list:
    """Buckets of entries, identical on every rank of a data-parallel group. A bucket with
    ``direct`` set holds one chunk broadcast straight into the receivers' outputs."""
    buckets, current, used = [], [], 0
    for t in targets.values():
        if t.alias_of is not None:
            continue
        itemsize = torch.empty((), dtype=t.dtype).element_size()
        per = max(1, bucket_bytes // itemsize)
        if direct and t.nbytes >= bucket_bytes // 4:
            for lo in range(0, t.numel, per):
                buckets.append((True, [_Entry(t.name, lo, min(per, t.numel - lo), 0)]))
            continue
        for lo in range(0, t.numel, per):
            n = min(per, t.numel - lo)
            size = -(-(n * itemsize) // _ALIGN) * _ALIGN
            if used + size > bucket_bytes and current:
                buckets.append((False, current))
                current, used = [], 0
            current.append(_Entry(t.name, lo, n, used))
            used += size
    if current:
        buckets.append((False, current))
    return buckets


def bucket_need(schedule: Sequence, targets: Mapping[str, TargetTensor]) -> int:
    """The staging bucket a schedule's shared buckets fill: the largest of them (at most
    ``bucket_mb``; a checkpoint smaller than the bucket gets a bucket its own size)."""
    need = 0
    for is_direct, entries in schedule:
        if not is_direct and entries:
            e = entries[-1]
            nbytes = e.length * torch.empty((), dtype=targets[e.name].dtype).element_size()
            need = max(need, e.offset + nbytes)
    return need


def _broadcast_loop(dp: Group, targets: Mapping[str, TargetTensor], wants: Sequence[Want],
                    reader: Optional[RangeReader], opts: _Options, direct: bool, progress) -> tuple:
    """(collective over ``dp``) Rank 0 reads and broadcasts; everyone copies what it
    wants. For loads where every rank wants everything (``flat=False``). Returns (this
    rank's error or None, per-target sums of what arrived, for verify). Never raises: the
    caller settles, so every rank leaves the loop after the same collectives."""
    by_name: dict = {}
    for w in wants:
        by_name.setdefault(w.name, []).append(w)
    sums: dict = {}
    schedule = _schedule(targets, opts.bucket_bytes, direct)
    status = torch.zeros(1, dtype=torch.int64, device=dp.device)
    bucket, error = None, None
    try:
        if any(not is_direct for is_direct, _ in schedule):
            bucket = torch.empty(bucket_need(schedule, targets), dtype=torch.uint8, device=dp.device)
    except Exception as exc:  # e.g. out of (GPU) memory: say so before anyone waits
        error = exc
    error = first_failure(dp, error)
    if error is not None:
        return error, sums
    step = dp.step
    for k, (is_direct, entries) in enumerate(schedule):
        dp.at(f"{step} (broadcast, bucket {k + 1} of {len(schedule)})")
        if is_direct:
            e = entries[0]
            views = [by_name[e.name][0].out[e.start: e.start + e.length]]
        else:
            views = _bucket_views(bucket, entries, targets)
        def read(entries=entries, views=views):
            for e, v in zip(entries, views):
                fill(targets[e.name], v, e.start, reader)

        failed, stop = _announce(dp, status, read)
        error = error or failed
        if stop:
            break
        if is_direct:
            dp.broadcast(views[0])
        else:
            dp.broadcast(bucket[: entries[-1].offset + views[-1].numel() * views[-1].element_size()])
        if error is not None:
            continue  # this rank already failed; keep the stream in step, copy nothing
        try:
            for e, v in zip(entries, views):
                if opts.verify:
                    sums[e.name] = sums.get(e.name, 0.0) + _sum64(v)
                if not is_direct:
                    _scatter_local(by_name.get(e.name, ()), e, v)
            if progress:
                progress(sum(v.numel() * v.element_size() for v in views))
        except Exception as exc:
            error = exc
    return error, sums


def _announce(dp: Group, status: torch.Tensor, read: Callable[[], None]) -> tuple:
    """(collective over ``dp``) Rank 0 runs ``read`` (fills the next bucket) and tells
    everyone whether it could, before anyone waits for data that would never come.
    Returns (rank 0's exception or None, whether every rank must stop)."""
    error = None
    if dp.rank == 0:
        try:
            read()
            status.fill_(0)
        except Exception as exc:
            error, _ = exc, status.fill_(1)
    dp.broadcast(status)
    return error, bool(status.item())


def _bucket_views(bucket: torch.Tensor, entries: Sequence[_Entry], targets: Mapping[str, TargetTensor]) -> list:
    views = []
    for e in entries:
        t = targets[e.name]
        nbytes = e.length * torch.empty((), dtype=t.dtype).element_size()
        views.append(bucket[e.offset: e.offset + nbytes].view(t.dtype))
    return views


def _scatter_local(wants: Sequence[Want], e: _Entry, v: torch.Tensor) -> None:
    """Copy the parts of bucket entry ``e`` (data ``v``) that ``wants`` cover."""
    for w in wants:
        lo, hi = max(w.start, e.start), min(w.stop, e.start + e.length)
        if lo < hi:
            w.out[lo - w.start: hi - w.start].copy_(v[lo - e.start: hi - e.start])


def _pieces(entries: Sequence[_Entry], ranges: Sequence) -> list:
    """(entry index, rank, lo, hi, want index on that rank) for every piece of these
    entries some rank wants, in the one order every rank walks."""
    out = []
    for i, e in enumerate(entries):
        for r, rr in enumerate(ranges):
            for name, start, stop, _, k in rr.get(e.name, ()):
                lo, hi = max(start, e.start), min(stop, e.start + e.length)
                if lo < hi:
                    out.append((i, r, lo, hi, k))
    return out


def _want_ranges(wants: Sequence[Want]) -> dict:
    """This rank's wants as JSON: name -> [[name, start, stop, dtype, index in wants], ...]."""
    mine: dict = {}
    for k, w in enumerate(wants):
        mine.setdefault(w.name, []).append([w.name, w.start, w.stop, str(w.out.dtype).replace("torch.", ""), k])
    return mine


def _scatter_loop(dp: Group, targets: Mapping[str, TargetTensor], wants: Sequence[Want],
                  reader: Optional[RangeReader], opts: _Options, progress) -> tuple:
    """(collective over ``dp``) Rank 0 reads a bucket at a time and sends every rank
    exactly its pieces, point to point; receivers take them straight into their output
    tensors. For loads where ranks want different pieces (flat shards, DTensor shards):
    each byte crosses the wire once, and receivers hold no bucket. Returns (this rank's
    error or None, every rank's wanted ranges). Never raises (see _broadcast_loop)."""
    ranges = dp.all_gather_json(_want_ranges(wants)) if dp.active else [_want_ranges(wants)]
    by_name: dict = {}
    for w in wants:
        by_name.setdefault(w.name, []).append(w)
    status = torch.zeros(1, dtype=torch.int64, device=dp.device)
    bucket, error = None, None
    schedule = _schedule(targets, opts.bucket_bytes, direct=False)
    try:
        if dp.rank == 0:
            bucket = torch.empty(bucket_need(schedule, targets), dtype=torch.uint8, device=dp.device)
    except Exception as exc:
        error = exc
    error = first_failure(dp, error)
    if error is not None:
        return error, ranges
    tag = 0
    step = dp.step
    for b, (_, entries) in enumerate(schedule):
        pieces = _pieces(entries, ranges)
        if not pieces:
            continue
        dp.at(f"{step} (scatter, bucket {b + 1} of {len(schedule)})")
        views = _bucket_views(bucket, entries, targets) if dp.rank == 0 else None
        def read(entries=entries, views=views):
            for e, v in zip(entries, views):
                fill(targets[e.name], v, e.start, reader)
            for e, v in zip(entries, views):
                _scatter_local(by_name.get(e.name, ()), e, v)
            if progress:
                progress(sum(v.numel() * v.element_size() for v in views))

        failed, stop = _announce(dp, status, read)
        error = error or failed
        if stop:
            break
        # Receivers get their landing places ready; only if all can does anyone send.
        posts, landing, got = {}, [], 0
        if dp.rank != 0 and error is None:
            try:
                for k, (i, r, lo, hi, widx) in enumerate(pieces):
                    if r != dp.rank:
                        continue
                    e = entries[i]
                    w = wants[widx]
                    out = w.out[lo - w.start: hi - w.start]
                    t = targets[e.name]
                    if out.dtype == t.dtype and out.device == dp.device and out.is_contiguous():
                        posts[k] = out
                    else:
                        posts[k] = torch.empty(hi - lo, dtype=t.dtype, device=dp.device)
                        landing.append((out, posts[k]))
                    got += (hi - lo) * out.element_size()
            except Exception as exc:
                error = exc
        if dp.all_max(0 if error is None else 1):
            break
        handles = []
        with dp.guard():
            for k, (i, r, lo, hi, _) in enumerate(pieces):
                if dp.rank == 0 and r != 0:
                    e = entries[i]
                    handles.append(dist.isend(views[i][lo - e.start: hi - e.start], dst=dp.global_of(r),
                                              group=dp.group, tag=tag + k))
                elif k in posts:
                    handles.append(dist.irecv(posts[k], src=dp.global_of(0), group=dp.group, tag=tag + k))
            tag += len(pieces)
            dp.wait_all(handles)  # a peer that raised out of the load is noticed here too
        if dp.rank != 0:
            try:
                for out, tmp in landing:
                    out.copy_(tmp)
                if progress and got:
                    progress(got)
            except Exception as exc:
                error = exc
    return error, ranges


# --------------------------------------------------------------------------- engine


def _spec(targets: Mapping[str, TargetTensor], structure: Optional[FlatStructure]) -> bytes:
    """What receivers without files need to know about the targets (no paths)."""
    return json.dumps({
        "targets": [[t.name, list(t.shape), str(t.dtype).replace("torch.", ""), t.alias_of] for t in targets.values()],
        "structure": None if structure is None else {
            "groups": [[g.fsdp_path, g.flat_name, list(g.names), [list(s) for s in g.shapes],
                        [list(p) for p in g.shared]] for g in structure.groups],
            "buffers": list(structure.buffer_names),
        },
    }).encode()


def _unspec(payload: bytes) -> tuple:
    from ._plan import FlatGroup

    obj = json.loads(payload)
    targets = OrderedDict(
        (n, TargetTensor(n, tuple(shape), getattr(torch, dtype), (), alias))
        for n, shape, dtype, alias in obj["targets"]
    )
    structure = None
    if obj["structure"] is not None:
        structure = FlatStructure(
            tuple(FlatGroup(p, f, tuple(names), tuple(tuple(s) for s in shapes), tuple(tuple(x) for x in shared))
                  for p, f, names, shapes, shared in obj["structure"]["groups"]),
            tuple(obj["structure"]["buffers"]),
        )
    return targets, structure


def _progress_bar(enabled, total: int, rank: int):
    if callable(enabled):
        return enabled, contextlib.nullcontext()
    if enabled is None:
        enabled = rank == 0 and sys.stderr.isatty() and total >= (256 << 20)
    if not enabled:
        return None, contextlib.nullcontext()
    from tqdm import tqdm

    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="oneload", leave=False)
    return bar.update, _logging_through(bar)


@contextlib.contextmanager
def _logging_through(bar):
    """The bar, with console log records written through it (tqdm.write) while it shows:
    a line logged mid-read would otherwise break it on a terminal."""
    from tqdm.contrib.logging import logging_redirect_tqdm

    with bar, logging_redirect_tqdm():
        yield bar


def _problems(dp: Group, mp: Group) -> Optional[str]:
    """What is wrong with the groups as this rank sees them (checked before any read)."""
    if dp.active and mp.active and dp.size > 1 and mp.size > 1:
        shared = set(dp.members()) & set(mp.members())
        if shared != {dp.global_rank}:
            return (f"the data-parallel group [{cap_list(dp.members())}] and the model-parallel group "
                    f"[{cap_list(mp.members())}] share ranks [{cap_list(sorted(shared))}]; they must meet in this rank only "
                    "(pass process_group=<data-parallel group>, model_parallel_group=<model-parallel group>)")
    return None


def _discover_once(path, dp: Group, mp: Group, opts: _Options) -> tuple:
    """(collective over both groups) (layout or None, the error that stood in its way).

    One rank (rank 0 of both groups) reads the headers; it sends the frozen description
    down the data-parallel group of model part 0, then along each model-parallel group.
    Every other rank checks, by name, size and modification time only, that it sees the
    same files under its own path (no file opened), and discovers on its own only where it
    does not (a missing mount: blind; other files: the agreement step says which ranks
    differ). Header reads summed over the ranks are then the set's file count, whatever
    the world size (not the file count times the world size)."""
    coordinator = dp.rank == 0 and mp.rank == 0
    layout, err, payload = None, None, None
    if coordinator:
        try:
            layout = discover(path, trust_pickle=opts.trust_pickle)
        except Exception as e:  # reported collectively by the caller
            err = e
        payload = b"E"  # the others discover on their own
        if layout is not None:
            try:
                payload = b"L" + to_wire(layout, path)
            except Exception:  # noqa: BLE001  (a layout that does not travel: each rank reads it)
                pass
    for g in (dp, mp):
        g.at(f"loading {path}: sending the layout")
    if mp.rank == 0:
        payload = dp.broadcast_bytes(payload)
    payload = mp.broadcast_bytes(payload)
    if coordinator:
        return layout, err
    if payload[:1] == b"L":
        try:
            return adopt(payload[1:], path, trust_pickle=opts.trust_pickle), None
        except Exception:  # noqa: BLE001  not what the coordinator sees (or not here): see for itself
            pass
    try:
        return discover(path, trust_pickle=opts.trust_pickle), None
    except Exception as e:  # reported collectively by the caller
        return None, e


def _engine(path, dp: Group, mp: Group, opts: _Options, flat: bool, structure_from: Optional[Mapping],
            make_wants: Callable) -> tuple:
    """(collective over both groups) Discover, agree, plan, read, verify. Returns
    (layout or None, targets, structure, report)."""
    try:
        return _engine_steps(path, dp, mp, opts, flat, structure_from, make_wants)
    except BaseException as e:
        # Failures inside a step are settled together (every rank raises the same error:
        # none is left in a collective, and a peer still in the last gather must not read
        # "left the load"); anything else that leaves the load (an error between steps, an
        # interrupt) must not leave the others in a collective.
        if not getattr(e, "settled", False):
            tell_left((dp, mp), e)
        raise


def _engine_steps(path, dp: Group, mp: Group, opts: _Options, flat: bool, structure_from: Optional[Mapping],
                  make_wants: Callable) -> tuple:
    t0 = time.perf_counter()
    groups = (dp, mp)
    # 0. Everyone is here: a rank that failed before the load (and lives on) must not leave
    # the others in a collective until the process group's timeout. Before discovery, which
    # may take each rank a different while on a slow file system.
    name = path.display_name if isinstance(path, CheckpointLayout) else path
    arrive(groups, opts.arrival_timeout, f"loading {name}")
    # 1. Agree on the groups and options (a broken grid must not reach a collective it
    # cannot finish), discover once per cluster, then agree on what everyone sees.
    layout, err = None, None
    given = path
    if isinstance(path, CheckpointLayout):
        layout, path = path, path.display_name
    elif not dp.active and not mp.active:
        layout = discover(path, trust_pickle=opts.trust_pickle)
    asked = [opts.strategy, flat, opts.bucket_mb, opts.chunk_mb, opts.verify, opts.qkv, str(opts.dtype),
             mp.size, dp.size]
    pre = {"rank": dp.global_rank, "mp_rank": mp.rank, "asked": asked, "problem": _problems(dp, mp)}
    for g in groups:
        g.at(f"loading {path}: agreeing on the options")
    dp_pre = dp.all_gather_json(pre) if dp.active else [pre]
    mp_pre = mp.all_gather_json(pre) if mp.active else [pre]
    error = None
    try:
        for i in dp_pre + mp_pre:
            if i["problem"]:
                raise ValueError(f"rank {i['rank']}: {i['problem']}")
        for infos, what in ((dp_pre, "data-parallel"), (mp_pre, "model-parallel")):
            odd = [i for i in infos if i["asked"] != infos[0]["asked"]]
            if odd:
                raise ValueError(
                    f"ranks of one {what} group called with different options: rank {infos[0]['rank']} "
                    f"{infos[0]['asked']} vs rank {odd[0]['rank']} {odd[0]['asked']} (strategy, flat, bucket_mb, "
                    "chunk_mb, verify, qkv, dtype, model-parallel size, data-parallel size); pass the same on every rank.")
        if len({i["mp_rank"] for i in dp_pre}) > 1:
            raise ValueError(
                "the ranks of this data-parallel group hold different model-parallel parts "
                f"({cap_list(sorted({(i['rank'], i['mp_rank']) for i in dp_pre}))}): process_group must join ranks that hold "
                "the same part (Megatron's data-parallel group), model_parallel_group the parts of one replica.")
    except Exception as e:
        error = e
    settle(groups, error, f"loading {path}: agreeing on the options")
    if layout is None:
        layout, err = _discover_once(given, dp, mp, opts)
    # Whether this rank's reads go through a page cache its node's ranks share.
    cache = {"shared": False, "why": "", "avail": -1}
    if layout is not None and dp.active and dp.size > 1:  # only ranks that may share bytes ask
        try:  # never raise before the gather: the others would wait for this rank in it
            cache = page_cache_view([f.path for f in layout.all_files])
        except Exception as e:  # noqa: BLE001
            cache["why"] = f"its page cache could not be checked ({type(e).__name__}: {e})"
    info = {
        "rank": dp.global_rank,
        "ok": layout is not None,
        "blind": isinstance(err, CheckpointNotFoundError),
        "fp": layout.fingerprint() if layout is not None else None,
        "err": None if err is None else clip(f"{type(err).__name__}: {err}"),
        "desc": "" if layout is None else f"{layout.display_name} {layout.model_parallel_size}x{layout.shards_per_part}",
        "node": node_key(),
        "cache": cache,
    }
    for g in groups:
        g.at(f"loading {path}: agreeing on the checkpoint")
    dp_infos = dp.all_gather_json(info) if dp.active else [info]
    mp_infos = mp.all_gather_json(info) if mp.active else [info]
    strategy, reason, error = None, "", None
    try:
        if err is not None and isinstance(err, (OneloadError, OSError)) and all(not i["ok"] for i in dp_infos):
            raise err
        strategy, reason = _choose(opts, dp_infos, layout, mp.size, dp.size, flat, dp)
        readers = {i["fp"] for i in mp_infos if i["ok"]}
        if len(readers) > 1:
            seen = [f"rank {i['rank']}: {i['desc']}" for i in mp_infos if i["ok"]]
            raise CheckpointLayoutError(
                "ranks of different model-parallel parts see different checkpoint files (" + cap_list(seen, 4, sep="; ") + ")."
            )
    except Exception as e:
        error = e
    settle(groups, error, f"loading {path}: agreeing on the checkpoint")

    reader = RangeReader(chunk_bytes=opts.chunk_bytes, trust_pickle=opts.trust_pickle) if layout is not None else None
    try:
        # 2. Plan: the reader of each data-parallel group plans; with broadcast it tells the others.
        targets, structure, wants, error = None, None, None, None
        try:
            if layout is not None and (strategy != "broadcast" or dp.rank == 0):
                # (with parallel, every rank that sees the files plans: it reads with its own paths)
                targets = plan_part(layout, mp.size, mp.rank, qkv=opts.qkv, rules=opts.rules, dtype=opts.dtype)
                if flat:
                    structure = (FlatStructure.from_metadata(structure_from) if structure_from is not None
                                 else FlatStructure.from_layout(layout, targets))
                    structure.check_against(targets)
        except Exception as e:
            error = e
        settle(groups, error, f"loading {path}: planning")
        error = None
        blind_ranks = [i for i, info in enumerate(dp_infos) if not info["ok"]]
        if strategy == "broadcast" or (strategy == "parallel" and blind_ranks):
            dp.at(f"loading {path}: sending the targets from the reader")
            payload = None
            if dp.rank == 0:
                try:
                    payload = _spec(targets, structure)
                except Exception as e:  # still send something: the others are waiting for it
                    error, payload = e, json.dumps({"error": f"{type(e).__name__}: {e}"}).encode()
            payload = dp.broadcast_bytes(payload)
            if dp.rank != 0 and (strategy == "broadcast" or layout is None):
                try:
                    targets, structure = _unspec(payload)
                except Exception as e:
                    error = e
        try:
            if error is None:
                wants = _resolve_aliases(make_wants(targets, structure, layout), targets)
        except Exception as e:
            error = e
        settle(groups, error, f"loading {path}: matching the target")

        # Where ranks want the same bytes (or some cannot read), read each once and exchange.
        plan, all_ranges = None, None
        if strategy in ("own_shard", "reshard", "parallel") and dp.active and dp.size > 1:
            dp.at(f"loading {path}: planning who reads what")
            all_ranges = dp.all_gather_json(_want_ranges(wants))
            sizes = {n: torch.empty((), dtype=t.dtype).element_size() for n, t in targets.items()}
            strategy, reason, plan = _exchange_choice(
                strategy, opts.strategy, reason, all_ranges, sizes, [n for n, t in targets.items() if t.alias_of is None],
                [i for i, info in enumerate(dp_infos) if info["ok"]], [i["node"] for i in dp_infos],
                [i["cache"] for i in dp_infos], opts.bucket_bytes)

        # 3. Read.
        total = sum(w.out.numel() * w.out.element_size() for w in wants)
        # Logged before the bar appears: a line printed under it would break it.
        if dp.rank == 0 and mp.rank == 0 and (dp.active or mp.active or logger.isEnabledFor(logging.INFO)):
            logger.info("oneload: %s: strategy=%s (%s)", path, strategy, reason)
        progress, bar = _progress_bar(opts.progress, total, dp.global_rank)
        sums: dict = {}
        mode, error, moved = strategy, None, {}
        for g in groups:
            g.at(f"loading {path}: reading")
        with bar:
            if strategy == "broadcast":
                whole = len(wants) == sum(1 for t in targets.values() if t.alias_of is None) and all(
                    w.start == 0 and w.out.numel() == targets[w.name].numel for w in wants)
                direct_ok = whole and all(_direct_capable(w, targets, dp) for w in wants)
                votes = dp.all_gather_json([whole, direct_ok]) if dp.active else [[whole, direct_ok]]
                if all(v[0] for v in votes):
                    error, sums = _broadcast_loop(dp, targets, wants, reader, opts, all(v[1] for v in votes),
                                                  progress)
                else:
                    mode = "scatter"
                    error, all_ranges = _scatter_loop(dp, targets, wants, reader, opts, progress)
            elif plan is not None:
                mode = "scatter" if blind_ranks else "local"
                error, moved = exchange_loop(dp, plan, targets, wants, reader, fill, progress)
            else:
                try:
                    fill_all(targets, wants, reader, progress)
                except Exception as e:
                    error = e
        settle(groups, error, f"loading {path}: reading")

        # 4. Verify against torch's own reading of the same files.
        verified = False
        if opts.verify:
            for g in groups:
                g.at(f"loading {path}: verifying")
            # Ranks that cannot read have the reader compute their sums (as with broadcast).
            error = _verify(dp, "broadcast" if mode == "scatter" else strategy, mode, targets, wants, sums,
                            all_ranges, reader, opts)
            settle(groups, error, f"loading {path}: verifying")
            verified = True
    finally:
        if reader is not None:
            reader.close()
    report = LoadReport(
        path=str(path),
        kind=layout.kind if layout else "unknown",
        saved_model_parallel=layout.model_parallel_size if layout else 0,
        saved_shards=layout.shards_per_part if layout else 0,
        saved_flat=layout.flat if layout else False,
        target_model_parallel=mp.size,
        target_world=dp.size,
        flat=flat,
        strategy=strategy,
        reason=reason,
        bytes_read=reader.bytes_read if reader is not None else 0,
        bytes_out=total,
        seconds=time.perf_counter() - t0,
        verified=verified,
        warnings=layout.warnings if layout else (),
        bytes_received=moved.get("received", 0),
        bytes_from_other_nodes=moved.get("from_other_nodes", 0),
        bytes_sent=moved.get("sent", 0),
    )
    return layout, targets, structure, report


def _exchange_choice(strategy: str, asked: str, reason: str, ranges: Sequence[Mapping], sizes: Mapping[str, int],
                     order: Sequence[str], readers: Sequence[int], nodes: Sequence[str], caches: Sequence[Mapping],
                     bucket_bytes: int) -> tuple:
    """(local, the same on every rank of a data-parallel group) (strategy, reason, the
    exchange plan or None), given every rank's wanted ranges, which ranks read, their nodes
    and their views of the files (``_exchange.page_cache_view``).

    ``parallel`` asked for reads every byte once in all and sends it on, even between ranks
    of one node and between nodes that each have a copy. Otherwise, where ranks want the
    same bytes: a node with a copy on a disk of its own reads what its ranks want from it
    (no other storage is asked, and a local read beats the network); nodes on shared storage
    (network filesystems, object stores) read each byte once between them and send it on.
    Ranks of a node whose page cache can hold the bytes each read their own (the repeats are
    memory copies out of the cache, cheaper than a message's two); only what other nodes and
    blind ranks want travels, and ``auto`` says ``parallel`` where anything does. Where
    nothing needs to travel, the strategy stays as it was."""
    wanted, union = overlap(ranges, sizes)
    if strategy != "parallel" and wanted <= 1.05 * union:
        return strategy, reason, None
    strict = asked == "parallel"
    cached, notes = (frozenset(), []) if strict else cached_nodes(caches, nodes, readers, ranges, sizes)
    private = frozenset() if strict else private_nodes(caches, nodes, readers)
    plan = plan_exchange(order, sizes, ranges, readers, nodes, chunk_bytes_for(bucket_bytes, len(readers)), cached,
                         private)
    times = f"{wanted / max(union, 1):.2f}x"
    own = ""
    if private:
        kinds = sorted({caches[r].get("fs") or "?" for r in readers if nodes[r] in private})
        n = len(set(nodes))
        own = (f"every node has a copy on a disk of its own ({', '.join(kinds)}) and reads it there"
               if len(private) == n else
               f"{len(private)} of {n} nodes have a copy on a disk of their own ({', '.join(kinds)}) and read it there")
    if not plan.moves and len(readers) == len(ranges):  # (blind ranks keep the plan: the readers verify for them)
        if wanted > 1.05 * union:
            where = (f"{own}, each node's storage once; ranks of a node through its page cache" if own else
                     "on one node whose page cache holds them: each rank reads its own, the storage serves them once")
            reason += f"; the ranks want {times} the bytes there are, {where}"
        return strategy, reason, None
    share = (f"; {own}" if own else "") + ("; ranks of a node read through its page cache" if cached else "") + (
        f" ({'; '.join(notes)}: exchanged there)" if notes else "")
    if strategy != "parallel" and asked == "auto":
        return "parallel", (f"the ranks want {times} the bytes there are (the same bytes on several ranks): each "
                            f"node reads its share once, split by bytes, and sends it on{share}"), plan
    if strategy != "parallel":
        reason += f"; bytes wanted by several ranks are read once per node and sent on{share}"
    elif cached or own:
        reason += share
    return strategy, reason, plan


def _resolve_aliases(wants: Sequence[Want], targets: Mapping[str, TargetTensor]) -> list:
    """Wants of a tied name become wants of its source (the only one read or sent); every
    want must name a target and lie inside it."""
    out = []
    for w in wants:
        t = targets.get(w.name)
        if t is None:
            raise StateDictMismatchError(f"{w.name}: wanted, but the checkpoint has no such tensor.")
        if t.alias_of is not None:
            w = Want(t.alias_of, w.start, w.out)
            t = targets[t.alias_of]
        if not 0 <= w.start <= w.stop <= t.numel:
            raise StateDictMismatchError(f"{w.name}: elements {w.start}..{w.stop} wanted, the tensor has {t.numel}.")
        out.append(w)
    return out


def _verify(dp: Group, strategy: str, mode: str, targets, wants, sums, all_ranges, reader, opts) -> Optional[BaseException]:
    """(collective over ``dp`` when broadcasting) This rank's verify failure, or None."""
    if strategy != "broadcast":
        try:
            mm = _MmapReader(reader)
            for w in wants:
                got = _sum64(w.out)
                exp = _fingerprint(targets[w.name], w.start, w.stop, mm, opts.chunk_bytes, w.out.dtype)
                if not _close(got, exp, w.out.numel()):
                    raise OneloadError(f"verify: {w.name}[{w.start}:{w.stop}]: loaded sum {got!r} != source sum {exp!r}")
        except Exception as e:
            return e
        return None
    # The reader computes what arrived or should have, through torch's own reading of the
    # files, and tells the others; it always sends, so no one waits on a failed reader.
    payload, error = None, None
    if dp.rank == 0:
        try:
            mm = _MmapReader(reader)
            if mode == "broadcast":
                expected = {n: _fingerprint(t, 0, t.numel, mm, opts.chunk_bytes)
                            for n, t in targets.items() if t.alias_of is None}
            else:
                expected = [[_fingerprint(targets[n], a, b, mm, opts.chunk_bytes, getattr(torch, dt))
                             for rr in r.values() for n, a, b, dt, _ in rr] for r in all_ranges]
            payload = json.dumps({"expected": expected}).encode()
        except Exception as e:
            error, payload = e, json.dumps({"error": f"{type(e).__name__}: {e}"}).encode()
    payload = json.loads(dp.broadcast_bytes(payload))
    if error is not None:
        return error
    if "error" in payload:
        return PeerFailure(f"verify: the reader could not compute the source sums ({payload['error']})")
    expected = payload["expected"]
    try:
        if mode == "broadcast":
            for n, got in sums.items():
                if not _close(got, expected[n], targets[n].numel):
                    raise OneloadError(f"verify: {n}: received sum {got!r} != source sum {expected[n]!r}")
        else:
            mine = [w for rr in all_ranges[dp.rank].values() for w in rr]
            for (n, a, b, _, k), exp in zip(mine, expected[dp.rank]):
                got = _sum64(wants[k].out)
                if not _close(got, exp, b - a):
                    raise OneloadError(f"verify: {n}[{a}:{b}]: received sum {got!r} != source sum {exp!r}")
    except Exception as e:
        return e
    return None


def _direct_capable(w: Want, targets: Mapping[str, TargetTensor], dp: Group) -> bool:
    t = targets[w.name]
    return (w.start == 0 and w.out.numel() == t.numel and w.out.dtype == t.dtype
            and w.out.is_contiguous() and w.out.device == dp.device)


# --------------------------------------------------------------------------- verbs


def _groups(process_group, model_parallel_group, no_dist: bool = False) -> tuple:
    """(local) The groups a load runs over, by torch's convention (as
    ``torch.distributed.checkpoint`` has it): ``process_group=None`` is the default group
    when ``torch.distributed`` is initialized, so that a plain ``load_state_dict(path)``
    under torchrun reads once instead of once per rank; ``no_dist=True`` loads in this
    process alone."""
    if no_dist:
        if process_group is not None or model_parallel_group is not None:
            raise ValueError("no_dist=True loads in this process alone: pass no process_group or "
                             "model_parallel_group with it.")
        return Group(None, "data-parallel"), Group(None, "model-parallel")
    if process_group is None and dist.is_available() and dist.is_initialized():
        if model_parallel_group is None:
            process_group = dist.group.WORLD
        elif dist.get_world_size(model_parallel_group) != dist.get_world_size():
            raise ValueError(
                "process_group=None with a model_parallel_group of "
                f"{dist.get_world_size(model_parallel_group)} of the {dist.get_world_size()} ranks: pass the "
                "data-parallel group too (the ranks that hold the same model part), or no_dist=True to load in "
                "this process alone.")
    return Group(process_group, "data-parallel"), Group(model_parallel_group, "model-parallel")


def _tell_failed(error: BaseException, process_group, model_parallel_group, no_dist: bool,
                 module: Optional[torch.nn.Module] = None, timeout: Optional[float] = None) -> None:
    """(this rank alone) Its call to a load failed before the check-in: tell the ranks of
    the groups it would have loaded with (as far as its arguments give them; the default
    group, or ``module``'s DTensor mesh, where none is given) so that they stop now, with
    this rank's reason, instead of waiting ``arrival_timeout`` for it. ``timeout``: the
    caller's ``arrival_timeout``. Never raises."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    if no_dist and process_group is None and model_parallel_group is None:
        return  # a load of this process alone: no one waits for it
    if process_group is None and module is not None:
        with contextlib.suppress(Exception):
            mesh = next((t.device_mesh for t in module.state_dict(keep_vars=True).values() if _is_dtensor(t)), None)
            if mesh is not None and mesh.ndim == 1:
                process_group = mesh.get_group()
    try:
        groups = list(_groups(process_group, model_parallel_group))
    except Exception:  # noqa: BLE001  (the arguments were what failed: each group that can be built)
        groups = []
        for g, role in ((dist.group.WORLD if process_group is None else process_group, "data-parallel"),
                        (model_parallel_group, "model-parallel")):
            if g is not None:
                with contextlib.suppress(Exception):
                    groups.append(Group(g, role))
    tell_failed(groups, error, timeout)


def state_dict_wants(targets: Mapping[str, TargetTensor], structure: Optional[FlatStructure], flat: bool,
                     dp_rank: int, dp_size: int, device: "str | torch.device") -> tuple:
    """(local) What :func:`load_state_dict` fills on one rank: (the wants, the state dict
    they land in). :func:`~metaseq_oneload._loadplan.plan_load` calls it on the ``meta``
    device, so a plan states exactly the load's pieces."""
    out: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    wants = []
    if not flat:
        for name, t in targets.items():
            if t.alias_of is None:
                out[name] = torch.empty(t.shape, dtype=t.dtype, device=device)
                wants.append(Want(name, 0, out[name].view(-1)))
        for name, t in targets.items():
            if t.alias_of is not None:
                out[name] = out[t.alias_of]  # tied: one tensor under both names
        return wants, out
    covered = set()
    for g in structure.groups:
        dtypes = {targets[n].dtype for n in g.names}
        if len(dtypes) > 1:
            raise StateDictMismatchError(f"{g.key}: members have mixed dtypes {sorted(map(str, dtypes))}.")
        pieces, size = g.shard_pieces(dp_rank, dp_size)
        local = torch.empty(size, dtype=dtypes.pop() if dtypes else torch.float32, device=device)
        filled = pieces[-1][3] + pieces[-1][2] - pieces[-1][1] if pieces else 0
        local[filled:].zero_()  # fairscale pads the tail with zeros
        out[g.key] = local
        for n, start, stop, offset in pieces:
            wants.append(Want(n, start, local[offset: offset + stop - start]))
        covered.update(g.names)
    for name, t in targets.items():
        if name in covered or t.alias_of is not None:
            continue
        out[name] = torch.empty(t.shape, dtype=t.dtype, device=device)
        wants.append(Want(name, 0, out[name].view(-1)))
    return wants, out


def load_checkpoint(
    path: "str | os.PathLike",
    *,
    process_group: Optional["dist.ProcessGroup"] = None,
    model_parallel_group: Optional["dist.ProcessGroup"] = None,
    flat: bool = False,
    strategy: str = "auto",
    shard_metadata: Optional[Mapping] = None,
    bucket_mb: float = 256,
    chunk_mb: float = 64,
    verify: bool = False,
    dtype: Optional[torch.dtype] = None,
    device: "str | torch.device" = "cpu",
    qkv: str = "auto",
    rules: Optional[Mapping[str, str]] = None,
    trust_pickle: bool = False,
    progress: "Optional[bool] | Callable[[int], None]" = None,
    arrival_timeout: Optional[float] = None,
    no_dist: bool = False,
) -> LoadedCheckpoint:
    """(collective over the groups given) Like :func:`load_state_dict`, returning the
    state dict with its ``shard_metadata``, the layout and a :class:`LoadReport`."""
    try:
        opts = _Options(strategy=strategy, bucket_mb=bucket_mb, chunk_mb=chunk_mb, verify=verify,
                        trust_pickle=trust_pickle, qkv=qkv, rules=rules, dtype=dtype, progress=progress,
                        arrival_timeout=arrival_timeout)
        dp, mp = _groups(process_group, model_parallel_group, no_dist)
    except BaseException as e:
        _tell_failed(e, process_group, model_parallel_group, no_dist, timeout=arrival_timeout)
        raise
    out: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    meta: dict = {}

    def make_wants(targets, structure, layout):
        wants, filled = state_dict_wants(targets, structure, flat, dp.rank, dp.size, device)
        out.update(filled)
        if flat:
            meta.update(structure.shard_metadata(dp.rank, dp.size))
        return wants

    layout, _, _, report = _engine(path, dp, mp, opts, flat, shard_metadata, make_wants)
    if flat:
        out.shard_metadata = meta  # like torch's state_dict._metadata: travels with the dict
    return LoadedCheckpoint(out, meta if flat else None, layout, report)


def load_state_dict(
    path: "str | os.PathLike",
    *,
    process_group: Optional["dist.ProcessGroup"] = None,
    model_parallel_group: Optional["dist.ProcessGroup"] = None,
    flat: bool = False,
    strategy: str = "auto",
    shard_metadata: Optional[Mapping] = None,
    bucket_mb: float = 256,
    chunk_mb: float = 64,
    verify: bool = False,
    dtype: Optional[torch.dtype] = None,
    device: "str | torch.device" = "cpu",
    qkv: str = "auto",
    rules: Optional[Mapping[str, str]] = None,
    trust_pickle: bool = False,
    progress: "Optional[bool] | Callable[[int], None]" = None,
    arrival_timeout: Optional[float] = None,
    no_dist: bool = False,
) -> "OrderedDict[str, torch.Tensor]":
    """(collective over the groups given) This rank's part of any checkpoint's weights.

    Args:
        path: any file of the checkpoint, its folder, its un-suffixed name, or a glob.
        process_group: the data-parallel group (size W). None: torch's default group when
            ``torch.distributed`` is initialized (then the load is collective over every
            rank), else no collectives.
        model_parallel_group: the model-parallel group (size M'). None: M' = 1, every rank
            gets the whole model with all saved model-parallel parts merged.
        flat: False: the unflattened tensors of this rank's model-parallel part (identical on
            every data-parallel rank), with metaseq's names (fused ``qkv_proj``, rows k, v, q
            per part; the tied ``output_projection`` shares ``embed_tokens``' tensor).
            True: this rank's fairscale FSDP local shard for W ranks (``flat_param_*`` keys and
            buffers), with the matching metadata in the result's ``shard_metadata`` attribute;
            what ``FullyShardedDataParallel.load_local_state_dict`` expects.
        strategy: "auto" (chooses and logs why), "own_shard", "reshard", "broadcast" or "parallel"; see
            the module docstring for each one's peak memory.
        shard_metadata: for ``flat=True`` from an unflattened checkpoint: the target
            wrapping, i.e. fairscale's ``model.local_metadata_dict()``.
        bucket_mb: broadcast bucket size (peak extra memory of every rank when broadcasting).
        chunk_mb: staging size for dtype/device conversion and model-parallel column blocks.
        verify: also compare per-tensor sums of what was loaded with torch's own
            (memory-mapped) reading of the source; costs one more read.
        dtype: cast to this dtype (default: as stored).
        device: where the returned tensors live.
        qkv: "auto" (fuse split k/v/q for metaseq checkpoints), "fused", "split" or "keep".
        rules: extra model-parallel split rules, name suffix -> "column"|"row"|"replicated"|"qkv".
        trust_pickle: unpickle without the allowlist. Unsafe: runs code from the file.
        progress: show a progress bar (default: on a terminal, rank 0, loads >= 256 MiB), or
            a callable that receives the number of bytes after each piece lands.
        arrival_timeout: seconds every rank waits, at the start, for the others to reach the
            load (default: ``$METASEQ_ONELOAD_ARRIVAL_TIMEOUT``, else 300). A rank that never
            comes (it failed earlier and went on) makes every rank that did raise
            :class:`DistributedLoadError` naming it, instead of waiting in a collective for
            the process group's timeout. A rank whose call fails before the check-in (a bad
            argument) does not cost the others this wait: they raise its reason at once.
        no_dist: load in this process alone, with no collectives, even where
            ``torch.distributed`` is initialized (each process then reads what it needs itself).

    Returns:
        An ``OrderedDict`` of tensors (with ``.shard_metadata`` when ``flat=True``).

    Raises:
        CheckpointLayoutError: bad files (single process), see :func:`inspect`.
        DistributedLoadError: on every rank, when any rank failed, did not arrive within
            ``arrival_timeout``, or was lost mid-load (the backend's error is the cause).
        StateDictMismatchError: the requested target does not fit the checkpoint.

    Example::

        sd = load_state_dict("/ckpt/checkpoint_last.pt", process_group=dp, flat=True)
        fsdp_model.load_local_state_dict(sd)
    """
    return load_checkpoint(path, process_group=process_group, model_parallel_group=model_parallel_group,
                           flat=flat, strategy=strategy, shard_metadata=shard_metadata, bucket_mb=bucket_mb,
                           chunk_mb=chunk_mb, verify=verify, dtype=dtype, device=device, qkv=qkv, rules=rules,
                           trust_pickle=trust_pickle, progress=progress, arrival_timeout=arrival_timeout, no_dist=no_dist).model


# --------------------------------------------------------------------------- load_into


def _owner(module: torch.nn.Module, name: str) -> tuple:
    *path, leaf = name.split(".")
    m = module
    for p in path:
        m = getattr(m, p)
    return m, leaf


def _is_dtensor(t) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch < 2.4
        from torch.distributed._tensor import DTensor
    return isinstance(t, DTensor)


def _dtensor_want(name: str, t, post: list) -> Want:
    """The element range of the global tensor this rank's DTensor shard holds."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = t.to_local().detach()
    shape = tuple(t.shape)
    local_shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    inner = math.prod(shape[1:]) if len(shape) > 1 else 1
    rows_only = all(o == 0 for o in offset[1:]) and tuple(local_shape[1:]) == shape[1:]
    if rows_only:
        start = (offset[0] if shape else 0) * inner
        if local.is_contiguous():
            return Want(name, start, local.view(-1))
        tmp = torch.empty(local.numel(), dtype=local.dtype)
        post.append(lambda: local.copy_(tmp.view(local.shape)))
        return Want(name, start, tmp)
    # A box that is not a run of whole rows (e.g. tensor-parallel Shard(1)): read the rows
    # it spans, then cut the box out. Costs those rows in staging memory.
    r0, r1 = offset[0], offset[0] + local_shape[0]
    tmp = torch.empty((r1 - r0) * inner, dtype=local.dtype)

    def cut():
        box = tmp.view((r1 - r0,) + shape[1:])
        for d in range(1, len(shape)):
            box = box.narrow(d, offset[d], local_shape[d])
        local.copy_(box)

    post.append(cut)
    return Want(name, r0 * inner, tmp)


def _prepare_into(module, process_group, model_parallel_group, strategy, device, bucket_mb, chunk_mb, verify, qkv,
                  rules, trust_pickle, progress, arrival_timeout, no_dist) -> tuple:
    """(local) :func:`load_into`'s work before the check-in: the module's tensors, the
    groups (from its DTensors' mesh where none is given) and the options."""
    entries = module.state_dict(keep_vars=True)
    mesh = next((t.device_mesh for t in entries.values() if _is_dtensor(t)), None)
    if no_dist and mesh is not None:
        raise ValueError(f"{type(module).__name__} holds DTensor parameters (FSDP2): its shards are loaded "
                         "over their mesh's group, so no_dist=True cannot be used with it.")
    if process_group is None and mesh is not None:
        if mesh.ndim == 1:
            process_group = mesh.get_group()
        elif mesh.size() == dist.get_world_size():
            # Every rank of a multi-dimensional mesh (HSDP, FSDP + TP) wants its own box:
            # one group over all of them lets any failure reach every rank.
            process_group = dist.group.WORLD
        else:
            raise ValueError(
                f"{type(module).__name__} is sharded over a {mesh.ndim}-D mesh of {mesh.size()} ranks in a world of "
                f"{dist.get_world_size()}: pass process_group=<a group of exactly the mesh's ranks>.")
    if device is None and mesh is not None:
        device = mesh.device_type  # FSDP2 on GPUs: materialise where the mesh lives
    if qkv is None:
        qkv = qkv_naming(entries)
    opts = _Options(strategy=strategy, bucket_mb=bucket_mb, chunk_mb=chunk_mb, verify=verify,
                    trust_pickle=trust_pickle, qkv=qkv, rules=rules, progress=progress,
                    arrival_timeout=arrival_timeout)
    dp, mp = _groups(process_group, model_parallel_group, no_dist)
    return entries, process_group, device, opts, dp, mp


def load_into(
    module: torch.nn.Module,
    path: "str | os.PathLike",
    *,
    process_group: Optional["dist.ProcessGroup"] = None,
    model_parallel_group: Optional["dist.ProcessGroup"] = None,
    strategy: str = "auto",
    strict: bool = True,
    device: "str | torch.device | None" = None,
    bucket_mb: float = 256,
    chunk_mb: float = 64,
    verify: bool = False,
    qkv: Optional[str] = None,
    rules: Optional[Mapping[str, str]] = None,
    trust_pickle: bool = False,
    progress: "Optional[bool] | Callable[[int], None]" = None,
    arrival_timeout: Optional[float] = None,
    no_dist: bool = False,
) -> LoadReport:
    """(collective over the groups given) Fill ``module``'s parameters and buffers in place.

    Works on a plain module, on a module built on the ``meta`` device (each tensor is
    materialised on ``device`` -- default CPU -- as it is loaded, so no rank ever holds a
    second copy), and on a module sharded with torch FSDP2 ``fully_shard`` (DTensor
    parameters: each rank receives only its shard). With DTensor parameters and no
    ``process_group``, the parameters' mesh group is used.

    Keys and shapes are checked before anything is written: with ``strict`` a missing,
    unexpected or wrongly shaped tensor raises :class:`StateDictMismatchError` naming the
    first few; without it, only wrongly shaped ones do and the rest is skipped.
    Other arguments as for :func:`load_state_dict` (``arrival_timeout`` included).

    Returns:
        The :class:`LoadReport` (strategy, bytes read, time).
    """
    try:
        entries, process_group, device, opts, dp, mp = _prepare_into(
            module, process_group, model_parallel_group, strategy, device, bucket_mb, chunk_mb, verify, qkv, rules,
            trust_pickle, progress, arrival_timeout, no_dist)
    except BaseException as e:
        _tell_failed(e, process_group, model_parallel_group, no_dist, module, timeout=arrival_timeout)
        raise
    post: list = []
    unloaded: list = []
    materialize_on = torch.device(device) if device is not None else torch.device("cpu")

    def make_wants(targets, structure, layout):
        first_name: dict = {}
        for name, t in entries.items():
            first_name.setdefault(id(t), name)
            # Of names sharing one tensor, own the one the checkpoint stores (Hugging Face
            # saves one of a tied group, not always the module's first).
            if name in targets and targets[name].alias_of is None and first_name[id(t)] not in targets:
                first_name[id(t)] = name
        owned = [n for n, t in entries.items() if first_name[id(t)] == n]
        tied = {n: first_name[id(t)] for n, t in entries.items() if first_name[id(t)] != n}
        wanted = {n for n, t in targets.items() if t.alias_of is None}
        missing = [n for n in owned if n not in targets]
        unexpected = [n for n in wanted if n not in entries]
        wrong = [f"{n}: checkpoint {tuple(targets[n].shape)} vs module {tuple(entries[n].shape)}"
                 for n in owned if n in targets and tuple(targets[n].shape) != tuple(entries[n].shape)]
        problems = []
        if wrong:
            problems.append("wrong shape: " + cap_list(wrong, sep="; "))
        if strict and missing:
            problems.append("missing from the checkpoint: " + cap_list(missing))
        if strict and unexpected:
            problems.append("not in the module: " + cap_list(sorted(unexpected)))
        if problems:
            raise StateDictMismatchError(
                f"{type(module).__name__} does not match {path}: " + " | ".join(problems)
                + ". Nothing was loaded. Check the model config against the checkpoint"
                + (", or pass strict=False to load the matching tensors only." if not wrong else ".")
            )
        # Materialise meta tensors now that the keys are known to match. One the checkpoint
        # does not hold (strict=False) stays on meta, so using it fails loudly, except
        # under FSDP2, whose to_empty() materialises everything: those are listed in the
        # report's ``unloaded``.
        unloaded.extend(n for n in owned if n not in targets)
        if any(_is_dtensor(t) and t.device.type == "meta" for t in entries.values()):
            module.to_empty(device=materialize_on)
        fresh = module.state_dict(keep_vars=True)
        with torch.no_grad():
            for n in owned:
                t = fresh[n]
                if _is_dtensor(t) or t.device.type != "meta" or n not in targets:
                    continue
                new = torch.empty(t.shape, dtype=t.dtype, device=materialize_on)
                for alias in [n] + [a for a, src in tied.items() if src == n]:
                    owner, leaf = _owner(module, alias)
                    if isinstance(t, torch.nn.Parameter):
                        owner._parameters[leaf] = torch.nn.Parameter(new, requires_grad=t.requires_grad)
                    else:
                        owner._buffers[leaf] = new
            fresh = module.state_dict(keep_vars=True)
            # Re-tie: parameters built on meta and re-created above keep their sharing.
            for a, src in tied.items():
                owner, leaf = _owner(module, a)
                if leaf in owner._parameters and isinstance(fresh[src], torch.nn.Parameter):
                    owner._parameters[leaf] = fresh[src]
            fresh = module.state_dict(keep_vars=True)
        wants = []
        for n in owned:
            if n not in targets:
                continue
            t = fresh[n]
            if _is_dtensor(t):
                wants.append(_dtensor_want(n, t, post))
                continue
            data = t.data if isinstance(t, torch.nn.Parameter) else t
            if data.is_contiguous():
                wants.append(Want(n, 0, data.view(-1)))
            else:
                tmp = torch.empty(data.numel(), dtype=data.dtype, device=data.device)
                post.append(lambda data=data, tmp=tmp: data.copy_(tmp.view(data.shape)))
                wants.append(Want(n, 0, tmp))
        return wants

    _, _, _, report = _engine(path, dp, mp, opts, False, None, make_wants)
    with torch.no_grad():
        for fn in post:
            fn()
    return dataclasses.replace(report, unloaded=tuple(unloaded))

