"""How bytes move: local files, and object stores through fsspec, behind one small seam.

Local paths keep the engine's own code path (``os.stat``, ``os.preadv`` into the
destination); every function here answers a local path with the ``os`` call it replaces.
A URL (``s3://``, ``gs://``, ``az://``, ``http(s)://``, any fsspec protocol) goes to the
store through :mod:`._remote` (one request: its concurrency bound, retries and checked
answer; the ``METASEQ_ONELOAD_REMOTE_*`` settings), and this module keeps what a load
knows of each object:

* ranged reads only: a header read takes the archive's tail, its central directory, one
  local header per record and the ``data.pkl`` record, never a tensor's bytes; a data read
  takes exactly the bytes a rank needs, one request per read up to the part size (a
  longer read in parts of that size, fetched concurrently), each answer written into the
  destination's memory as it arrives (:func:`read_into`); reads a fill announces
  (:func:`expecting`) that lie close together in one object share requests: one ranged
  read per merged span (of at most ``span_bytes``), in parts of the part size. The part
  size is ``METASEQ_ONELOAD_REMOTE_PART_MB`` where set, else sized from the endpoint's
  measured answers (:func:`._remote.part_size_for`: 8 MiB, up to 32 MiB on a store whose
  requests cost more than their bytes);
* header bytes already fetched are shared between our zip parser and torch's reader of the
  same archive (:class:`RemoteFile`), and small reads that follow each other share requests;
* each object pinned from the first time it is seen (its size and ETag, and its VersionId
  where the bucket keeps versions) until the next discovery of its folder
  (:func:`refresh`): every read of it asks the store for that version (``If-Match``), and
  a store that holds another one now, or a stat that finds one, is a
  :class:`RemoteObjectChangedError` naming the object, never bytes of two versions in one
  load; what this process kept of the object is forgotten then.

fsspec and the protocol's implementation (s3fs, gcsfs, adlfs, aiohttp) are imported only when
a URL is given: the package imports and runs on local files without them.
"""

from __future__ import annotations

import bisect
import collections
import concurrent.futures
import contextlib
import glob as _glob
import io
import os
import re
import threading
import time
from typing import Any, Optional

from ._errors import RemoteObjectChangedError
from ._remote import (PART_CAP, PART_DEFAULT, RemoteSettings, Stat, changed, etag_protocol, fetch_into,
                      fetch_range, filesystem, invalidate_listings, part_size_for, pool, request, reset_estimates,
                      reset_stats, settings, stat_of, stats, url_of)

__all__ = ["is_url", "RemoteSettings", "settings", "stats", "reset_stats", "forget", "expecting"]

_URL_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")


def is_url(path: Any) -> bool:
    """Whether ``path`` names an object through a protocol (``s3://...``) rather than a local file."""
    return isinstance(path, str) and _URL_RE.match(path) is not None


def forget() -> None:
    """Drop cached stats, pins, header bytes and read-ahead windows, and what the stores'
    answers took (parts start at 8 MiB again): the next read asks the store afresh."""
    reset_estimates()
    _CACHE.clear()
    _READ_AHEAD.clear()
    _SPANS.clear()
    with _STAT_LOCK:
        _STAT_CACHE.clear()
        _PINS.clear()
    invalidate_listings()  # and fsspec's (s3fs answers stats from them)


def refresh(path: str) -> None:
    """(local; discovery, on each rank that discovers) Unpin ``path`` and every object in
    its folder, and drop their kept stats: a discovery describes the objects as the store
    holds them now, and pins what it sees for the load that follows."""
    if not is_url(path):
        return
    path = path.rstrip("/")
    folder = path.rsplit("/", 1)[0] + "/"
    with _STAT_LOCK:
        for table in (_STAT_CACHE, _PINS):
            for url in [u for u in table if u == path or u.startswith(folder)]:
                del table[url]
    try:  # fsspec's own listings too (s3fs answers a stat from them, however old)
        fs, p = filesystem(path)
        fs.invalidate_cache(p)
        fs.invalidate_cache(p.rsplit("/", 1)[0])
    except (ImportError, ValueError):  # no such protocol here: the discovery will say so
        pass


