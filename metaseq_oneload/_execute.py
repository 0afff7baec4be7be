"""The one place checkpoint bytes land in memory, and the executor of a load's plan.

Every verb (a load on any strategy, ``convert``, ``consolidate``, ``export-hf``, ``verify``,
optimizer state) reads through :func:`fill`: the elements ``start..start+len(out)`` of a
planned target tensor, read by byte range from the stored pieces that hold them (only those
ranges; padding and model-parallel splits handled exactly), with every check the reader
makes. :func:`fill_all` fills a rank's wants; :func:`stream` hands a sink the chunks of a
list of :class:`ReadItem` in order, through one reusable buffer (a file being written, a
running comparison). :func:`execute` carries out a load's :class:`~._planner.PartPlan`
exactly: each rank's own reads, or the broadcast buckets, or the pieces sent point to point,
or the read-once exchange's rounds, as the plan's value says; nothing about the route is
decided here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from ._dist import Group, first_failure
from ._errors import CheckpointLayoutError
from ._exchange import exchange_loop
from ._layout import StoredTensor
from ._plan import BlockCopy, FlatCopy, TargetTensor
from ._read_hints import sharing_requests
from ._reading import RangeReader
from ._storage import is_url

__all__ = ["ReadItem", "Want", "fill", "fill_all", "stream", "read_stored", "stored_parts", "plain_runs", "byte_runs",
           "execute", "counting", "sum64", "pieces", "bucket_need"]


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
class ReadItem:
    """Elements ``start .. stop`` of target ``name`` (flattened), in a plan's order."""

    name: str
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


def read_stored(src: StoredTensor, start: int, out: torch.Tensor, reader) -> None:
    """Elements ``start..`` of a stored tensor (flattened) into 1-D ``out``."""
    for ext, at, lo, hi in stored_parts(src, start, out.numel()):
        reader.read_extent(ext, at, out[lo:hi], src.dtype)


def stored_parts(src: StoredTensor, start: int, n: int) -> list:
    """(extent, its element ``at``, ``lo``, ``hi``): elements ``lo..hi`` of a read of ``n``
    elements of ``src`` from ``start`` on are the extent's from ``at`` on. Every element is
    covered, or nothing is read: a destination is never left partly unwritten, silently."""
    parts, pos, filled = [], 0, 0
    for ext in src.extents:
        lo, hi = max(start, pos), min(start + n, pos + ext.numel)
        if lo < hi:
            parts.append((ext, lo - pos, lo - start, hi - start))
            filled += hi - lo
        pos += ext.numel
        if pos >= start + n:
            break
    if filled != n:
        raise CheckpointLayoutError(
            f"{src.name}: the stored pieces cover {filled} of the {n} elements wanted at offset {start} "
            f"(the tensor holds {src.numel}); the checkpoint's metadata does not match its tensors.")
    return parts


def fill(target: TargetTensor, out: torch.Tensor, start: int, reader) -> None:
    """(local) Elements ``start..start+len(out)`` of ``target`` into 1-D ``out``."""
    stop = start + out.numel()
    with torch.no_grad():
        for c in target.copies:
            if isinstance(c, FlatCopy):
                lo, hi = max(start, c.dst_start), min(stop, c.dst_start + c.length)
                if lo < hi:
                    read_stored(c.src, c.src_start + lo - c.dst_start, out[lo - start: hi - start], reader)
                continue
            fill_block(c, out, start, stop, reader)


