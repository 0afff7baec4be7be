"""How bytes move: local files, and object stores through fsspec, behind one small seam.

Local paths keep the engine's own code path (``os.stat``, ``os.preadv`` into the
destination); every function here answers a local path with the ``os`` call it replaces.
A URL (``s3://``, ``gs://``, ``az://``, ``http(s)://``, any fsspec protocol) goes to fsspec:

* ranged reads only: a header read takes the archive's tail, its central directory, one
  local header per record and the ``data.pkl`` record, never a tensor's bytes; a data read
  takes exactly the bytes a rank needs, in parts of at most ``part_bytes``, written into
  the destination's memory as each part arrives;
* at most ``concurrency`` requests in flight per process (a semaphore over every thread
  that reads, headers and data alike), so in-flight memory is at most
  ``concurrency * part_bytes`` beyond the destination;
* each request retried with exponential backoff and jitter on transient errors (5xx,
  throttling, connection resets, timeouts), never on a missing object or a refused
  credential, which are answered at once;
* every answer checked, never taken as given: an S3 ranged GET must come back 206 with the
  ``Content-Range`` asked for and exactly that many bytes, else :class:`RemoteStoreError`
  (a server, proxy or cache that ignores ``Range``, answers another range, sends a short or
  long body, or redirects) at once, without retries; other protocols' answers are checked
  for their exact length (fsspec shows nothing else of them);
* each object pinned from the first time it is seen (its size and ETag, and its VersionId
  where the bucket keeps versions) until the next discovery of its folder
  (:func:`refresh`): every read of it asks the store for that version (``If-Match``), and
  a store that holds another one now, or a stat that finds one, is a
  :class:`RemoteObjectChangedError` naming the object, never bytes of two versions in one
  load.

Settings come from the environment, so that every entry point (the API, the CLI, the
metaseq patch, torchrun workers) sees the same ones:

* ``METASEQ_ONELOAD_STORAGE_OPTIONS``: JSON, fsspec options for every protocol
  (``{"anon": true}``) or per protocol (``{"s3": {"endpoint_url": "http://127.0.0.1:9000"}}``);
* ``METASEQ_ONELOAD_REMOTE_CONCURRENCY``: requests in flight per process (default 16);
* ``METASEQ_ONELOAD_REMOTE_RETRIES``: retries per request after the first try (default 5);
* ``METASEQ_ONELOAD_REMOTE_BACKOFF``: first backoff in seconds, doubled per retry, capped at
  10 s, with jitter (default 0.2);
* ``METASEQ_ONELOAD_REMOTE_PART_MB``: largest single ranged request, MiB (default 8).

fsspec and the protocol's implementation (s3fs, gcsfs, adlfs, aiohttp) are imported only when
a URL is given: the package imports and runs on local files without them.
"""

from __future__ import annotations

import bisect
import collections
import concurrent.futures
import functools
import glob as _glob
import io
import json
import os
import random
import re
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Optional

from ._errors import MissingRemoteExtraError, OneloadError, RemoteObjectChangedError, RemoteStoreError

__all__ = ["is_url", "RemoteSettings", "settings", "stats", "reset_stats", "forget"]

_URL_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")
# Errors no retry can cure: a missing object, a refused credential, a bad argument.
_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, ValueError,
              TypeError, NotImplementedError, OneloadError)


def is_url(path: Any) -> bool:
    """Whether ``path`` names an object through a protocol (``s3://...``) rather than a local file."""
    return isinstance(path, str) and _URL_RE.match(path) is not None


@dataclass(frozen=True)
class RemoteSettings:
    """How remote reads are issued (see the module docstring for the environment variables)."""

    concurrency: int = 16  # requests in flight per process
    retries: int = 5  # retries per request after the first try
    backoff_s: float = 0.2  # first backoff; doubled per retry, capped at 10 s, with jitter
    part_bytes: int = 8 << 20  # largest single ranged request
    storage_options: str = "{}"  # JSON, as in METASEQ_ONELOAD_STORAGE_OPTIONS

    def __post_init__(self):
        if self.concurrency < 1 or self.retries < 0 or self.backoff_s < 0 or self.part_bytes < (64 << 10):
            raise ValueError(f"invalid remote storage settings {self}: concurrency >= 1, retries >= 0, "
                             "backoff >= 0, part >= 64 KiB")

    def options_for(self, protocol: str) -> dict:
        opts = json.loads(self.storage_options or "{}")
        if not isinstance(opts, dict):
            raise ValueError(f"METASEQ_ONELOAD_STORAGE_OPTIONS must be a JSON object, got {self.storage_options!r}")
        # Per protocol where keys name protocols and hold objects, else the same for all.
        if opts and all(isinstance(v, dict) for v in opts.values()):
            return dict(opts.get(protocol, {}))
        return opts