def pin(url: str, size: int, version: str) -> None:
    """(local; a rank that adopts another rank's layout) Read ``url`` as the version the
    layout was discovered from, which the sending rank saw (its ETag for S3): a store that
    holds another one by the time this rank reads it is a RemoteObjectChangedError here
    too, not bytes of the new version under the old layout."""
    if is_url(url):
        with _STAT_LOCK:
            _PINS[url] = Stat(int(size), str(version), False, etag=str(version) if etag_protocol(url) else "")
            _PINS.move_to_end(url)


# One load asks the size and kind of each object many times (discovery, the zip parser, the
# reader); a stat is a request, so answers are kept a few seconds (a listing fills them too).
_STAT_TTL_S = 10.0
_STAT_CACHE: dict = {}
_STAT_LOCK = threading.Lock()
# The version of each object a load reads: set when the object is first seen (or by the
# layout another rank sent), kept past the stat TTL until the next discovery of its folder
# (refresh), dropped when it is found changed. Bounded: a process that has seen this many
# objects has long finished loading the first.
_PINS: "collections.OrderedDict[str, Stat]" = collections.OrderedDict()
_MAX_PINS = 1 << 16


def _forget_object(url: str, old: Stat) -> None:
    """Forget what this process kept of an object found replaced (its stat, its pin while it
    is still ``old``, its header bytes and windows), so that the next load (after the user's
    retry) reads the new version from its start."""
    with _STAT_LOCK:
        _STAT_CACHE.pop(url, None)
        if _PINS.get(url) == old:
            del _PINS[url]
    _CACHE.drop(url)
    _READ_AHEAD.drop(url)
    _SPANS.drop(url)


def _stat_url(url: str) -> Stat:
    now = time.monotonic()
    with _STAT_LOCK:
        hit = _STAT_CACHE.get(url)
    if hit is not None and now - hit[0] < _STAT_TTL_S:
        st = hit[1]
    else:
        fs, path = filesystem(url)
        st = stat_of(request(url, "stat", fs.info, path))
        with _STAT_LOCK:
            _STAT_CACHE[url] = (now, st)
    if st.isdir:
        return st
    with _STAT_LOCK:
        pinned = _PINS.get(url)
        if pinned is None:
            _PINS[url] = st
            while len(_PINS) > _MAX_PINS:
                _PINS.popitem(last=False)
            return st
    # (a listing and a stat may spell a modification time differently: only sizes and
    # ETags are compared, which every answer spells alike)
    if pinned.size != st.size or (pinned.etag and st.etag and pinned.etag != st.etag):
        _forget_object(url, pinned)
        raise changed(url, pinned, f"the store now holds one of {st.size} bytes"
                      f"{f' with ETag {st.etag}' if st.etag else f' ({st.version})' if st.version else ''}")
    return pinned


def _pinned(url: str) -> Stat:
    """The version of ``url`` this load reads (pinned now where it was not yet)."""
    with _STAT_LOCK:
        st = _PINS.get(url)
    return st if st is not None else _stat_url(url)


# --------------------------------------------------------------------------- os-like calls
# Each answers a local path with the os call it stands for.


def stat(path: str) -> Stat:
    """(local) Size, version and kind; raises FileNotFoundError where nothing is there."""
    if not is_url(path):
        st = os.stat(path)
        return Stat(st.st_size, str(st.st_mtime_ns), os.path.isdir(path))
    return _stat_url(path)


def exists(path: str) -> bool:
    if not is_url(path):
        return os.path.exists(path)
    try:
        _stat_url(path)
        return True
    except FileNotFoundError:
        return False


def lexists(path: str) -> bool:
    return os.path.lexists(path) if not is_url(path) else exists(path)


def isdir(path: str) -> bool:
    if not is_url(path):
        return os.path.isdir(path)
    try:
        return _stat_url(path).isdir
    except FileNotFoundError:
        return False


def isfile(path: str) -> bool:
    if not is_url(path):
        return os.path.isfile(path)
    try:
        return not _stat_url(path).isdir
    except FileNotFoundError:
        return False