def fill_block(c: BlockCopy, out: torch.Tensor, start: int, stop: int, reader) -> None:
    dc, sc = c.dst_cols, c.src_cols
    first, last = start // dc, min(c.rows, -(-stop // dc))
    itemsize = torch.empty((), dtype=c.src.dtype).element_size()
    # Splitting a row-parallel weight wants a column block of every row: read just those
    # runs (one per row) rather than whole rows when they are at most half of each row.
    narrow = 2 * c.ncols <= sc
    step = max(1, reader.chunk_bytes // max(1, (c.ncols if narrow else sc) * itemsize))
    for r0 in range(first, last, step):
        r1 = min(last, r0 + step)
        if narrow:
            block = torch.empty((r1 - r0, c.ncols), dtype=c.src.dtype)
            for r in range(r0, r1):
                read_stored(c.src, r * sc + c.src_col0, block[r - r0], reader)
        else:
            rows = torch.empty((r1 - r0) * sc, dtype=c.src.dtype)
            read_stored(c.src, r0 * sc, rows, reader)
            block = rows.view(r1 - r0, sc)[:, c.src_col0: c.src_col0 + c.ncols]
        if start <= r0 * dc and r1 * dc <= stop:
            out[r0 * dc - start: r1 * dc - start].view(r1 - r0, dc)[:, c.dst_col0: c.dst_col0 + c.ncols].copy_(block)
            continue
        for r in range(r0, r1):
            p0 = r * dc + c.dst_col0
            lo, hi = max(start, p0), min(stop, p0 + c.ncols)
            if lo < hi:
                out[lo - start: hi - start].copy_(block[r - r0, lo - p0: hi - p0])


def plain_runs(target: TargetTensor) -> bool:
    """Whether every element of ``target`` is read by offset from a local file, with no
    block copies and no file read whole (legacy): such fills touch nothing shared but the
    reader's descriptors. (URLs keep one fill at a time: their reads already go in parallel
    requests, and small reads that follow each other share one.)"""
    return all(isinstance(c, FlatCopy) and all(e.byte_offset is not None and not is_url(e.path)
                                               for e in c.src.extents)
               for c in target.copies)


def fill_all(targets: Mapping[str, TargetTensor], wants: Sequence[Want], reader, progress,
              threads: Optional[int] = None) -> None:
    """(local) Fill every want. Wants read by plain offsets into memory of their stored dtype
    go to the reader as one list of byte runs, read in file order on its threads
    (``RangeReader.read_runs``); those that want a cast go a few at a time, so that the reads
    (and page faults) of many small tensors overlap as one large tensor's pieces do inside the
    reader; the others, and progress, stay on this thread."""
    threads = threads or min(4, getattr(reader, "read_threads", 1))
    pooled = [w for w in wants if threads > 1 and plain_runs(targets[w.name])]
    ids = {id(w) for w in pooled}
    serial = [w for w in wants if id(w) not in ids]
    with sharing_requests(targets, serial):  # an object's neighbouring ranges: one request
        for w in serial:
            fill(targets[w.name], w.out, w.start, reader)
            if progress:
                progress(w.out.numel() * w.out.element_size())
    if not pooled:
        return
    # (asked of the class: a reader that wraps one, to see the bytes, forwards any other
    # attribute, and reads runs only where it says so itself)
    reads_runs = getattr(type(reader), "reads_runs", False)
    runs = byte_runs(targets, pooled, sources=not isinstance(reader, RangeReader)) if reads_runs else None
    if runs is not None:
        reader.read_runs(runs, progress)
        return
    from concurrent.futures import ThreadPoolExecutor, as_completed

    pool = ThreadPoolExecutor(threads, thread_name_prefix="oneload-fill")
    try:
        futures = {pool.submit(fill, targets[w.name], w.out, w.start, reader): w for w in pooled}
        for f in as_completed(futures):
            f.result()  # the first failure stops the fill, as a serial one would
            if progress:
                w = futures[f]
                progress(w.out.numel() * w.out.element_size())
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def byte_runs(targets: Mapping[str, TargetTensor], wants: Sequence[Want], sources: bool = False) -> Optional[list]:
    """(path, file offset, destination) for every element of ``wants`` (each planned as
    :func:`plain_runs`), as :func:`fill` would read them: ``RangeReader.read_runs`` reads such
    a list in file order. With ``sources``, each run also carries the :class:`Extent` it reads
    and its first element there (the digest check's reader hashes by extent). None where a
    destination wants a cast, or is not contiguous CPU memory: those go through :func:`fill`."""
    runs = []
    for w in wants:
        if w.out.device.type != "cpu" or not w.out.is_contiguous():
            return None
        for c in targets[w.name].copies:
            lo, hi = max(w.start, c.dst_start), min(w.stop, c.dst_start + c.length)
            if lo >= hi:
                continue
            if c.src.dtype != w.out.dtype:
                return None
            out, size = w.out[lo - w.start: hi - w.start], w.out.element_size()
            for ext, at, a, b in stored_parts(c.src, c.src_start + lo - c.dst_start, hi - lo):
                run = (ext.path, ext.byte_offset + at * size, out[a:b])
                runs.append(run + (ext, at) if sources else run)
    return runs


def stream(items: Sequence[ReadItem], targets: Mapping[str, TargetTensor], reader, chunk_bytes: int,
           buffer: Optional[torch.Tensor] = None) -> Iterator[tuple]:
    """(local) ``(item, data)`` for each item in order, ``data`` a 1-D view of the item's
    elements in the target's dtype. Items larger than ``chunk_bytes`` come in pieces of at
    most that size (each yielded as a ReadItem of its own). The view is valid until the next
    step: one staging buffer of ``chunk_bytes`` serves the whole stream."""
    if buffer is None:
        buffer = torch.empty(max(1, chunk_bytes), dtype=torch.uint8)
    for item in items:
        t = targets[item.name]
        itemsize = torch.empty((), dtype=t.dtype).element_size()
        per = max(1, buffer.numel() // itemsize)
        for lo in range(item.start, item.stop, per):
            hi = min(item.stop, lo + per)
            out = buffer[: (hi - lo) * itemsize].view(t.dtype)
            fill(t, out, lo, reader)
            yield ReadItem(item.name, lo, hi), out


# --------------------------------------------------------------------------- the executor


def counting(progress: Optional[Callable[[int, int], None]], total: int) -> Optional[Callable[[int], None]]:
    """(local) What the loops call with each landed piece's bytes: ``progress`` with (bytes
    done so far, ``total``), the shape of every verb's callback. A loop may count bytes this
    rank only passed on (the scatter's reader) or count them in the stored dtype; the count
    is held to ``total``, and ``advance.finish()`` (after a load that succeeded) ends it
    exactly there, so a callback never sees more than the total nor stops short of it."""
    if progress is None:
        return None
    done = 0

    def advance(nbytes: int) -> None:
        nonlocal done
        now = min(total, done + nbytes)
        if now != done:
            done = now
            progress(done, total)

    def finish() -> None:
        if done < total:
            advance(total - done)

    advance.finish = finish
    return advance


def sum64(t: torch.Tensor, step: int = 1 << 20) -> float:
    """float64 sum of a 1-D tensor, a chunk at a time (no float64 copy of the whole)."""
    t = t.detach()
    return sum(float(t[i: i + step].double().sum()) for i in range(0, t.numel(), step))


def execute(part, dp: Group, targets: Mapping[str, TargetTensor], wants: Sequence[Want], ranges: Sequence,
            reader, shm_dir: str, verify: bool, advance) -> tuple:
    """(collective over ``dp``) Carry out ``part`` (a ``_planner.PartPlan``): its mode, its
    buckets or rounds, its channels. Returns (this rank's error or None, per-target sums of
    what arrived by broadcast (for verify), bytes moved {received, from_other_nodes, sent}).
    Never raises: the caller settles, so every rank leaves after the same collectives."""
    if part.mode == "broadcast":
        error, sums = _broadcast_loop(dp, part.schedule, targets, wants, reader, verify, advance)
        return error, sums, {}
    if part.mode == "scatter":
        return _scatter_loop(dp, part.schedule, targets, wants, ranges, reader, advance), {}, {}
    if part.mode == "exchange":
        shm = shm_dir if any(t.channel == "shm" for t in part.transfers) else None
        error, moved = exchange_loop(dp, part.exchange, targets, wants, reader, fill, advance, shm)
        return error, {}, moved
    try:
        fill_all(targets, wants, reader, advance)
    except Exception as e:
        return e, {}, {}
    return None, {}, {}


def _broadcast_loop(dp: Group, buckets: Sequence, targets: Mapping[str, TargetTensor], wants: Sequence[Want],
                    reader, verify: bool, advance) -> tuple:
    """(collective over ``dp``) Rank 0 reads and broadcasts; everyone copies what it
    wants. For loads where every rank wants everything (``flat=False``). Returns (this
    rank's error or None, per-target sums of what arrived, for verify)."""
    by_name = _by_name(wants)
    sums: dict = {}
    status = torch.zeros(1, dtype=torch.int64, device=dp.device)
    bucket, error = None, None
    try:
        if any(not b.direct for b in buckets):
            bucket = torch.empty(bucket_need(buckets, targets), dtype=torch.uint8, device=dp.device)
    except Exception as exc:  # e.g. out of (GPU) memory: say so before anyone waits
        error = exc
    error = first_failure(dp, error)
    if error is not None:
        return error, sums
    step = dp.step
    for k, b in enumerate(buckets):
        dp.at(f"{step} (broadcast, bucket {k + 1} of {len(buckets)})")
        if b.direct:
            e = b.entries[0]
            views = [by_name[e.name][0].out[e.start: e.start + e.length]]
        else:
            views = _bucket_views(bucket, b.entries, targets)

        def read(entries=b.entries, views=views):
            for e, v in zip(entries, views):
                fill(targets[e.name], v, e.start, reader)

        failed, stop = _announce(dp, status, read)
        error = error or failed
        if stop:
            break
        if b.direct:
            dp.broadcast(views[0])
        else:
            dp.broadcast(bucket[: b.entries[-1].offset + views[-1].numel() * views[-1].element_size()])
        if error is not None:
            continue  # this rank already failed; keep the stream in step, copy nothing
        try:
            for e, v in zip(b.entries, views):
                if verify:
                    sums[e.name] = sums.get(e.name, 0.0) + sum64(v)
                if not b.direct:
                    _scatter_local(by_name.get(e.name, ()), e, v)
            if advance:
                advance(sum(v.numel() * v.element_size() for v in views))
        except Exception as exc:
            error = exc
    return error, sums


def _by_name(wants: Sequence[Want]) -> dict:
    out: dict = {}
    for w in wants:
        out.setdefault(w.name, []).append(w)
    return out


def bucket_need(buckets: Sequence, targets: Mapping[str, TargetTensor]) -> int:
    """The staging bucket a schedule's shared buckets fill: the largest of them (at most
    ``bucket_mb``; a checkpoint smaller than the bucket gets a bucket its own size)."""
    need = 0
    for b in buckets:
        if not b.direct and b.entries:
            e = b.entries[-1]
            need = max(need, e.offset + e.length * torch.empty((), dtype=targets[e.name].dtype).element_size())
    return need


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


def _bucket_views(bucket: torch.Tensor, entries: Sequence, targets: Mapping[str, TargetTensor]) -> list:
    views = []
    for e in entries:
        t = targets[e.name]
        nbytes = e.length * torch.empty((), dtype=t.dtype).element_size()
        views.append(bucket[e.offset: e.offset + nbytes].view(t.dtype))
    return views


def _scatter_local(wants: Sequence[Want], e, v: torch.Tensor) -> None:
    """Copy the parts of bucket entry ``e`` (data ``v``) that ``wants`` cover."""
    for w in wants:
        lo, hi = max(w.start, e.start), min(w.stop, e.start + e.length)
        if lo < hi:
            w.out[lo - w.start: hi - w.start].copy_(v[lo - e.start: hi - e.start])


def pieces(entries: Sequence, ranges: Sequence[Mapping]) -> list:
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


def _scatter_loop(dp: Group, buckets: Sequence, targets: Mapping[str, TargetTensor], wants: Sequence[Want],
                  ranges: Sequence, reader, advance) -> Optional[BaseException]:
    """(collective over ``dp``) Rank 0 reads a bucket at a time and sends every rank
    exactly its pieces, point to point; receivers take them straight into their output
    tensors. For loads where ranks want different pieces (flat shards, DTensor shards):
    each byte crosses the wire once, and receivers hold no bucket. Returns this rank's
    error or None."""
    by_name = _by_name(wants)
    status = torch.zeros(1, dtype=torch.int64, device=dp.device)
    bucket, error = None, None
    try:
        if dp.rank == 0:
            bucket = torch.empty(bucket_need(buckets, targets), dtype=torch.uint8, device=dp.device)
    except Exception as exc:
        error = exc
    error = first_failure(dp, error)
    if error is not None:
        return error
    tag, step = 0, dp.step
    for k, b in enumerate(buckets):
        found = pieces(b.entries, ranges)
        if not found:
            continue
        dp.at(f"{step} (scatter, bucket {k + 1} of {len(buckets)})")
        views = _bucket_views(bucket, b.entries, targets) if dp.rank == 0 else None

        def read(entries=b.entries, views=views):
            for e, v in zip(entries, views):
                fill(targets[e.name], v, e.start, reader)
            for e, v in zip(entries, views):
                _scatter_local(by_name.get(e.name, ()), e, v)
            if advance:
                advance(sum(v.numel() * v.element_size() for v in views))

        failed, stop = _announce(dp, status, read)
        error = error or failed
        if stop:
            break
        posts, landing, got, error = _landing(dp, found, b.entries, wants, targets, error)
        if dp.all_max(0 if error is None else 1):  # only if every receiver has room does anyone send
            break
        with dp.guard():
            handles = []
            for j, (i, r, lo, hi, _) in enumerate(found):
                if dp.rank == 0 and r != 0:
                    e = b.entries[i]
                    handles.append(dist.isend(views[i][lo - e.start: hi - e.start], dst=dp.global_of(r),
                                              group=dp.group, tag=tag + j))
                elif j in posts:
                    handles.append(dist.irecv(posts[j], src=dp.global_of(0), group=dp.group, tag=tag + j))
            tag += len(found)
            dp.wait_all(handles)  # a peer that raised out of the load is noticed here too
        if dp.rank != 0:
            try:
                for out, tmp in landing:
                    out.copy_(tmp)
                if advance and got:
                    advance(got)
            except Exception as exc:
                error = exc
    return error


def _landing(dp: Group, found: Sequence, entries: Sequence, wants: Sequence[Want],
             targets: Mapping[str, TargetTensor], error: Optional[BaseException]) -> tuple:
    """(local) A receiver's landing places for its pieces of one bucket: (receive buffer by
    piece, (output, staging) pairs to copy after, bytes, error)."""
    posts, landing, got = {}, [], 0
    if dp.rank == 0 or error is not None:
        return posts, landing, got, error
    try:
        for j, (i, r, lo, hi, widx) in enumerate(found):
            if r != dp.rank:
                continue
            w = wants[widx]
            out = w.out[lo - w.start: hi - w.start]
            t = targets[entries[i].name]
            if out.dtype == t.dtype and out.device == dp.device and out.is_contiguous():
                posts[j] = out
            else:
                posts[j] = torch.empty(hi - lo, dtype=t.dtype, device=dp.device)
                landing.append((out, posts[j]))
            got += (hi - lo) * out.element_size()
    except Exception as exc:
        return posts, landing, got, exc
    return posts, landing, got, None
