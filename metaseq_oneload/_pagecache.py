"""What the page cache holds of a piece of a local file (``mincore`` over a mapping of it),
and advice on a process's own pages (``madvise``).

:class:`RangeReader` asks this before each large piece of a load that is its file's only
reader, under ``METASEQ_ONELOAD_O_DIRECT=auto``: a piece the cache holds is copied out of it (``preadv``), one it
does not hold is read with ``O_DIRECT`` straight into the destination, so a warm file never
pays for the device and a cold one never pays for the copy through the cache.

The mapping is never touched (no page of it is faulted in, so it adds nothing to the
process's resident memory); ``mincore`` reads the cache's state of the file's pages. Where the
kernel will not say (a file this process could not open for writing and does not own: Linux
then reports every page resident, by design) or the platform has no ``mincore``, the answer
is "unknown" (None), which keeps the ordinary buffered read and every reading thread: the
probe can only ever choose ``O_DIRECT`` (or fewer threads) for pages the kernel says it lacks
(or holds).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from typing import Optional

__all__ = ["Residency", "advise", "prefault", "MADV_DONTNEED", "MADV_POPULATE_READ"]

_PAGE = mmap.PAGESIZE
# bit 0 of each byte mincore writes is the page's residency; the other bits are undefined
_LOW_BIT = bytes(i & 1 for i in range(256))
# Residency.held over more than _WINDOWS * _WINDOW pages asks of that many pages, in evenly
# spaced windows: mincore walks the page cache a page at a time (73 ns a page here: 0.3 ms per
# 16 MiB piece, 40 ms per pass over a 2 GiB file, a tenth of a warm 0.27 GiB load), while the
# cache holds a file in runs (read-ahead windows, large folios, what a reader left).
_WINDOWS, _WINDOW = 16, 16


def _libc():
    try:  # the symbols the process already has: no ldconfig run to find libc by name
        lib = ctypes.CDLL(None, use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                             ctypes.c_long)
        lib.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
        lib.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
        lib.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        return lib
    except (OSError, AttributeError):  # no mincore here (not Linux or a BSD)
        return None


_LIBC = _libc()
_MAP_FAILED = ctypes.c_void_p(-1).value
MADV_DONTNEED, MADV_POPULATE_READ, _MADV_POPULATE_WRITE = 4, 22, 23  # Linux's numbers (the last two: 5.14)
_prefaults: list = []  # [whether this kernel takes MADV_POPULATE_WRITE], once asked


def _whole_pages(address: int, nbytes: int) -> tuple:
    """(first, end) of the whole pages inside ``nbytes`` at ``address``: advice never
    reaches the bytes of a neighbour sharing a page at either edge."""
    return -(-address // _PAGE) * _PAGE, (address + nbytes) // _PAGE * _PAGE


def advise(address: int, nbytes: int, advice: int) -> bool:
    """(local) ``madvise`` over the whole pages inside ``nbytes`` at ``address``; whether the
    kernel took it (best effort: where it did not, the pages are as they were)."""
    lo, hi = _whole_pages(address, nbytes)
    if hi <= lo or _LIBC is None or not hasattr(_LIBC, "madvise"):
        return False
    return _LIBC.madvise(lo, hi - lo, advice) == 0


def _populates() -> bool:
    """Whether the kernel takes ``MADV_POPULATE_WRITE`` (5.14+), asked once on a page of our
    own: asked on a destination, a refusal could be that mapping's (I/O memory, read-only)."""
    if not _prefaults:
        page = mmap.mmap(-1, _PAGE)
        try:
            view = (ctypes.c_char * _PAGE).from_buffer(page)
            try:
                _prefaults.append(advise(ctypes.addressof(view), _PAGE, _MADV_POPULATE_WRITE))
            finally:
                del view
        finally:
            page.close()
    return _prefaults[0]


def _mapped(address: int) -> bool:
    vec = ctypes.create_string_buffer(1)
    return _LIBC.mincore(address, _PAGE, vec) == 0 and bool(vec.raw[0] & 1)


def prefault(address: int, nbytes: int) -> None:
    """(local) Map the fresh pages of a destination in one call before a read fills them
    (``MADV_POPULATE_WRITE``): the kernel allocates them in a loop of its own instead of
    taking a fault per 4 KiB page as ``preadv`` writes (measured: a warm 1 GiB load 15% faster;
    docs/performance-history.md, fourth stop). The bytes are left as they are. A destination whose first and last
    whole pages are mapped already (a reused staging buffer, a module's parameters) is left
    alone: there the walk over mapped pages cost more than the read saved (about 130 ns per
    page against a warm copy's 5 ms per 64 MiB). Nothing where the kernel lacks the advice."""
    lo, hi = _whole_pages(address, nbytes)
    if hi <= lo or _LIBC is None or not _populates() or (_mapped(lo) and _mapped(hi - _PAGE)):
        return
    advise(lo, hi - lo, _MADV_POPULATE_WRITE)  # a refusal (ENOMEM, EFAULT) leaves the faults to preadv


