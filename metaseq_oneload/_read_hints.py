"""Which byte ranges of objects a fill is about to read, announced to the storage layer
so that neighbouring ones share requests (:func:`._storage.expecting`).

A rank's wants are filled one at a time; each read of an object would otherwise be its own
ranged request (one per stored extent, and per ``part_bytes``), ~10-50 ms each on a real
store whatever its length. The ranges are derived here exactly as :func:`._execute.read_stored`
walks them (flat copies of extents with a byte offset); block copies and files read whole
are left out (they read as before).
"""

from __future__ import annotations

import contextlib
from typing import Mapping, Sequence

import torch

from ._plan import FlatCopy
from ._storage import expecting, is_url

__all__ = ["object_reads", "sharing_requests"]


def object_reads(targets: Mapping, wants: Sequence) -> list:
    """(local) (url, byte offset, nbytes) of every object read that filling ``wants``
    (``_execute.Want``s of ``targets``) by flat copies will make, in fill order."""
    out: list = []
    for w in wants:
        start, stop = w.start, w.start + w.out.numel()
        for c in targets[w.name].copies:
            if not isinstance(c, FlatCopy):
                continue
            lo, hi = max(start, c.dst_start), min(stop, c.dst_start + c.length)
            if lo >= hi or not any(is_url(e.path) for e in c.src.extents):
                continue
            itemsize = torch.empty((), dtype=c.src.dtype).element_size()
            a, b, pos = c.src_start + lo - c.dst_start, c.src_start + hi - c.dst_start, 0
            for e in c.src.extents:
                x, y = max(a, pos), min(b, pos + e.numel)
                if x < y and e.byte_offset is not None and is_url(e.path):
                    out.append((e.path, e.byte_offset + (x - pos) * itemsize, (y - x) * itemsize))
                pos += e.numel
                if pos >= b:
                    break
    return out


@contextlib.contextmanager
def sharing_requests(targets: Mapping, wants: Sequence):
    """(local) While the block fills ``wants``, their neighbouring object reads share requests."""
    reads = object_reads(targets, wants)
    if not reads:
        yield
        return
    with expecting(reads):
        yield
