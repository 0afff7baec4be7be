"""The one place checkpoint bytes land in memory.

Every verb (a load on any strategy, ``convert``, ``consolidate``, ``export-hf``, ``verify``,
optimizer state) reads through :func:`fill`: the elements ``start..start+len(out)`` of a
planned target tensor, read by byte range from the stored pieces that hold them (only those
ranges; padding and model-parallel splits handled exactly), with every check the reader
makes. :func:`fill_all` fills a rank's wants; :func:`stream` hands a sink the chunks of a
list of :class:`ReadItem` in order, through one reusable buffer (a file being written, a
running comparison).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Mapping, Optional, Sequence

import torch

from ._errors import CheckpointLayoutError
from ._layout import StoredTensor
from ._plan import BlockCopy, FlatCopy, TargetTensor
from ._storage import is_url

__all__ = ["ReadItem", "fill", "fill_all", "stream", "read_stored", "plain_runs"]


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
    n = out.numel()
    pos, filled = 0, 0
    for ext in src.extents:
        lo, hi = max(start, pos), min(start + n, pos + ext.numel)
        if lo < hi:
            reader.read_extent(ext, lo - pos, out[lo - start: hi - start], src.dtype)
            filled += hi - lo
        pos += ext.numel
        if pos >= start + n:
            break
    if filled != n:  # never leave part of a destination silently unwritten
        raise CheckpointLayoutError(
            f"{src.name}: the stored pieces cover {filled} of the {n} elements wanted at offset {start} "
            f"(the tensor holds {src.numel}); the checkpoint's metadata does not match its tensors.")


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
    """(local) Fill every want. Wants read by plain offsets go a few at a time, so that the
    reads (and page faults) of many small tensors overlap as one large tensor's pieces do
    inside the reader; the others, and progress, stay on this thread."""
    threads = threads or min(4, getattr(reader, "read_threads", 1))
    pooled = [w for w in wants if threads > 1 and plain_runs(targets[w.name])]
    ids = {id(w) for w in pooled}
    for w in wants:
        if id(w) not in ids:
            fill(targets[w.name], w.out, w.start, reader)
            if progress:
                progress(w.out.numel() * w.out.element_size())
    if not pooled:
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