def readable_url(url: str) -> bool:
    """Whether this process can read ``url``: fsspec and the protocol's implementation are
    installed (no request is made). Libraries keep URLs of other protocols (manifold://)."""
    try:
        import fsspec

        fsspec.get_filesystem_class(url.split("://", 1)[0].lower())
    except (ImportError, ValueError):
        return False
    return True


def getsize(path: str) -> int:
    return os.path.getsize(path) if not is_url(path) else _stat_url(path).size


def mtime_ns(path: str) -> Any:
    """What tells two versions of a file apart: st_mtime_ns locally, the ETag (or the
    store's equivalent) for an object."""
    return os.stat(path).st_mtime_ns if not is_url(path) else _stat_url(path).version


def listdir(path: str) -> list:
    """Entry names of a folder (a URL: the objects and common prefixes under ``path/``)."""
    if not is_url(path):
        return os.listdir(path)
    fs, p = filesystem(path)
    # Fresh: a listing cached by an earlier load would hide files written since.
    fs.invalidate_cache(p)
    entries = request(path, "list", fs.ls, p, detail=True)
    out = []
    now = time.monotonic()
    base = path.rstrip("/")
    for e in entries:
        name = e["name"].rstrip("/").rsplit("/", 1)[-1]
        if name and e["name"].rstrip("/") != p.rstrip("/"):
            out.append(name)
            with _STAT_LOCK:
                _STAT_CACHE[f"{base}/{name}"] = (now, stat_of(e))
    return out


def glob(pattern: str) -> list:
    if not is_url(pattern):
        return _glob.glob(pattern)
    fs, p = filesystem(pattern)
    return [url_of(fs, m, pattern) for m in request(pattern, "glob", fs.glob, p)]


def realpath(path: str, *, strict: bool = False) -> str:
    """Object stores have no links: a URL is its own real path (checked for existence when strict)."""
    if not is_url(path):
        return os.path.realpath(path, strict=strict)
    if strict:
        _stat_url(path)
    return path


def abspath(path: str) -> str:
    return path if is_url(path) else os.path.abspath(path)


def read_small(path: str, limit: int) -> Optional[bytes]:
    """The whole file if it holds at most ``limit`` bytes, else None (pointer files)."""
    if getsize(path) > limit:
        return None
    if not is_url(path):
        with open(path, "rb") as f:
            return f.read()
    return read_range(path, 0, limit)


# --------------------------------------------------------------------------- ranged reads


def read_range(url: str, offset: int, n: int, st: Optional[Stat] = None) -> bytes:
    """(local) Bytes ``offset .. offset+n`` of the pinned version of an object (``st``, the
    version a header was read from, where given), fewer only where it ends first; in one
    request, whose answer is checked (:func:`._remote.fetch_range`).

    Raises:
        RemoteStoreError: the store answered with other bytes than asked for (wrong status,
            range or length, a redirect).
        RemoteObjectChangedError: the store holds another version of the object now.
    """
    st = st or _pinned(url)
    n = max(0, min(n, st.size - offset))
    if n <= 0:
        return b""
    try:
        return fetch_range(url, offset, n, st)
    except RemoteObjectChangedError:
        _forget_object(url, st)
        raise


def _read_range_into(url: str, offset: int, view: memoryview) -> int:
    """(local) :func:`read_range` written straight into ``view`` (the answer's body lands in
    place, a bounded piece at a time); returns the bytes written, fewer only where the
    object ends first."""
    st = _pinned(url)
    n = max(0, min(len(view), st.size - offset))
    if n <= 0:
        return 0
    try:
        fetch_into(url, offset, view[:n], st)
    except RemoteObjectChangedError:
        _forget_object(url, st)
        raise
    return n


