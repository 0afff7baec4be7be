"""Worker threads that leave the process's signals to its main thread.

A signal sent to a process (Ctrl-C's SIGINT, a scheduler's SIGTERM) goes to any one of its
threads that does not block it; on a process that was stopped (Ctrl-Z, a scheduler's
suspend) and resumed, to whichever thread runs first. CPython 3.11 and older on POSIX run
the Python handler only on the main thread and, when another thread took the signal, do
not tell the main thread's interpreter loop (``_PyEval_SignalReceived`` does not force its
eval breaker there): the ``KeyboardInterrupt`` then comes late, inside a finalizer that
swallows it, or never, and an interrupted export ran to its end and exited 0. Two
measures, since threads this package did not start (torch's, from its import and its
OpenMP pool) take signals too:

* every thread this package starts blocks the signals a program handles, so the kernel
  hands them to the main thread rather than to one of ours;
* :func:`check_signals`, on the main thread, runs the handlers of any signal another
  thread took: the writers call it for each chunk and before they commit (a rename into
  place), the readers for each large read, so Ctrl-C stops a verb within one chunk.

A handler's exception can still be lost where it lands in a finalizer (CPython prints
"Exception ignored" and goes on). Under :func:`interruptible` (the command line's verbs)
the signal is also recorded, and :func:`check_signals` with ``commit=True`` raises it
again: an interrupted writer never moves its output into place.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import signal
import threading
from typing import Callable, Iterator

_MAIN = threading.main_thread()
_RECORDED: list = []  # signals that arrived under interruptible(), in order

__all__ = ["pool", "thread", "check_signals", "interruptible", "DEFERRED"]

# Sent to the whole process and meant for the program's own handlers (or their default
# action, which ends the whole process whichever thread is chosen). Not the faults
# (SIGSEGV, SIGBUS, SIGFPE), which the kernel sends to the thread that caused them.
DEFERRED = frozenset(getattr(signal, name) for name in
                     ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGALRM")
                     if hasattr(signal, name))


def _leave_signals() -> None:
    if hasattr(signal, "pthread_sigmask"):  # POSIX; elsewhere signals already go to the main thread
        signal.pthread_sigmask(signal.SIG_BLOCK, DEFERRED)


def pool(max_workers: int, name: str) -> concurrent.futures.ThreadPoolExecutor:
    """(local) A thread pool whose threads block :data:`DEFERRED` (named ``name``)."""
    return concurrent.futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=name,
                                                 initializer=_leave_signals)


def thread(target: Callable[[], None], name: str, daemon: bool = True) -> threading.Thread:
    """(local) A started thread running ``target`` with :data:`DEFERRED` blocked."""

    def run() -> None:
        _leave_signals()
        target()

    t = threading.Thread(target=run, name=name, daemon=daemon)
    t.start()
    return t


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
def interruptible() -> Iterator[None]:
    """(local, main thread; elsewhere a no-op) While inside, SIGINT raises
    ``KeyboardInterrupt`` and SIGTERM ``SystemExit(143)`` (both unwind, so temporary files are
    removed), and each is recorded for :func:`check_signals`'s ``commit``. The previous
    handlers come back on exit, and the record is cleared."""
    if threading.current_thread() is not _MAIN:
        yield
        return
    previous: dict = {}
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, _record)
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _RECORDED.clear()
