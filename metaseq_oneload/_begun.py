"""Where each rank's call to a load began: the check-in count of each of its groups when the
call started (:func:`begin`), which its check-in (:func:`metaseq_oneload._dist.arrive`, or
``tell_failed``) counts from (:func:`began`).

A call's discovery (an integration's, minutes on a cold file system) may outlast the other
ranks' ``arrival_timeout``: a check-in they gave up on meanwhile is this call's, so the rank
is told at once that it came too late, and its failure is recorded there, never left for
their next load. A note the call's check-in does not spend (the call raised first, or was
answered without loading) is dropped when the call ends (:func:`load_call`), so a rank's
next call is never taken for it.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Sequence

__all__ = ["BEGUN", "begin", "began", "load_call", "forget_begun"]

# Per global rank, per group, the check-in count where its call to a load began (begin);
# all of a rank's taken at once by the call's arrive or tell_failed.
BEGUN: dict = {}
_LOCK = threading.Lock()
# This thread's calls under way (load_call): depth, and the ranks whose notes they made.
_CALLS = threading.local()


def begin(groups: Sequence) -> None:
    """(this rank alone, one store look-up a group) Its call to a load begins: note each
    group's count of check-ins now, the ``since`` of the call's check-in (``_dist.arrive`` or
    ``tell_failed``). What the call does first (an integration's discovery: minutes on a
    cold file system) may outlast the others' ``arrival_timeout``: a check-in they give up
    on meanwhile is this call's, so the rank is told at once that it came too late, and its
    failure goes there, never to their next load. A count the call under way noted stays
    (an integration's discovery, then the entry point it leads to). Never raises."""
    for g in groups:
        key = g.begun_key() if g.active and g.size > 1 else None
        with _LOCK:
            if key is None or key in BEGUN.get(g.global_rank, {}):
                continue
        gen = g.generation()
        if gen is not None:
            with _LOCK:
                BEGUN.setdefault(g.global_rank, {}).setdefault(key, gen)
            if getattr(_CALLS, "depth", 0):
                _CALLS.ranks.add(g.global_rank)


@contextlib.contextmanager
def load_call() -> Iterator[None]:
    """(this rank alone) The extent of one call to a load (an entry point, an integration's
    patched function; also a decorator). A note :func:`begin` makes inside it and its
    check-in does not spend (the call raised first, or answered without loading) is dropped
    when the outermost call ends: never taken for the rank's next call, whose check-in the
    others may then be waiting at."""
    depth = getattr(_CALLS, "depth", 0)
    if depth == 0:
        _CALLS.ranks = set()
    _CALLS.depth = depth + 1
    try:
        yield
    finally:
        _CALLS.depth = depth
        if depth == 0:
            with _LOCK:
                for rank in _CALLS.ranks:
                    BEGUN.pop(rank, None)
            _CALLS.ranks = set()


def forget_begun(groups: Sequence) -> None:
    """(this rank alone) The call :func:`begin` noted ends without a check-in (every rank
    answers it without loading: no checkpoint yet): its next call is not taken for it."""
    for g in groups:
        with _LOCK:
            BEGUN.pop(g.global_rank, None)


def began(active: Sequence) -> list:
    """(this rank) Per group, the check-in count its call began at (:func:`begin`), else the
    count now; this rank's notes are spent (its next call begins anew)."""
    if not active:
        return []
    with _LOCK:
        noted = BEGUN.pop(active[0].global_rank, {})
    since = [noted.get(g.begun_key()) for g in active]
    return [g.generation() if s is None else s for g, s in zip(active, since)]