class _ReadAhead:
    """Small reads of one object that follow each other (a flat parameter's members, the
    biases and norms between a model's large weights) share requests: a read that starts
    where the previous one ended (give or take a record header) fetches a window twice as
    large as the last, up to 2 MiB, and the next small reads come from it. Scattered small
    reads fetch exactly what they ask. What is fetched and not used is at most the last
    window of each run, never more than the run itself; at most 8 windows are kept."""

    SMALL = 256 << 10  # reads at most this large go through here
    WINDOW = 2 << 20
    GAP = 64 << 10  # "follows": starts at most this far past the previous end

    def __init__(self):
        self._lock = threading.Lock()
        self._windows: "collections.OrderedDict[tuple, tuple]" = collections.OrderedDict()
        self._runs: "collections.OrderedDict[tuple, tuple]" = collections.OrderedDict()  # key -> (end, window)

    def clear(self) -> None:
        with self._lock:
            self._windows.clear()
            self._runs.clear()

    def drop(self, url: str) -> None:
        with self._lock:
            for table in (self._windows, self._runs):
                for k in [k for k in table if k[0] == url]:
                    del table[k]

    def read(self, url: str, offset: int, view: memoryview) -> int:
        n = len(view)
        st = _pinned(url)
        key = (url, st.size, st.version)
        with self._lock:
            win = self._windows.get(key)
            if win is not None and win[0] <= offset and offset + n <= win[0] + len(win[1]):
                data = win[1][offset - win[0]: offset - win[0] + n]
                self._runs[key] = (offset + n, self._runs.get(key, (0, n))[1])
                view[:n] = data
                return n
            end, last = self._runs.get(key, (None, 0))
        follows = end is not None and 0 <= offset - end <= self.GAP
        want = min(self.WINDOW, max(2 * last, n)) if follows else n
        data = read_range(url, offset, min(max(want, n), max(0, st.size - offset)), st)
        got = min(n, len(data))
        view[:got] = data[:got]
        with self._lock:
            if len(data) > n:
                self._windows[key] = (offset, data)
                self._windows.move_to_end(key)
                while len(self._windows) > 8:
                    self._windows.popitem(last=False)
            self._runs[key] = (offset + got, want if follows else n)
            self._runs.move_to_end(key)
            while len(self._runs) > 64:
                self._runs.popitem(last=False)
        return got

    def take_prefix(self, url: str, offset: int, view: memoryview) -> tuple:
        """Copy into ``view`` what a kept window already holds from ``offset`` on (a large
        read that follows a run of small ones: the run's last window reached into it).
        Returns (bytes copied, the object's size); the caller fetches only the rest."""
        with self._lock:
            if not any(k[0] == url for k in self._windows):
                return 0, -1
        st = _pinned(url)  # (the read that kept the window pinned it)
        with self._lock:
            win = self._windows.get((url, st.size, st.version))
            if win is None or not win[0] <= offset < win[0] + len(win[1]):
                return 0, st.size
            start, data = win
            got = min(len(view), start + len(data) - offset)
            view[:got] = data[offset - start: offset - start + got]
            return got, st.size


_READ_AHEAD = _ReadAhead()


class _Span:
    """Bytes ``start .. end`` of one object, which several announced reads lie in."""

    def __init__(self, url: str, start: int, end: int, want: int):
        self.url, self.start, self.end = url, start, end
        self.left = want  # announced bytes not read yet: the buffer goes when none are left
        self.buf: Optional[bytearray] = None
        self.dead = False  # its buffer was let go early: the reads left in it go alone
        self.lock = threading.Lock()