def settings() -> RemoteSettings:
    """(local) The settings as the environment says now."""
    env = os.environ
    return RemoteSettings(
        concurrency=int(env.get("METASEQ_ONELOAD_REMOTE_CONCURRENCY", 16)),
        retries=int(env.get("METASEQ_ONELOAD_REMOTE_RETRIES", 5)),
        backoff_s=float(env.get("METASEQ_ONELOAD_REMOTE_BACKOFF", 0.2)),
        part_bytes=int(float(env.get("METASEQ_ONELOAD_REMOTE_PART_MB", 8)) * (1 << 20)),
        storage_options=env.get("METASEQ_ONELOAD_STORAGE_OPTIONS", "{}"),
    )


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


def forget() -> None:
    """Drop cached stats, pins, header bytes and read-ahead windows: the next read asks the store."""
    _CACHE.clear()
    _READ_AHEAD.clear()
    with _STAT_LOCK:
        _STAT_CACHE.clear()
        _PINS.clear()
    for fs in list(_FILESYSTEMS):  # and fsspec's listings (s3fs answers stats from them)
        try:
            fs.invalidate_cache()
        except Exception:  # noqa: BLE001 - a filesystem that keeps none
            pass


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
        fs, p = _fs(path)
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
            _PINS[url] = Stat(int(size), str(version), False, etag=str(version) if _etag_protocol(url) else "")
            _PINS.move_to_end(url)


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


def _fs(url: str) -> tuple:
    """(filesystem, path inside it) for a URL."""
    protocol = url.split("://", 1)[0].lower()
    s = settings()
    fs = _filesystem(protocol, json.dumps(s.options_for(protocol), sort_keys=True), url, os.getpid())
    return fs, fs._strip_protocol(url)


def _url_of(fs, path: str, like: str) -> str:
    """The URL of ``path`` found through ``fs``, spelled with the protocol ``like`` uses."""
    protocol = like.split("://", 1)[0]
    return f"{protocol}://{path.lstrip('/')}" if protocol not in ("http", "https") else path


@functools.lru_cache(maxsize=None)
def _limiter(n: int, pid: int) -> threading.BoundedSemaphore:
    return threading.BoundedSemaphore(n)


def _request(url: str, what: str, fn, *args, **kwargs):
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


@dataclass(frozen=True)
class Stat:
    size: int
    version: str  # ETag, generation or modification time: changes when the object does
    isdir: bool
    etag: str = ""  # what a read sends as If-Match (S3)
    version_id: str = ""  # S3 VersionId, where the bucket keeps versions


def _stat_of(info: dict) -> Stat:
    version = next((str(info[k]) for k in ("ETag", "etag", "generation", "mtime", "LastModified",
                                           "last_modified", "created") if info.get(k) is not None), "")
    return Stat(int(info.get("size") or 0), version, info.get("type") == "directory",
                etag=str(info.get("ETag") or ""), version_id=str(info.get("VersionId") or ""))


def _etag_protocol(url: str) -> bool:
    return url.split("://", 1)[0].lower() in ("s3", "s3a")


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


def _changed(url: str, old: Stat, now: str) -> RemoteObjectChangedError:
    """The error for an object found replaced; forgets what this process kept of it, so that
    the next load (after the user's retry) reads the new version from its start."""
    with _STAT_LOCK:
        _STAT_CACHE.pop(url, None)
        if _PINS.get(url) == old:
            del _PINS[url]
    _CACHE.drop(url)
    _READ_AHEAD.drop(url)
    return RemoteObjectChangedError(
        f"{url}: the object changed while it was being read: this load read its header from the "
        f"version of {old.size} bytes{f' with ETag {old.etag}' if old.etag else f' ({old.version})' if old.version else ''}"
        f", and {now}. Nothing of the other version was used. Load again once nothing writes the object any "
        "more (the next load reads the version the store then holds, from its start); if it is being "
        "written by a running job, load a checkpoint the job has finished writing.")


