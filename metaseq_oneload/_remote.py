"""One request to an object store, through fsspec: its settings, its retries, its checked answer.

:mod:`._storage` keeps what a load knows of each object (its pinned version, the bytes
already fetched) and answers the engine's os-like calls; this module only asks the store:

* at most ``concurrency`` requests in flight per process (a semaphore over every thread
  that reads, headers and data alike); a data read's answer is written into its destination
  as it arrives (:func:`fetch_into`), so in-flight memory beyond the destination is about
  ``concurrency`` pieces of at most 1 MiB, not whole parts;
* each request retried with exponential backoff and jitter on transient errors (5xx,
  throttling, connection resets, timeouts), never on a missing object or a refused
  credential, which are answered at once;
* every answer checked, never taken as given: an S3 ranged GET must come back 206 with the
  ``Content-Range`` asked for and exactly that many bytes, else :class:`RemoteStoreError`
  (a server, proxy or cache that ignores ``Range``, answers another range, sends a short or
  long body, or redirects) at once, without retries; other protocols' answers are checked
  for their exact length (fsspec shows nothing else of them); a read of a pinned version
  sends its ETag (``If-Match``) and its VersionId, and a store that holds another version
  answers :class:`RemoteObjectChangedError`;
* the largest single ranged request (:func:`part_size_for`): what the user set
  (``METASEQ_ONELOAD_REMOTE_PART_MB``), else, on S3, sized from what this process measured
  of the endpoint's ranged GETs (time to first byte and streaming rate, median of the last
  few): ``4 * ttfb * rate`` clamped to 8 .. 32 MiB, 8 MiB until three answers were timed.
  It only decides how a read is cut into requests: every answer is checked as above.

The settings (``METASEQ_ONELOAD_REMOTE_*``, ``METASEQ_ONELOAD_STORAGE_OPTIONS``) come from
:func:`._settings.from_env`, read at each request, so that every entry point (the API, the
CLI, the metaseq patch, torchrun workers) sees the same ones. fsspec and the protocol's
implementation (s3fs, gcsfs, adlfs, aiohttp) are imported only when a URL is given.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import json
import os
import random
import re
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Optional

from ._errors import MissingRemoteExtraError, OneloadError, RemoteObjectChangedError, RemoteStoreError
from ._settings import REMOTE, Settings, from_env, variable

__all__ = ["RemoteSettings", "settings", "stats", "reset_stats", "Stat", "stat_of", "etag_protocol", "filesystem",
           "url_of", "invalidate_listings", "request", "changed", "fetch_range", "fetch_into", "pool",
           "PART_DEFAULT", "PART_CAP", "part_size", "part_size_for", "estimates", "reset_estimates"]

# Errors no retry can cure: a missing object, a refused credential, a bad argument.
_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, ValueError,
              TypeError, NotImplementedError, OneloadError)


@dataclass(frozen=True)
class RemoteSettings:
    """How remote reads are issued (see the module docstring for the environment variables)."""

    concurrency: int = 16  # requests in flight per process
    retries: int = 5  # retries per request after the first try
    backoff_s: float = 0.2  # first backoff; doubled per retry, capped at 10 s, with jitter
    # largest single ranged request: None sizes it from what the store answers (S3:
    # :func:`part_size_for`, PART_DEFAULT .. PART_CAP); a value (the user set it) is used as it is
    part_bytes: Optional[int] = None
    storage_options: str = "{}"  # JSON, as in $METASEQ_ONELOAD_STORAGE_OPTIONS

    def __post_init__(self):
        if self.concurrency < 1 or self.retries < 0 or self.backoff_s < 0 or (
                self.part_bytes is not None and self.part_bytes < (64 << 10)):
            raise ValueError(f"invalid remote storage settings {self}: concurrency >= 1, retries >= 0, "
                             "backoff >= 0, part >= 64 KiB")

    def options_for(self, protocol: str) -> dict:
        opts = json.loads(self.storage_options or "{}")
        if not isinstance(opts, dict):
            raise ValueError(f"${variable('storage_options')} must be a JSON object, got {self.storage_options!r}")
        # Per protocol where keys name protocols and hold objects, else the same for all.
        if opts and all(isinstance(v, dict) for v in opts.values()):
            return dict(opts.get(protocol, {}))
        return opts


def settings(given: Optional[Settings] = None) -> RemoteSettings:
    """(local) How remote reads are issued, from ``given`` (a verb's settings, read once),
    else from the environment now (:func:`._settings.from_env`)."""
    s = given or from_env(only=REMOTE)
    return RemoteSettings(concurrency=s.remote_concurrency, retries=s.remote_retries, backoff_s=s.remote_backoff,
                          part_bytes=None if s.remote_part_mb is None else int(s.remote_part_mb * (1 << 20)),
                          storage_options=s.storage_options)


class _Stats:
    """What this process fetched from object stores (tests and reports read it)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.requests = 0
            self.bytes = 0
            self.retries = 0
            self.in_flight = 0
            self.max_in_flight = 0

    def add(self, **kw) -> None:
        with self._lock:
            for k, v in kw.items():
                setattr(self, k, getattr(self, k) + v)
            self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def as_dict(self) -> dict:
        with self._lock:
            return {"requests": self.requests, "bytes": self.bytes, "retries": self.retries,
                    "max_in_flight": self.max_in_flight}


_STATS = _Stats()


def stats() -> dict:
    """(local) Requests, bytes and retries this process made to object stores since the last reset."""
    return _STATS.as_dict()


def reset_stats() -> None:
    """Zero the counters."""
    _STATS.reset()


# --------------------------------------------------------------------------- fsspec


def _missing_fsspec(url: str, e: ImportError) -> ImportError:
    return MissingRemoteExtraError(
        f"{url}: reading checkpoints from URLs needs fsspec and the protocol's package, and this Python has not "
        f"got them ({e}). Install them with `pip install metaseq-oneload[remote]` (from a clone: "
        "`pip install '.[remote]'`; s3fs for s3://, gcsfs for gs://, adlfs for az://, aiohttp for http(s)://), "
        "or copy the checkpoint to a local folder and pass that.")


_FILESYSTEMS: "weakref.WeakSet" = weakref.WeakSet()


@functools.lru_cache(maxsize=64)
def _filesystem(protocol: str, options: str, url_example: str, pid: int):
    # ``pid``: a forked child (a DataLoader worker) must not use its parent's event loop
    try:
        import fsspec
    except ImportError as e:
        raise _missing_fsspec(url_example, e) from None
    try:
        fs = fsspec.filesystem(protocol, **json.loads(options))
        _FILESYSTEMS.add(fs)
        return fs
    except ImportError as e:
        raise _missing_fsspec(url_example, e) from None
    except ValueError as e:  # fsspec: "Protocol not known"
        raise ValueError(f"{url_example}: fsspec does not know the protocol {protocol}:// ({e}).") from None


def filesystem(url: str) -> tuple:
    """(filesystem, path inside it) for a URL."""
    protocol = url.split("://", 1)[0].lower()
    s = settings()
    fs = _filesystem(protocol, json.dumps(s.options_for(protocol), sort_keys=True), url, os.getpid())
    return fs, fs._strip_protocol(url)


def url_of(fs, path: str, like: str) -> str:
    """The URL of ``path`` found through ``fs``, spelled with the protocol ``like`` uses."""
    protocol = like.split("://", 1)[0]
    return f"{protocol}://{path.lstrip('/')}" if protocol not in ("http", "https") else path


def invalidate_listings() -> None:
    """Drop fsspec's listings in every filesystem made here (s3fs answers stats from them)."""
    for fs in list(_FILESYSTEMS):
        try:
            fs.invalidate_cache()
        except Exception:  # noqa: BLE001 - a filesystem that keeps none
            pass


@functools.lru_cache(maxsize=None)
def _limiter(n: int, pid: int) -> threading.BoundedSemaphore:
    return threading.BoundedSemaphore(n)


def request(url: str, what: str, fn, *args, **kwargs):
    """One request, within the concurrency bound, retried with backoff on transient errors."""
    s = settings()
    sem = _limiter(s.concurrency, os.getpid())
    for attempt in range(s.retries + 1):
        with sem:
            _STATS.add(requests=1, in_flight=1)
            try:
                return fn(*args, **kwargs)
            except _PERMANENT:
                raise
            except Exception as e:  # noqa: BLE001 - 5xx, throttling, resets, timeouts
                if attempt == s.retries:
                    raise OSError(f"{url}: {what} failed after {s.retries + 1} tries "
                                  f"({type(e).__name__}: {e})") from e
            finally:
                _STATS.add(in_flight=-1)
        _STATS.add(retries=1)
        time.sleep(min(10.0, s.backoff_s * (2 ** attempt)) * (0.5 + random.random() / 2))


# --------------------------------------------------------------------------- part size
# A ranged GET costs a fixed wait before its first byte (TTFB) plus its length over the
# connection's rate. Parts much shorter than ttfb * rate spend most of their time waiting
# (moto behind the tests' proxy: ~0.3 s per GET whatever its length, so 8 MiB parts made a
# 1 GiB FSDP2 load 264 GETs and 10 s slower than dcp.load's 156); parts much longer only
# cost memory and retry time. A part of K * ttfb * rate bytes keeps the wait at most
# 1/(K+1) of its request's time (20%). Real S3 (TTFB 10-50 ms, 50-100 MB/s per connection)
# gives 2-20 MB: the 8 MiB parts commonly advised, a little larger on a slow-to-answer store.

PART_DEFAULT = 8 << 20  # before anything was measured, and the least the rule gives
# The most: a failed part is fetched again whole (at 50 MB/s, 0.7 s), and a merged span
# (:func:`._storage.expecting`, 32 MiB) is then one request; at most HELD spans are held
# per filling thread whatever the part size, so memory is what it was with 8 MiB parts.
PART_CAP = 32 << 20
_PACE_K = 4
_PACE_KEEP = 9  # the last answers an estimate is the median of: one slow answer moves nothing
_PACE_MIN = 3  # answers measured before the rule replaces the default
# A body shorter than one piece arrives in one read: its time says nothing of the rate.
_RATE_MIN_BYTES = 1 << 20


def part_size(ttfb_s: Optional[float], rate_bps: Optional[float], floor: int = PART_DEFAULT,
              cap: int = PART_CAP) -> int:
    """The part size for a store that answers a GET's first byte after ``ttfb_s`` seconds and
    then streams ``rate_bps`` bytes a second: ``K * ttfb * rate`` (K = 4: the wait is at most
    a fifth of a request's time), in whole MiB, clamped to ``floor .. cap``; ``floor`` where
    either is not known yet."""
    if ttfb_s is None or rate_bps is None:
        return floor
    want = int(min(float(cap), _PACE_K * ttfb_s * rate_bps)) >> 20 << 20
    return max(floor, min(cap, want))


class _Pace:
    """What each endpoint's answers to ranged GETs took (per process: a forked child starts
    afresh): the time to the answer's headers (its first byte, for these purposes) and the
    rate its body streamed at, the last ``_PACE_KEEP`` of each. Bounded: 64 endpoints of 18
    numbers. Estimates only choose how reads are cut into requests, never what is accepted."""

    def __init__(self):
        self._lock = threading.Lock()
        self._by_key: "collections.OrderedDict[tuple, tuple]" = collections.OrderedDict()

    def reset(self) -> None:
        with self._lock:
            self._by_key.clear()

    def record(self, key: tuple, nbytes: int, ttfb_s: float, body_s: float) -> None:
        with self._lock:
            ttfbs, rates = self._by_key.get(key) or (collections.deque(maxlen=_PACE_KEEP),
                                                     collections.deque(maxlen=_PACE_KEEP))
            self._by_key[key] = (ttfbs, rates)
            self._by_key.move_to_end(key)
            while len(self._by_key) > 64:
                self._by_key.popitem(last=False)
            ttfbs.append(max(0.0, ttfb_s))
            if nbytes >= _RATE_MIN_BYTES:
                # (the whole body already in the socket's buffer: as fast as memory copies)
                rates.append(nbytes / max(body_s, 1e-4))

    def estimate(self, key: tuple) -> tuple:
        """(median TTFB in seconds, median rate in bytes/s), None for either with fewer than
        ``_PACE_MIN`` answers measured."""
        with self._lock:
            ttfbs, rates = self._by_key.get(key) or ((), ())
            return (_median(ttfbs) if len(ttfbs) >= _PACE_MIN else None,
                    _median(rates) if len(rates) >= _PACE_MIN else None)


def _median(values) -> float:
    # statistics.median's value; its module imports fractions and decimal (2 ms of every
    # script's first load, URL or not)
    v = sorted(values)
    mid = len(v) // 2
    return v[mid] if len(v) % 2 else (v[mid - 1] + v[mid]) / 2


_PACE = _Pace()


def reset_estimates() -> None:
    """(local) Forget what every endpoint's answers took: parts start at PART_DEFAULT again."""
    _PACE.reset()


def _endpoint(url: str, s: RemoteSettings) -> tuple:
    # what tells stores apart: the protocol and its options (endpoint_url, region, ...)
    protocol = url.split("://", 1)[0].lower()
    return os.getpid(), protocol, json.dumps(s.options_for(protocol), sort_keys=True)


def estimates(url: str) -> tuple:
    """(local) (TTFB s, rate B/s) measured so far on ``url``'s endpoint (None: not yet)."""
    return _PACE.estimate(_endpoint(url, settings()))


def part_size_for(url: str, s: Optional[RemoteSettings] = None) -> int:
    """(local) The largest single ranged request for a read of ``url`` now: the size the user
    set (``METASEQ_ONELOAD_REMOTE_PART_MB``) exactly; else, on S3, :func:`part_size` of what
    this process measured of the endpoint's answers (PART_DEFAULT until it has); else (other
    protocols, whose answers fsspec hands over whole: no first byte to time) PART_DEFAULT."""
    s = s or settings()
    if s.part_bytes is not None:
        return s.part_bytes
    if not etag_protocol(url):
        return PART_DEFAULT
    return part_size(*_PACE.estimate(_endpoint(url, s)))


@dataclass(frozen=True)
class Stat:
    size: int
    version: str  # ETag, generation or modification time: changes when the object does
    isdir: bool
    etag: str = ""  # what a read sends as If-Match (S3)
    version_id: str = ""  # S3 VersionId, where the bucket keeps versions


def stat_of(info: dict) -> Stat:
    version = next((str(info[k]) for k in ("ETag", "etag", "generation", "mtime", "LastModified",
                                           "last_modified", "created") if info.get(k) is not None), "")
    return Stat(int(info.get("size") or 0), version, info.get("type") == "directory",
                etag=str(info.get("ETag") or ""), version_id=str(info.get("VersionId") or ""))


def etag_protocol(url: str) -> bool:
    return url.split("://", 1)[0].lower() in ("s3", "s3a")


def changed(url: str, old: Stat, now: str) -> RemoteObjectChangedError:
    """The error for an object found replaced (``old``: the version this load pinned; ``now``:
    what the store says instead). :mod:`._storage` forgets what it kept of the object when
    one of these passes it."""
    return RemoteObjectChangedError(
        f"{url}: the object changed while it was being read: this load read its header from the "
        f"version of {old.size} bytes{f' with ETag {old.etag}' if old.etag else f' ({old.version})' if old.version else ''}"
        f", and {now}. Nothing of the other version was used. Load again once nothing writes the object any "
        "more (the next load reads the version the store then holds, from its start); if it is being "
        "written by a running job, load a checkpoint the job has finished writing.")


def fetch_range(url: str, offset: int, n: int, st: Stat) -> bytes:
    """(local) Bytes ``offset .. offset+n`` (``n`` > 0, inside the object) of version ``st``,
    in one request whose answer is checked (see the module docstring)."""
    buf = bytearray(n)
    fetch_into(url, offset, memoryview(buf), st)
    return bytes(buf)


def fetch_into(url: str, offset: int, view: memoryview, st: Stat) -> None:
    """(local) Write bytes ``offset .. offset+len(view)`` (inside the object) of version
    ``st`` into ``view``, in one request whose answer is checked (see the module docstring).
    An S3 answer's body is written into ``view`` as it arrives, a bounded piece at a time
    (no copy of the whole answer in memory); only an answer whose status, Content-Range and
    length are the ones asked for is written at all, and one that then turns out short or
    long raises (its bytes in ``view`` are not to be used: a retry overwrites them)."""
    n = len(view)
    fs, path = filesystem(url)
    what = f"reading bytes {offset}..{offset + n}"
    if etag_protocol(url) and hasattr(fs, "_call_s3"):
        from fsspec.asyn import sync

        ttfb_s, body_s = request(url, what, sync, fs.loop, _s3_ranged, fs, url, path, offset, view, st)
        _PACE.record(_endpoint(url, settings()), n, ttfb_s, body_s)
    else:
        # fsspec's other protocols show the bytes only, not the answer's status or range:
        # their length is what can be checked
        data = request(url, what, fs.cat_file, path, start=offset, end=offset + n)
        if len(data) != n:
            raise _wrong(url, offset, n, f"sent {len(data)} bytes; asked for {n}")
        view[:] = data
    _STATS.add(bytes=n)


def _wrong(url: str, offset: int, n: int, what: str) -> RemoteStoreError:
    return RemoteStoreError(
        f"{url}: the store answered a read of bytes {offset}-{offset + n - 1} wrongly: it {what}. Nothing "
        "it sent was used. A server, proxy or cache between here and the store does not honour ranged "
        "reads: point endpoint_url (METASEQ_ONELOAD_STORAGE_OPTIONS) at one that does, or copy the files "
        "to a local folder and load them from there.")


_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")


def _client_error(e: BaseException):
    """The botocore ClientError behind what s3fs raised (it translates them into OSErrors)."""
    for x in (e, e.__cause__, e.__context__):
        if getattr(x, "response", None) is not None and isinstance(x.response, dict):
            return x
    return None


# The most of an answer's body read at once (what is in memory beyond the destination)
_BODY_PIECE = 1 << 20


async def _s3_ranged(fs, url: str, path: str, offset: int, view: memoryview, st: Stat) -> tuple:
    """One GetObject of bytes ``offset .. offset+len(view)`` of version ``st``, written into
    ``view``: nothing of the body is read (past the checks of the headers) unless the answer
    is the range asked for, of that version; one of other than exactly that many bytes raises.
    Returns what the answer took: (seconds to its headers, seconds its body streamed)."""
    n = len(view)
    bucket, key, vers = fs.split_path(path)
    kw = {"Range": f"bytes={offset}-{offset + n - 1}"}
    if st.etag:
        kw["IfMatch"] = st.etag
    if st.version_id or vers:
        kw["VersionId"] = st.version_id or vers
    await fs.set_session()
    await _hook(fs, bucket)
    t0 = time.monotonic()
    try:
        resp = await fs._call_s3("get_object", Bucket=bucket, Key=key, **kw)
    except Exception as e:  # noqa: BLE001 - what the store's refusal says decides
        ce = _client_error(e)
        if ce is None:
            raise
        meta = ce.response.get("ResponseMetadata") or {}
        hop = _redirected(url, offset, n, meta)
        if hop is not None:
            raise hop from None
        code = str((ce.response.get("Error") or {}).get("Code") or "")
        status = int(meta.get("HTTPStatusCode") or 0)
        if code == "PreconditionFailed" or status == 412:
            raise changed(url, st, "the store holds another version now (it refused a read of that ETag: "
                          "412 Precondition Failed)") from None
        if 300 <= status < 400 or code in ("301", "302", "303", "307", "308", "PermanentRedirect",
                                           "TemporaryRedirect"):
            where = (meta.get("HTTPHeaders") or {}).get("location") or "elsewhere"
            raise _wrong(url, offset, n, f"redirected it (HTTP {status or code} to {where}); a ranged read "
                         "must be answered where it was sent, what a redirect points to is not used") from None
        raise
    t1 = time.monotonic()
    body = resp["Body"]
    try:
        meta = resp.get("ResponseMetadata") or {}
        hop = _redirected(url, offset, n, meta)
        if hop is not None:
            raise hop
        status = int(meta.get("HTTPStatusCode") or 0)
        length = resp.get("ContentLength")
        if status == 200 and _whole_pinned(resp, offset, n, st):
            # a range that covers the whole object: some S3-compatible servers and CDNs
            # answer 200 with the whole object; it is the bytes asked for, of the pinned version
            pass
        elif status != 206:
            raise _wrong(url, offset, n, f"answered HTTP {status}, not 206 (Partial Content): "
                         f"{'it ignored the Range header and sent the whole object' if status == 200 else 'no range'}")
        else:
            got_range = str(resp.get("ContentRange") or "")
            m = _CONTENT_RANGE.match(got_range)
            if m is None or (int(m.group(1)), int(m.group(2))) != (offset, offset + n - 1):
                raise _wrong(url, offset, n, f"sent Content-Range {got_range or '(none)'}; asked for bytes "
                             f"{offset}-{offset + n - 1}")
            if m.group(3) != "*" and int(m.group(3)) != st.size:
                raise changed(url, st, f"the store answers for an object of {m.group(3)} bytes")
        if length is not None and int(length) != n:
            raise _wrong(url, offset, n, f"announced {length} bytes for that range; asked for {n}")
        got = 0
        while got <= n:  # one more than asked: a body longer than it said is refused too
            chunk = await body.read(min(_BODY_PIECE, n + 1 - got))
            if not chunk:
                break
            if got + len(chunk) > n:
                got += len(chunk)
                break
            view[got:got + len(chunk)] = chunk
            got += len(chunk)
        if got != n:
            raise _wrong(url, offset, n, f"sent {got}{'+' if got > n else ''} bytes; asked for {n}")
        return t1 - t0, time.monotonic() - t1
    finally:
        body.close()


def _whole_pinned(resp: dict, offset: int, n: int, st: Stat) -> bool:
    """Whether a 200 answers a ranged read as a 206 would: the range asked for is the whole
    object (from byte 0, its pinned size), the answer announces exactly that many bytes, and
    it is the pinned version (its ETag, or its version id where the pin is one)."""
    if offset != 0 or n != st.size or resp.get("ContentLength") is None or int(resp["ContentLength"]) != n:
        return False
    if st.etag:
        return str(resp.get("ETag") or "") == st.etag
    return bool(st.version_id) and str(resp.get("VersionId") or "") == st.version_id


def _note_redirect(http_response=None, parsed=None, **_):
    """(botocore's after-call hook) aiohttp follows redirects on its own, and botocore then
    parses the last answer as if it were the first: say in the parsed answer that there was
    one, so that the read refuses it (a ranged read answered elsewhere is not the store's)."""
    history = getattr(getattr(http_response, "raw", None), "history", None)
    if history and isinstance(parsed, dict):
        parsed.setdefault("ResponseMetadata", {})["OneloadRedirect"] = (
            int(getattr(history[0], "status", 0) or 0), str(getattr(history[0], "headers", {}).get("Location", "")))


_HOOKED: "weakref.WeakSet" = weakref.WeakSet()  # the clients that carry _note_redirect


async def _hook(fs, bucket: str) -> None:
    s3 = await fs.get_s3(bucket)
    if s3 not in _HOOKED:
        # (registering twice under one unique_id is a no-op: a race here costs nothing)
        s3.meta.events.register("after-call.s3.GetObject", _note_redirect, unique_id="metaseq-oneload-redirect")
        _HOOKED.add(s3)


def _redirected(url: str, offset: int, n: int, meta: dict) -> Optional[RemoteStoreError]:
    hop = meta.get("OneloadRedirect")
    if not hop:
        return None
    return _wrong(url, offset, n, f"redirected it (HTTP {hop[0]} to {hop[1] or 'another address'}); a ranged "
                  "read must be answered where it was sent, what a redirect points to is not used")


_POOL_LOCK = threading.Lock()
_POOLS: dict = {}


def pool(n: int) -> concurrent.futures.ThreadPoolExecutor:
    # a forked child inherits the pool objects but none of their threads: new ones there
    with _POOL_LOCK:
        found = _POOLS.get((n, os.getpid()))
        if found is None:
            found = _POOLS[(n, os.getpid())] = concurrent.futures.ThreadPoolExecutor(
                max_workers=n, thread_name_prefix="oneload-get")
        return found