class _Spans:
    """Reads of one object that a fill announces (:func:`expecting`) and that lie close
    together (gaps of at most ``GAP``, and at most 1/8 of the bytes wanted) are served from
    one ranged read per merged span of at most ``span_bytes`` (cut into parts of
    :func:`._remote.part_size_for`, fetched concurrently, each part's answer checked as
    every read's is), fetched when the first of them is read, kept until the last has been
    copied out. The gap bytes are fetched (and counted as fetched) and dropped. Memory
    beyond the destinations, for a fill on one thread (as :func:`._execute.fill_all` fills
    an object's wants): at most ``HELD`` span buffers at once, the one being fetched
    included, so ``HELD * span_bytes`` (64 MiB unless a part size above 32 MiB is set) plus
    the pieces of answers in flight; a span whose buffer had to go before its last read
    (reads hopping between more than ``HELD`` spans) serves the rest of its reads alone,
    each its own request."""

    GAP = 1 << 20
    HELD = 2

    def __init__(self):
        self._lock = threading.Lock()
        self._by_url: dict = {}  # url -> ([starts], [spans]), sorted by start
        self._held: "collections.OrderedDict[int, _Span]" = collections.OrderedDict()

    def clear(self) -> None:
        with self._lock:  # as drop() does: a span being fetched now does not keep its buffer
            for sp in [sp for _, spans in self._by_url.values() for sp in spans] + list(self._held.values()):
                sp.dead, sp.buf = True, None
            self._by_url.clear()
            self._held.clear()

    def drop(self, url: str) -> None:
        with self._lock:
            for sp in self._by_url.pop(url, ([], []))[1]:
                sp.dead, sp.buf = True, None
                self._held.pop(id(sp), None)

    def add(self, ranges, span_bytes: int) -> list:
        """Merge ``ranges`` ((url, offset, nbytes)) into spans and keep those that more than
        one read shares; returns them (what :meth:`remove` takes)."""
        by_url: dict = {}
        for url, offset, n in ranges:
            if n > 0 and is_url(url) and n < span_bytes:
                by_url.setdefault(url, []).append((int(offset), int(n)))
        made = []
        for url, reads in by_url.items():
            reads.sort()
            cur = None  # [start, end, bytes wanted, reads]
            for a, n in reads + [(None, 0)]:
                if cur is not None and a is not None:
                    gap = a - cur[1]
                    if gap <= min(self.GAP, (cur[2] + n) // 8) and max(cur[1], a + n) - cur[0] <= span_bytes:
                        cur[1], cur[2], cur[3] = max(cur[1], a + n), cur[2] + n, cur[3] + 1
                        continue
                if cur is not None and cur[3] > 1:
                    made.append(_Span(url, cur[0], cur[1], cur[2]))
                cur = None if a is None else [a, a + n, n, 1]
        with self._lock:
            for sp in made:
                starts, spans = self._by_url.setdefault(sp.url, ([], []))
                k = bisect.bisect_right(starts, sp.start)
                starts.insert(k, sp.start)
                spans.insert(k, sp)
        return made

    def remove(self, made: list) -> None:
        with self._lock:
            for sp in made:
                sp.dead, sp.buf = True, None
                self._held.pop(id(sp), None)
                starts, spans = self._by_url.get(sp.url, ([], []))
                for k in range(len(spans)):
                    if spans[k] is sp:
                        del starts[k], spans[k]
                        break
                if not spans:
                    self._by_url.pop(sp.url, None)

    def _find(self, url: str, offset: int, n: int) -> Optional[_Span]:
        with self._lock:
            starts, spans = self._by_url.get(url, ((), ()))
            k = bisect.bisect_right(starts, offset) - 1
            while k >= 0:  # spans of one announcement never overlap; of two, they may
                sp = spans[k]
                if offset + n <= sp.end and not sp.dead:
                    return sp
                k -= 1
            return None

    def read(self, url: str, offset: int, view: memoryview) -> Optional[int]:
        """Bytes written into ``view`` from a span that holds them all, or None where no
        live span does (the caller reads them alone)."""
        n = len(view)
        sp = self._find(url, offset, n) if self._by_url else None
        if sp is None:
            return None
        with sp.lock:
            if sp.dead:
                return None
            buf = sp.buf
            if buf is None:
                st = _pinned(url)
                with self._lock:  # room first: at most HELD buffers, this one's included
                    while len(self._held) >= self.HELD:
                        _, old = self._held.popitem(last=False)
                        old.dead, old.buf = True, None
                buf = bytearray(max(0, min(sp.end, st.size) - sp.start))
                got = _read_parts(url, sp.start, memoryview(buf))
                del buf[got:]  # (where the object ends first: the reads past it come back short)
                with self._lock:
                    if sp.dead:  # (dropped meanwhile: the object changed, or the fill ended)
                        return None
                    sp.buf = buf
                    self._held[id(sp)] = sp
            at = offset - sp.start
            got = max(0, min(n, len(buf) - at))
            view[:got] = memoryview(buf)[at: at + got]
            sp.left -= n
            if sp.left <= 0:
                with self._lock:
                    sp.dead, sp.buf = True, None
                    self._held.pop(id(sp), None)
            return got


_SPANS = _Spans()


@contextlib.contextmanager
def expecting(ranges):
    """(local) While the block runs, reads of objects among ``ranges`` ((url, byte offset,
    nbytes); local paths are ignored) that lie close together share requests (see
    :class:`_Spans`): a fill announces what it is about to read. Nothing is fetched
    until a read asks; what was not read by the end is let go."""
    # (a span is at least one part: a part size set above 32 MiB makes spans that long)
    made = _SPANS.add(ranges, max(settings().part_bytes or PART_DEFAULT, _SPAN_BYTES))
    try:
        yield
    finally:
        _SPANS.remove(made)


_SPAN_BYTES = PART_CAP  # the longest merged read (at least one part): one request when measured


def read_into(url: str, offset: int, view: memoryview) -> int:
    """(local) Fill ``view`` with the object's bytes from ``offset``: parts of at most the
    part size (:func:`._remote.part_size_for`) fetched concurrently (within the
    process-wide bound), each written into its place as it arrives; reads announced
    together share requests (:class:`_Spans`), and so do small reads that follow each
    other (:class:`_ReadAhead`). Returns the bytes written (fewer only where the object
    ends)."""
    n = len(view)
    if n:
        got = _SPANS.read(url, offset, view)
        if got is not None:
            return got
    if 0 < n <= _ReadAhead.SMALL:
        return _READ_AHEAD.read(url, offset, view)
    pre, size = _READ_AHEAD.take_prefix(url, offset, view) if n else (0, -1)
    if pre:
        # (a window ends where the object does: past it there is nothing to ask for, and a
        # range starting at the end is an error to the store, not a short read)
        rest = min(n, max(pre, size - offset))
        return pre + (read_into(url, offset + pre, view[pre:rest]) if pre < rest else 0)
    return _read_parts(url, offset, view)


def _read_parts(url: str, offset: int, view: memoryview) -> int:
    """``view`` from ``offset``, in parts of at most the part size (chosen once per call)
    fetched concurrently."""
    s = settings()
    n = len(view)
    size = part_size_for(url, s)
    parts = [(a, min(n, a + size)) for a in range(0, n, size)]

    def one(a: int, b: int) -> int:
        return _read_range_into(url, offset + a, view[a:b])

    if len(parts) <= 1:
        got = [one(*parts[0])] if parts else []
    else:
        # The caller never runs on a pool thread, so waiting here cannot starve the pool.
        futures = [pool(s.concurrency).submit(one, a, b) for a, b in parts]
        first = concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_EXCEPTION)
        if any(f.exception() is not None for f in first.done):
            for f in futures:
                f.cancel()
        # Every part that started writes into ``view`` (the caller's tensor): none may
        # outlive this call, whose error the caller may catch and then free the tensor.
        concurrent.futures.wait(futures)
        for f in futures:
            if not f.cancelled() and f.exception() is not None:
                raise f.exception()
        got = [f.result() for f in futures]
    done = 0
    for (a, b), g in zip(parts, got):
        if g < b - a:
            return a + g
        done = b
    return done