def _stat_url(url: str) -> Stat:
    now = time.monotonic()
    with _STAT_LOCK:
        hit = _STAT_CACHE.get(url)
    if hit is not None and now - hit[0] < _STAT_TTL_S:
        st = hit[1]
    else:
        fs, path = _fs(url)
        st = _stat_of(_request(url, "stat", fs.info, path))
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
        raise _changed(url, pinned, f"the store now holds one of {st.size} bytes"
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
    fs, p = _fs(path)
    # Fresh: a listing cached by an earlier load would hide files written since.
    fs.invalidate_cache(p)
    entries = _request(path, "list", fs.ls, p, detail=True)
    out = []
    now = time.monotonic()
    base = path.rstrip("/")
    for e in entries:
        name = e["name"].rstrip("/").rsplit("/", 1)[-1]
        if name and e["name"].rstrip("/") != p.rstrip("/"):
            out.append(name)
            with _STAT_LOCK:
                _STAT_CACHE[f"{base}/{name}"] = (now, _stat_of(e))
    return out


def glob(pattern: str) -> list:
    if not is_url(pattern):
        return _glob.glob(pattern)
    fs, p = _fs(pattern)
    return [_url_of(fs, m, pattern) for m in _request(pattern, "glob", fs.glob, p)]


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
    request, whose answer is checked (see the module docstring).

    Raises:
        RemoteStoreError: the store answered with other bytes than asked for (wrong status,
            range or length, a redirect).
        RemoteObjectChangedError: the store holds another version of the object now.
    """
    st = st or _pinned(url)
    n = max(0, min(n, st.size - offset))
    if n <= 0:
        return b""
    fs, path = _fs(url)
    what = f"reading bytes {offset}..{offset + n}"
    if _etag_protocol(url) and hasattr(fs, "_call_s3"):
        from fsspec.asyn import sync

        data = _request(url, what, sync, fs.loop, _s3_ranged, fs, url, path, offset, n, st)
    else:
        # fsspec's other protocols show the bytes only, not the answer's status or range:
        # their length is what can be checked
        data = _request(url, what, fs.cat_file, path, start=offset, end=offset + n)
        if len(data) != n:
            raise _wrong(url, offset, n, f"sent {len(data)} bytes; asked for {n}")
    _STATS.add(bytes=len(data))
    return data


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


async def _s3_ranged(fs, url: str, path: str, offset: int, n: int, st: Stat) -> bytes:
    """One GetObject of bytes ``offset .. offset+n`` of version ``st``: nothing of the body
    is used (nor, past the checks of the headers, read) unless the answer is the range asked
    for, of that version, of exactly ``n`` bytes."""
    bucket, key, vers = fs.split_path(path)
    kw = {"Range": f"bytes={offset}-{offset + n - 1}"}
    if st.etag:
        kw["IfMatch"] = st.etag
    if st.version_id or vers:
        kw["VersionId"] = st.version_id or vers
    await fs.set_session()
    await _hook(fs, bucket)
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
            raise _changed(url, st, "the store holds another version now (it refused a read of that ETag: "
                           "412 Precondition Failed)") from None
        if 300 <= status < 400 or code in ("301", "302", "303", "307", "308", "PermanentRedirect",
                                           "TemporaryRedirect"):
            where = (meta.get("HTTPHeaders") or {}).get("location") or "elsewhere"
            raise _wrong(url, offset, n, f"redirected it (HTTP {status or code} to {where}); a ranged read "
                         "must be answered where it was sent, what a redirect points to is not used") from None
        raise
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
                raise _changed(url, st, f"the store answers for an object of {m.group(3)} bytes")
        if length is not None and int(length) != n:
            raise _wrong(url, offset, n, f"announced {length} bytes for that range; asked for {n}")
        data = bytearray()
        while len(data) <= n:  # one more than asked: a body longer than it said is refused too
            chunk = await body.read(n + 1 - len(data))
            if not chunk:
                break
            data += chunk
        if len(data) != n:
            raise _wrong(url, offset, n, f"sent {len(data)}{'+' if len(data) > n else ''} bytes; asked for {n}")
        return bytes(data)
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


def _pool(n: int) -> concurrent.futures.ThreadPoolExecutor:
    # a forked child inherits the pool objects but none of their threads: new ones there
    with _POOL_LOCK:
        pool = _POOLS.get((n, os.getpid()))
        if pool is None:
            pool = _POOLS[(n, os.getpid())] = concurrent.futures.ThreadPoolExecutor(
                max_workers=n, thread_name_prefix="oneload-get")
        return pool


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


def read_into(url: str, offset: int, view: memoryview) -> int:
    """(local) Fill ``view`` with the object's bytes from ``offset``: parts of at most
    ``part_bytes`` fetched concurrently (within the process-wide bound), each written into
    its place as it arrives; small reads that follow each other share requests
    (:class:`_ReadAhead`). Returns the bytes written (fewer only where the object ends)."""
    s = settings()
    n = len(view)
    if 0 < n <= _ReadAhead.SMALL:
        return _READ_AHEAD.read(url, offset, view)
    pre, size = _READ_AHEAD.take_prefix(url, offset, view) if n else (0, -1)
    if pre:
        # (a window ends where the object does: past it there is nothing to ask for, and a
        # range starting at the end is an error to the store, not a short read)
        rest = min(n, max(pre, size - offset))
        return pre + (read_into(url, offset + pre, view[pre:rest]) if pre < rest else 0)
    parts = [(a, min(n, a + s.part_bytes)) for a in range(0, n, s.part_bytes)]

    def one(a: int, b: int) -> int:
        data = read_range(url, offset + a, b - a)
        view[a:a + len(data)] = data
        return len(data)

    if len(parts) == 1:
        got = [one(*parts[0])]
    else:
        # The caller never runs on a pool thread, so waiting here cannot starve the pool.
        got = list(_pool(s.concurrency).map(lambda ab: one(*ab), parts))
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
    ``torch.load`` and ``zipfile`` read through, and what :func:`_reading._pread_exact`
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
        want = n if n >= _MIN_FETCH else min(self.size - offset, _MIN_FETCH)
        data = read_range(self.url, offset, want, self._st)
        _CACHE.put(self._key, offset, data)
        return data[:n]

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

        list(_pool(s.concurrency).map(one, todo))

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