_CAP_FOWNER = 3


def _acts_as_owner() -> bool:
    """Whether this process holds CAP_FOWNER (root, unless a container dropped it)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_FOWNER & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def _overflow_uid() -> int:
    try:
        with open("/proc/sys/kernel/overflowuid") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65534


def _tells(fd: int, st: os.stat_result) -> bool:
    """Whether ``mincore`` tells this process the page cache's state of the file open as
    ``fd`` (its ``os.fstat``: ``st``). Linux (5.2 and later, ``can_do_mincore``) tells it only for a file the process owns,
    may act as the owner of (CAP_FOWNER, over an owner its user namespace maps: not the
    overflow uid a bind mount from outside shows), or could open for writing; for any other it
    says every page is resident. Errs towards "does not tell" (a read-only bind mount refuses
    the write check here though the kernel would tell): the reader then only loses its choice."""
    try:
        if st.st_uid == os.geteuid() or (_acts_as_owner() and st.st_uid != _overflow_uid()):
            return True
        if os.access not in os.supports_effective_ids:
            return False
        return os.access(f"/proc/self/fd/{fd}", os.W_OK, effective_ids=True)
    except (OSError, AttributeError):
        return False


def _address_space_unlimited() -> bool:
    try:
        import resource

        return resource.getrlimit(resource.RLIMIT_AS)[0] == resource.RLIM_INFINITY
    except (ImportError, OSError, ValueError):
        return False


class Residency:
    """(local) The page-cache state of pieces of the local files one reader reads. Each file
    is mapped once, whole, at its first question and unmapped by :meth:`close`: a mapping per
    question would take the address space's lock for writing twice per piece, stalling the
    reader's threads that fault their destinations' fresh pages in meanwhile (measured: a warm
    2 GiB load 1.36x the limit with one per 16 MiB piece, 1.07x with one per file). A process
    whose address space is limited (``ulimit -v``) maps nothing: a checkpoint's files would
    take that much of its headroom, so nothing is known of any piece (buffered reads).
    Thread-safe: the reader's pool asks from every thread."""

    def __init__(self):
        self._maps: dict = {}  # path -> (address, length), or None where it cannot be mapped
        self._lock = threading.Lock()
        self._can_map = _LIBC is not None and _address_space_unlimited()

    def _map(self, path: str, fd: int) -> Optional[tuple]:
        with self._lock:
            if path in self._maps:
                return self._maps[path]
            entry = None
            if self._can_map:
                try:
                    st = os.fstat(fd)
                except OSError:
                    st = None
                size = st.st_size if st is not None and _tells(fd, st) else 0
                if size > 0:
                    addr = _LIBC.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
                    if addr not in (None, _MAP_FAILED):
                        entry = (addr, size)
            self._maps[path] = entry
            return entry

    def held(self, path: str, fd: int, offset: int, n: int, windows: int = _WINDOWS) -> Optional[float]:
        """The share (0..1) of the pages under bytes ``offset .. offset+n`` of ``path`` (open
        as ``fd``) that the page cache holds now, from ``windows`` (at least 2) evenly spaced
        windows of 16 pages where the range has more (exact at either end, and for a range held
        whole or not at all); 1.0 where nothing is asked (nothing to read
        from the device); None where it cannot be told (see the module docstring and the
        class's): a caller then reads as if it did not know, never as if the cache held it."""
        if n <= 0:
            return 1.0
        entry = self._map(path, fd)
        if entry is None:
            return None
        addr, size = entry
        a = offset // _PAGE * _PAGE
        b = min(size, offset + n)  # (a file grown since it was mapped: its first bytes tell)
        if b <= a:
            return 1.0
        pages = -(-(b - a) // _PAGE)
        count = max(2, windows)
        if pages <= count * _WINDOW:
            spans = [(a, b - a)]
        else:  # evenly spaced, the first at the range's start and the last at its end
            gap = (pages - _WINDOW) // (count - 1)
            spans = [(a + i * gap * _PAGE, _WINDOW * _PAGE) for i in range(count - 1)]
            spans.append((a + (pages - _WINDOW) * _PAGE, b - a - (pages - _WINDOW) * _PAGE))
        vec = ctypes.create_string_buffer(min(pages, count * _WINDOW))
        held = asked = 0
        for at, length in spans:
            if _LIBC.mincore(addr + at, length, vec) != 0:
                return None
            n = -(-length // _PAGE)
            held += vec.raw[:n].translate(_LOW_BIT).count(1)
            asked += n
        return held / asked

    def close(self) -> None:
        """(local, after the reader's last read) Unmap every file."""
        with self._lock:
            for entry in self._maps.values():
                if entry is not None:
                    _LIBC.munmap(entry[0], entry[1])
            self._maps.clear()