def read_all(url: str) -> bytes:
    """The whole object (formats read whole anyway: legacy pickles, compressed archives)."""
    size = getsize(url)
    buf = bytearray(size)
    got = read_into(url, 0, memoryview(buf))
    return bytes(buf[:got])


class _SegmentCache:
    """Byte ranges of objects already fetched for header reads, so that our zip parser and
    torch's reader of the same archive share one fetch of the tail, the central directory,
    the local headers and the pickle. Bounded; the least recently used objects go first."""

    def __init__(self, max_bytes: int = 32 << 20):
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        # key -> ([starts], [data]) sorted by start
        self._by_key: "collections.OrderedDict[tuple, tuple]" = collections.OrderedDict()
        self._bytes = 0

    def clear(self) -> None:
        with self._lock:
            self._by_key.clear()
            self._bytes = 0

    def drop(self, url: str) -> None:
        with self._lock:
            for k in [k for k in self._by_key if k[0] == url]:
                _, old = self._by_key.pop(k)
                self._bytes -= sum(len(d) for d in old)

    def get(self, key: tuple, offset: int, n: int) -> Optional[bytes]:
        with self._lock:
            segs = self._by_key.get(key)
            if segs is None:
                return None
            starts, datas = segs
            # Segments may overlap; any one that starts at or before offset may hold the range.
            for i in range(bisect.bisect_right(starts, offset) - 1, -1, -1):
                start, data = starts[i], datas[i]
                if offset + n <= start + len(data):
                    self._by_key.move_to_end(key)
                    return data[offset - start: offset - start + n]
                if offset - start > self.max_bytes // 4:
                    break  # no segment is that long
            return None

    def put(self, key: tuple, offset: int, data: bytes) -> None:
        if len(data) > self.max_bytes // 4:
            return
        with self._lock:
            starts, datas = self._by_key.setdefault(key, ([], []))
            i = bisect.bisect_right(starts, offset)
            starts.insert(i, offset)
            datas.insert(i, data)
            self._by_key.move_to_end(key)
            self._bytes += len(data)
            while self._bytes > self.max_bytes and len(self._by_key) > 1:
                _, (_, old) = self._by_key.popitem(last=False)
                self._bytes -= sum(len(d) for d in old)


