"""Interrupts that reach the main thread in time, and are never committed.

A signal sent to a process (Ctrl-C's SIGINT, a scheduler's SIGTERM) goes to any one of its
threads; to a process that was stopped (Ctrl-Z, a scheduler's suspend) and resumed, to
whichever thread runs first: one of the package's pools, or one of torch's own threads.
CPython 3.11 and older on POSIX run the Python handler only on the main thread and, when
another thread took the signal, do not tell the main thread's interpreter loop
(``_PyEval_SignalReceived`` does not set its eval breaker there): the ``KeyboardInterrupt``
then came late, inside a finalizer that drops it ("Exception ignored"), or never, and an
interrupted export ran to its end and exited 0. Two measures:

* :func:`check_signals`, on the main thread, runs the handlers of any signal that arrived on
  any thread: writers call it for each chunk and before they commit (a rename into place),
  readers for each large read, so Ctrl-C stops a verb within one chunk;
* under :func:`interruptible` (the command line's verbs) each SIGINT (and SIGTERM, for the
  verbs that write) is also recorded, and ``check_signals(commit=True)`` raises it again:
  an interrupted writer does not move its output into place, even where the first exception
  was lost. A signal after that last check lets the finished output stand (the verb still
  exits as interrupted).

The package's threads leave the signal mask alone: a mask they blocked would pass to every
process started from them (a credential helper, a user's progress callback's child), which
Ctrl-C and SIGTERM could then no longer stop.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator

__all__ = ["check_signals", "interruptible"]

_MAIN = threading.main_thread()
_RECORDED: list = []  # signals that arrived under interruptible(), in order


def check_signals(commit: bool = False) -> None:
    """(local, any thread) On the main thread, run the Python handlers of signals that
    arrived on any thread (a ``KeyboardInterrupt`` raises here); elsewhere nothing. Cheap (one
    system call, under a microsecond): once per chunk, never per element. ``commit``: the
    caller is about to move an output into place; a signal recorded under
    :func:`interruptible` raises again, whatever became of its first exception."""
    if threading.current_thread() is not _MAIN:
        return
    if hasattr(signal, "pthread_sigmask"):
        # pthread_sigmask is the one call of the signal module that ends with
        # PyErr_CheckSignals(), which runs the handlers whatever thread the signal came to
        signal.pthread_sigmask(signal.SIG_BLOCK, ())
    if commit and _RECORDED:
        _raise(_RECORDED[0])


def _raise(signum: int) -> None:
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise SystemExit(128 + signum)  # SIGTERM: unwind (temporary files removed), exit as killed by it


def _record(signum: int, frame) -> None:
    _RECORDED.append(signum)
    _raise(signum)


@contextlib.contextmanager
def interruptible(term: bool = False) -> Iterator[None]:
    """(local, main thread; elsewhere a no-op) While inside, SIGINT raises
    ``KeyboardInterrupt`` and, with ``term``, SIGTERM raises ``SystemExit(143)`` (both unwind,
    so temporary files are removed), each recorded for :func:`check_signals`'s ``commit``.
    Without ``term`` SIGTERM keeps its handler (by default it ends the process at once: a verb
    that writes nothing has nothing to unwind, and a thread stuck in a read would hold up an
    orderly exit). The previous handlers come back on exit and the record is cleared, with
    both signals held off meanwhile so that a late one cannot cut the restore short."""
    if threading.current_thread() is not _MAIN:
        yield
        return
    _RECORDED.clear()
    previous: dict = {}
    try:
        for sig in (signal.SIGINT, signal.SIGTERM) if term else (signal.SIGINT,):
            previous[sig] = signal.signal(sig, _record)
        yield
    finally:
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, previous) if hasattr(signal, "pthread_sigmask") else None
        try:
            for sig, handler in previous.items():
                # None: a handler installed from C, which Python cannot put back (the default instead)
                signal.signal(sig, signal.SIG_DFL if handler is None else handler)
            _RECORDED.clear()
        finally:
            if mask is not None:  # one held off meanwhile goes to the handler just put back
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