_CACHE = _SegmentCache()
# Small reads fetch at least this much: the next small read (a record after its local
# header, the central directory after the end record) is then usually already here.
_MIN_FETCH = 16 << 10


class RemoteFile(io.RawIOBase):
    """(local) A read-only, seekable file over one object, for header reads: what
    ``torch.load`` and ``zipfile`` read through, and what :func:`_zip._pread_exact`
    takes in place of a descriptor (``pread``). Small reads are served from a shared cache
    of the ranges already fetched; large ones go straight to the store."""

    def __init__(self, url: str, st: Optional[Stat] = None):
        super().__init__()
        self.url = url
        st = st or _stat_url(url)
        if st.isdir:
            raise IsADirectoryError(f"{url}: a folder, not a file")
        self.size = st.size
        self._st = st
        self._key = (url, st.size, st.version)
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self.size}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def pread(self, n: int, offset: int) -> bytes:
        n = max(0, min(n, self.size - offset))
        if n == 0:
            return b""
        hit = _CACHE.get(self._key, offset, n)
        if hit is not None:
            return hit
        if n >= _MIN_FETCH:
            start, want = offset, n
        else:
            # near the end (a zip's end record), the last _MIN_FETCH bytes: the records read
            # next (its central directory, the ZIP64 locator) lie before it, not after
            start = max(0, min(offset, self.size - _MIN_FETCH))
            want = max(offset + n - start, min(self.size - start, _MIN_FETCH))
        data = read_range(self.url, start, want, self._st)
        _CACHE.put(self._key, start, data)
        return data[offset - start: offset - start + n]

    def prefetch(self, ranges) -> None:
        """Fetch many small ranges at once (concurrently), into the cache."""
        want = sorted((a, min(n, self.size - a)) for a, n in ranges
                      if 0 <= a < self.size and _CACHE.get(self._key, a, min(n, self.size - a)) is None)
        todo: list = []
        for a, n in want:  # ranges close together (small records) in one request
            if todo and a - (todo[-1][0] + todo[-1][1]) <= _MIN_FETCH:
                todo[-1] = (todo[-1][0], max(todo[-1][1], a + n - todo[-1][0]))
            else:
                todo.append((a, n))
        if len(todo) <= 1:
            for a, n in todo:
                self.pread(n, a)
            return
        s = settings()

        def one(an):
            a, n = an
            _CACHE.put(self._key, a, read_range(self.url, a, n, self._st))

        list(pool(s.concurrency).map(one, todo))

    def readinto(self, b) -> int:
        view = memoryview(b).cast("B")
        data = self.pread(len(view), self._pos)
        view[:len(data)] = data
        self._pos += len(data)
        return len(data)


def open_ro(path: str):
    """What the zip parser reads through: a descriptor for a local file, a RemoteFile for a URL."""
    return os.open(path, os.O_RDONLY) if not is_url(path) else RemoteFile(path)


def fsize(fd) -> int:
    return os.fstat(fd).st_size if isinstance(fd, int) else fd.size


def close(fd) -> None:
    if isinstance(fd, int):
        os.close(fd)
    else:
        fd.close()


def pread(fd, n: int, offset: int) -> bytes:
    return os.pread(fd, n, offset) if isinstance(fd, int) else fd.pread(n, offset)
