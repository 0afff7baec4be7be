"""Safe, lazy reading of torch checkpoint files.

Three ways in, from cheapest to dearest:

* :func:`read_header` (:mod:`._header`) unpickles a file onto the ``meta`` device: every
  tensor comes back with its dtype, shape and the byte offset of its storage in the file,
  and no tensor data is read (one pass of the C unpickler, :mod:`._unpickle`, with torch's
  own ``weights_only`` loader as its fallback; the optimizer state's tensors only once
  used). This is all that layout discovery needs, so inspecting a 2 GB shard costs about
  what a 2 MB one does.
* :class:`RangeReader` reads byte ranges straight into destination tensors with
  ``os.preadv``: torch's zip archives store every storage uncompressed in one record, whose
  place :func:`read_header` finds in the archive itself (:mod:`._zip`) and checks against
  the pickle, so a rank can take exactly the bytes it needs, and nothing else lands in its
  memory. A read outside every storage record is refused, whatever computed it.
* :func:`load_object` is a full ``torch.load(mmap=True)`` for the rare data that is not a
  plain tensor range (legacy-format files, optimizer state, metaseq's full state dicts).

Checkpoints are pickles, and a pickle can run code. Every path here unpickles with
``weights_only=True`` plus an explicit allowlist of the classes real metaseq/fairseq
checkpoints carry (:mod:`._allowlist`). Anything else is refused with
:class:`UnsafeCheckpointError`, unless the caller passes ``trust_pickle=True`` (unsafe: it
runs whatever the file says).
"""

from __future__ import annotations

import bisect
import contextlib
import copy
import ctypes
import errno
import functools
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from . import _header, _storage, _threads
from ._dcp_items import chunk_tensor, data_spans, vouched_spans
from ._errors import CheckpointLayoutError
from ._header import read_header
from ._pagecache import Residency, prefault
from ._settings import LOAD, Settings, from_env
from ._zip import check_deflated, file_kind, stat_key, zip_index

__all__ = [
    "read_header",
    "load_object",
    "RangeReader",
    "Extent",
    "key_path",
    "storage_byte_offset",
    "range_readable",
]


def range_readable(path: str) -> bool:
    """(local) Whether tensors of this torch file can be read in place (see RangeReader):
    a zip whose storage records are all stored uncompressed and little-endian."""
    try:
        return file_kind(path) == "zip" and zip_index(stat_key(path)).why_not_range_readable is None
    except (OSError, CheckpointLayoutError):
        return False


def load_object(path: str, *, trust_pickle: bool = False, mmap: bool = True, exclude: tuple = ()) -> Any:
    """(any rank, local) ``torch.load`` of the whole file onto CPU, memory-mapped where the
    format allows (pages are read only when touched), through the same allowlist.
    ``exclude``: top-level keys left out (an object store's file then never fetches them)."""
    if _header.dcp_data_file(path):  # items only, each its own archive (_dcp_items): no object of its own
        return {}
    # The header's checks first: a memory-mapped torch.load takes each record's bytes
    # without comparing its size to the storage's.
    header = read_header(path, trust_pickle=trust_pickle)
    if _storage.is_url(path) and range_readable(path):
        fetched = _fetched(path, header, exclude)
        if fetched is not None:
            return fetched
    # A compressed or big-endian zip cannot be memory-mapped; torch reads it whole.
    mmap = mmap and (file_kind(path) != "zip" or range_readable(path))
    if file_kind(path) == "zip" and not mmap:
        check_deflated(stat_key(path))
    obj = _header.torch_load(path, trust_pickle=trust_pickle, map_location="cpu", mmap=mmap)
    if exclude and isinstance(obj, dict):
        obj = {k: v for k, v in obj.items() if k not in exclude}
    return obj


def _fetched(url: str, header: Any, exclude: tuple) -> Any:
    """An object's file as ``torch.load`` gives it, from its (checked) header: each storage
    outside ``exclude`` fetched once by ranged reads into fresh CPU memory, everything else
    copied; None where a storage's place is unknown (then the file is read whole)."""
    src = {k: v for k, v in header.items() if k not in exclude} if isinstance(header, dict) else header
    memo: dict = {}
    storages: dict = {}
    for _, t in _header.walk_tensors(src, url):
        if not isinstance(t, torch.Tensor):
            return None
        s = t.untyped_storage()
        offset = getattr(s, "_oneload_offset", None)
        if offset is None:
            return None
        cpu = storages.get(id(s))
        if cpu is None:
            buf = torch.empty(s.nbytes(), dtype=torch.uint8)
            got = _storage.read_into(url, int(offset), _writable_buffer(buf)) if s.nbytes() else 0
            if got < s.nbytes():
                raise CheckpointLayoutError(f"{url}: truncated: a tensor's bytes end at {offset + got}, its record "
                                            f"at {offset + s.nbytes()}. Copy the file again from its source.")
            cpu = storages[id(s)] = buf.untyped_storage()
        memo[id(t)] = torch.empty(0, dtype=t.dtype).set_(cpu, t.storage_offset(), t.shape, t.stride())
    return copy.deepcopy(src, memo)


def storage_byte_offset(meta_tensor: torch.Tensor) -> Optional[int]:
    """Byte offset in its file of a tensor from :func:`read_header`, or None when it cannot
    be read in place (then the tensor is read through :func:`load_object`). The offset is the
    one :func:`read_header` verified against the archive, never torch's computed guess; None
    too for a tensor whose elements are not one run of consecutive bytes (non-contiguous)."""
    base = getattr(meta_tensor.untyped_storage(), "_oneload_offset", None)
    if base is None or not meta_tensor.is_contiguous():
        return None
    return int(base) + meta_tensor.storage_offset() * meta_tensor.element_size()


def _writable_buffer(t: torch.Tensor) -> memoryview:
    """A writable memoryview over a contiguous CPU tensor's bytes (any dtype, bf16 too)."""
    nbytes = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())).cast("B")


@dataclass(frozen=True)
class Extent:
    """A run of ``numel`` consecutive elements of one tensor stored in one file.

    ``key`` names the file tensor (dotted path in the pickle, e.g. ``model.flat_param_0``)
    and ``elem_offset`` where the run starts inside it; ``byte_offset`` is where it starts
    in the file (None where the file cannot be range-read, e.g. legacy format).
    """

    path: str
    key: str
    elem_offset: int
    numel: int
    byte_offset: Optional[int]


_PAGE = 4096
_DIO = 512  # O_DIRECT's alignment of memory, offsets and lengths on Linux block devices


def _inside(spans: tuple, offset: int, n: int) -> bool:
    """Whether bytes ``offset .. offset+n`` lie inside one of the sorted (starts, ends)."""
    i = bisect.bisect_right(spans[0], offset) - 1
    return i >= 0 and offset + n <= spans[1][i]


DEFAULT_READ_THREADS = 8  # $METASEQ_ONELOAD_READ_THREADS unset
_MIN_PIECE = 1 << 20  # below this a read is not worth a thread hand-off
_SAMPLED_PIECES = 16  # pieces the thread count asks the page cache of (_threads_for)


def _cpus() -> int:
    """The CPUs this process may run on (its affinity, as a container or taskset limits it)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class RangeReader:
    """(any rank, local) Reads element ranges of stored tensors into destination tensors.

    Holds one open descriptor per file. Reads go straight into the destination's memory
    when it is a contiguous CPU tensor of the stored dtype; otherwise (another dtype, a
    CUDA destination) through a staging buffer of at most ``chunk_bytes``.

    One large read is split at file offsets that are multiples of a piece size (at most
    ``split_bytes``, whole MiB) and the pieces go to ``read_threads`` threads at once:
    ``os.preadv`` lets go of the GIL, so one process keeps several requests in flight
    (what NVMe and network filesystems need to reach their bandwidth) and fills fresh
    pages of the destination on several cores; a piece of 1 MiB or more read that way has
    its destination's pages mapped first in one call (:func:`._pagecache.prefault`), not a
    fault per page as ``preadv`` writes. ``direct=True`` reads with ``O_DIRECT``
    straight into the destination (a piece's aligned middle; the bytes around it the
    ordinary way), through a page-aligned bounce buffer per thread for pieces under 1 MiB
    (cold reads then skip the page cache; files where the filesystem refuses it are read
    the ordinary way). ``alone=True`` (the reader of a load that is its files' only reader)
    with ``$METASEQ_ONELOAD_O_DIRECT=auto`` (the default; ``direct`` not passed) chooses per piece of
    1 MiB or more: O_DIRECT where the page cache holds under half of its pages (:class:`._pagecache.Residency`),
    ``preadv`` from the cache where it holds more. Other readers never choose it: ranks of a
    node that read the same bytes share them through the cache, which O_DIRECT would bypass.
    What is not passed comes from ``settings`` (a verb's, read once),
    else from the environment (:func:`._settings.from_env`:
    ``$METASEQ_ONELOAD_READ_THREADS`` (8), ``$METASEQ_ONELOAD_READ_SPLIT_MB`` (16),
    ``$METASEQ_ONELOAD_O_DIRECT`` (auto: the choice above; 0 never; 1 always));
    ``read_threads=1`` is the serial reader.
    """

    def __init__(self, *, chunk_bytes: int = 64 << 20, trust_pickle: bool = False,
                 read_threads: Optional[int] = None, split_bytes: Optional[int] = None,
                 direct: Optional[bool] = None, settings: Optional[Settings] = None, alone: bool = False):
        self.chunk_bytes = max(int(chunk_bytes), 1 << 16)
        self.trust_pickle = trust_pickle
        self.bytes_read = 0
        if settings is None and None in (read_threads, split_bytes, direct):
            settings = from_env(only=LOAD)
        # a count asked for (the caller's, or $METASEQ_ONELOAD_READ_THREADS) is taken as it is
        self._threads_asked = read_threads is not None or bool(settings.read_threads)
        if read_threads is None:
            read_threads = settings.read_threads or DEFAULT_READ_THREADS
        if split_bytes is None:
            split_bytes = int(settings.read_split_mb * (1 << 20))
        if int(read_threads) < 1 or int(split_bytes) < 1:
            raise ValueError(f"read_threads={read_threads}, split_bytes={split_bytes}: both must be at least 1.")
        self.read_threads = int(read_threads)
        # whole MiB: every cut lies on a page (and O_DIRECT block) boundary of the file
        self.split_bytes = max(_MIN_PIECE, int(split_bytes) // _MIN_PIECE * _MIN_PIECE)
        chosen = settings.o_direct if direct is None else bool(direct)
        self.direct = bool(chosen)
        # per piece, from what the page cache holds: only for a file's only reader
        self._residency = Residency() if chosen is None and alone else None
        self._fds: dict[str, int] = {}
        self._direct_fds: dict = {}  # path -> O_DIRECT descriptor, or None where refused
        self._retired: list = []  # O_DIRECT descriptors given up on, open until close()
        self._random: set = set()  # paths whose ordinary descriptor reads no further than asked
        self._objects: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._spans: dict = {}
        self._vouched: set = set()  # paths whose spans another rank checked (_dcp_items.vouch)
        self._pool = None
        self._pool_pid = None
        self._bounce = threading.local()
        self._in_place = True  # O_DIRECT into the destination at 512-byte alignment (_read_in_place)
        self.readahead = True

    def set_readahead(self, on: bool) -> None:
        """(local) Whether the kernel may read ahead of this reader's requests
        (``POSIX_FADV_RANDOM`` when not), on descriptors open now and later. Off where other
        nodes read the rest of each file: read-ahead past a rank's ranges (8 MiB on a virtio
        disk, more on network filesystems) would fetch what the storage also serves them."""
        with self._lock:
            self.readahead = bool(on)
            for path, fd in self._fds.items():
                self._advise(path, fd)

    def _advise(self, path: str, fd: int) -> None:
        # (a file read with O_DIRECT stays without read-ahead whatever set_readahead says)
        ahead = self.readahead and path not in self._random
        if hasattr(os, "posix_fadvise"):
            with contextlib.suppress(OSError):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_NORMAL if ahead else os.POSIX_FADV_RANDOM)

    def __enter__(self) -> "RangeReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._pool is not None:
            if self._pool_pid == os.getpid():
                self._pool.shutdown(wait=True)
            self._pool = None
        for fd in list(self._fds.values()) + [d for d in self._direct_fds.values() if d is not None] + self._retired:
            os.close(fd)
        self._retired.clear()
        if self._residency is not None:
            self._residency.close()
        self._fds.clear()
        self._random.clear()
        self._direct_fds.clear()
        self._objects.clear()
        self._spans.clear()
        self._vouched.clear()

    def _fd(self, path: str) -> int:
        with self._lock:
            return self._fd_locked(path)

    def _fd_locked(self, path: str) -> int:
        fd = self._fds.get(path)
        if fd is None:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as e:
                raise CheckpointLayoutError(f"{path}: cannot open the file ({e.strerror or e}).") from e
            if not self.readahead or path in self._random:
                self._advise(path, fd)
            self._fds[path] = fd
        return fd

    def _direct_fd(self, path: str) -> Optional[int]:
        """An O_DIRECT descriptor of ``path``, or None where the platform or filesystem
        refuses one (tmpfs, macOS, some FUSE mounts): those files are read the usual way."""
        with self._lock:
            if path not in self._direct_fds:
                fd = None
                if hasattr(os, "O_DIRECT"):
                    try:
                        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
                    except OSError:
                        fd = None
                self._direct_fds[path] = fd
            return self._direct_fds[path]

    def _no_readahead(self, path: str) -> None:
        """The kernel reads no further than asked on ``path``'s ordinary descriptor once a
        piece of it is read with O_DIRECT: the pieces it reads that way are the bytes around an
        aligned middle and short reads, whose read-ahead (8 MiB on a virtio disk) would fetch
        the neighbouring pieces into the cache as well as the O_DIRECT reads do."""
        if path not in self._random:
            with self._lock:
                if path not in self._random:
                    self._random.add(path)
                    self._advise(path, self._fd_locked(path))

    def _give_up_direct(self, path: str, fd: int) -> None:
        with self._lock:
            if self._direct_fds.get(path) == fd:
                self._direct_fds[path] = None
                # closed at close(), not now: another thread may be reading through it, and a
                # number closed under it could be a file opened meanwhile (its bytes, no error)
                self._retired.append(fd)

    def _executor(self):
        # A forked child inherits the pool object but none of its threads: start anew there.
        if self._pool is None or self._pool_pid != os.getpid():
            with self._lock:
                if self._pool is None or self._pool_pid != os.getpid():
                    import concurrent.futures

                    self._pool = concurrent.futures.ThreadPoolExecutor(  # the caller is the last reader
                        max_workers=max(1, self.read_threads - 1), thread_name_prefix="oneload-read")
                    self._pool_pid = os.getpid()
        return self._pool

    def _pieces(self, offset: int, n: int) -> list:
        """(start, stop) within a read of ``n`` bytes at file ``offset``: cut at multiples of
        the piece size in the file, so pieces fall on the same boundaries whoever asks."""
        if self.read_threads <= 1 or n < 2 * _MIN_PIECE:
            return [(0, n)]
        return _cut(offset, n, self._piece_size(n))

    def _piece_size(self, nbytes: int) -> int:
        """The piece for ``nbytes`` shared out over the threads: at most ``split_bytes``, whole MiB."""
        size = min(self.split_bytes, -(-nbytes // self.read_threads))
        return -(-size // _MIN_PIECE) * _MIN_PIECE

    def _read_piece(self, path: str, offset: int, view: memoryview) -> int:
        """Bytes of ``view`` filled from file ``offset`` on; fewer than asked only where the
        file ends first."""
        if _storage.is_url(path):  # ranged requests, written into ``view`` as they arrive
            return _storage.read_into(path, offset, view)
        # chosen: only where O_DIRECT lands in place (a bounce buffer's copy is the cache's cost)
        chosen = False
        if not self.direct and self._residency is not None and self._in_place and len(view) >= _MIN_PIECE:
            held = self._residency.held(path, self._fd(path), offset, len(view))
            chosen = held is not None and held < 0.5  # (not known: the cache, as without a probe)
        got = None
        if self.direct or chosen:
            dfd = self._direct_fd(path)
            if dfd is not None:
                self._no_readahead(path)
                try:
                    if self._in_place:
                        try:
                            got = self._read_in_place(path, dfd, offset, view)
                        except OSError as e:
                            if e.errno != errno.EINVAL:
                                raise
                            self._in_place = False  # the device wants more than 512-byte alignment
                    if got is None and self.direct:
                        got = self._read_direct(dfd, offset, view)
                except OSError as e:
                    if e.errno != errno.EINVAL:  # alignment the device wants is not ours
                        raise
                    self._give_up_direct(path, dfd)
        if got is not None:
            # An O_DIRECT count off the block is taken for the file's end, but a filesystem
            # may also return one mid-file (a signal, a network filesystem's short reply):
            # the ordinary descriptor reads on from there, which at the real end reads nothing.
            return got if got == len(view) else got + _pread_full(self._fd(path), offset + got, view[got:])
        if len(view) >= _MIN_PIECE:
            prefault(_address(view), len(view))  # one call, not a page fault per 4 KiB that preadv writes
        return _pread_full(self._fd(path), offset, view)

    def _read_in_place(self, path: str, dfd: int, offset: int, view: memoryview) -> Optional[int]:
        """O_DIRECT into ``view`` itself, no bounce buffer: the aligned middle of the range
        lands at the first aligned address inside ``view`` and, where that is not where it
        belongs (the address and the file offset disagree modulo the alignment), moves down
        by under 512 bytes in place; the few bytes before and after it are read the ordinary
        way. None where the range is too short to be worth it."""
        n, p = len(view), _address(view)
        head = -offset % _DIO  # file bytes before the first aligned offset
        shift = -(p + head) % _DIO  # where they land past where they belong
        body = (n - head - shift) // _DIO * _DIO
        if body < _MIN_PIECE:
            return None
        fd = self._fd(path)
        done = _pread_full(fd, offset, view[:head]) if head else 0
        if done < head:
            return done
        got = _pread_full(dfd, offset + head, view[head + shift: head + shift + body], _DIO)
        if shift and got:
            ctypes.memmove(p + head, p + head + shift, got)
        done += got
        if got < body:  # the file ends inside the middle, or a short reply (_read_piece reads on)
            return done
        return done + _pread_full(fd, offset + done, view[done:])

    def _read_direct(self, fd: int, offset: int, view: memoryview) -> int:
        """O_DIRECT wants page-aligned memory, file offsets and lengths: read the pages that
        cover the range into this thread's bounce buffer, and copy out the asked bytes."""
        buf = getattr(self._bounce, "buf", None)
        if buf is None:
            import mmap

            buf = self._bounce.buf = mmap.mmap(-1, min(self.split_bytes, 4 << 20) + 2 * _PAGE)
        window = len(buf) - 2 * _PAGE
        done = 0
        while done < len(view):
            pos = offset + done
            take = min(window, len(view) - done)
            a0 = pos // _PAGE * _PAGE
            a1 = -(-(pos + take) // _PAGE) * _PAGE
            mv = memoryview(buf)
            got = 0
            while got < a1 - a0:
                want = a1 - a0 - got
                n = os.preadv(fd, [mv[got: a1 - a0]], a0 + got)
                got += max(n, 0)
                if n < want:  # short: the file's end or a short reply (_read_piece reads on; no unaligned retry)
                    break
            have = max(0, min(take, got - (pos - a0)))
            view[done: done + have] = mv[pos - a0: pos - a0 + have]
            mv.release()
            done += have
            if have < take:
                break
        return done

    def _record_spans(self, path: str) -> Optional[tuple]:
        """(starts, ends) of the storage records of a torch zip, sorted; None for other files."""
        if path not in self._spans:
            spans = None
            if _header.dcp_data_file(path):  # one torch.save archive per item, as the .metadata places them
                spans = vouched_spans(path)
                if spans is not None:
                    self._vouched.add(path)
                else:
                    spans = data_spans(path)
            elif not path.endswith(".safetensors") and file_kind(path) == "zip":
                index = zip_index(stat_key(path))
                recs = sorted((r.data_offset, r.data_offset + r.size) for r in index.records.values()
                              if r.name.startswith("data/") and r.stored)
                spans = ([a for a, _ in recs], [b for _, b in recs])
            self._spans[path] = spans
        return self._spans[path]

    def _pread(self, path: str, offset: int, out: torch.Tensor, sink=None, split: bool = True) -> None:
        view = _writable_buffer(out)
        if len(view) >= _MIN_PIECE:
            _threads.check_signals()  # an interrupt another thread took stops the load here
        spans = self._record_spans(path)
        if spans is not None and not _inside(spans, offset, len(view)):
            # The describing rank vouched for the chunks of its layout only: parse the items,
            # once, while this file's other readers wait (the reads run on a pool: one that
            # missed too must not check against the vouched spans while they are replaced).
            with self._lock:
                if path in self._vouched:
                    self._vouched.discard(path)
                    self._spans[path] = data_spans(path)
                spans = self._spans[path]
        if spans is not None:  # every read lies inside one storage record, whatever computed it
            if not _inside(spans, offset, len(view)):
                raise CheckpointLayoutError(
                    f"{path}: asked to read bytes {offset}..{offset + len(view)}, which do not lie inside one "
                    "tensor record of the file (its header and the layout disagree, or the file changed since "
                    "it was inspected). Nothing was loaded from it; inspect the checkpoint again.")
        # (an object's read is cut into part_bytes requests, fetched concurrently, by read_into)
        split = split and not _storage.is_url(path)
        pieces = self._pieces(offset, len(view)) if split else [(0, len(view))]
        # ``sink(at, bytes)`` sees each piece on the thread that read it, as it lands (the
        # digest check hashes there, while the other pieces are still being read).
        read = self._read_piece
        if sink is not None:
            read = lambda p, o, v: _sunk(sink, o - offset, v, self._read_piece(p, o, v))  # noqa: E731
        if len(pieces) == 1:
            got = [read(path, offset, view)]
        else:
            import concurrent.futures

            pool = self._executor()
            futures = [pool.submit(read, path, offset + a, view[a:b]) for a, b in pieces[1:]]
            try:  # this thread reads the first piece itself: one hand-off fewer per read
                first = read(path, offset, view[: pieces[0][1]])
            finally:  # every piece finishes before anything is raised: they write into ``out``
                concurrent.futures.wait(futures)
            got = [first] + [f.result() for f in futures]
        for (a, b), n in zip(pieces, got):
            if n < b - a:  # the first short piece is where the file ends
                raise CheckpointLayoutError(
                    f"{path}: truncated: needed bytes {offset}..{offset + len(view)} but the file "
                    f"ends at {offset + a + n}. Copy the file again from its source."
                )
        with self._lock:
            self.bytes_read += len(view)

    reads_runs = True  # (a class attribute: a wrapper's __getattr__ does not answer for it)

    def read_runs(self, runs: Sequence[tuple], progress: Optional[Callable[[int], None]] = None,
                  sinks: Optional[Sequence] = None) -> None:
        """(local: this thread and the reader's pool) For each ``(path, offset, out)``, the
        bytes of local file ``path`` from ``offset`` on into ``out`` (a contiguous CPU tensor
        of the stored dtype: no cast), with every check of :meth:`read_extent`. ``sinks``,
        where given, holds one ``sink(at, bytes)`` (or None) per run, handed each piece of
        its run on the thread that read it, ``at`` bytes into the run, as it lands (as
        :meth:`read_extent`'s ``sink``: the digest check hashes there).

        The runs are read in file order, cut where the file's pieces end (as one large read
        is cut), each piece taken by the next free one of ``read_threads`` threads: the read
        limit's own pattern. Filling a few tensors at once, each cut into pieces, put the
        device's requests out of file order: cold, 1 GiB on this VM, 0.97x of the limit
        against 1.35x by medians (``bench/single_load.py --baseline``; docs/performance-history.md,
        fifth stop). ``progress(nbytes)`` is called on this
        thread as pieces finish. Every piece started has finished before anything is raised
        (they write into the destinations); after a failure no piece starts.

        Memory: beyond the destinations, the O_DIRECT bounce buffer of a thread that reads a
        short piece with ``direct=True`` (4 MiB at most, as for any read)."""
        jobs = self._ordered_pieces(runs, sinks)
        lock = threading.Lock()
        state = {"next": 0, "done": 0, "told": 0, "failed": None}

        def work(report: bool) -> None:
            while True:
                with lock:
                    i = state["next"]
                    if state["failed"] is not None or i >= len(jobs):
                        return
                    state["next"] = i + 1
                path, offset, view, sink, at = jobs[i]
                if sink is not None:
                    sink = functools.partial(_from, sink, at)
                try:
                    self._pread(path, offset, view, sink, split=False)
                except BaseException as e:  # an interrupt, raised on this thread, stops the others too
                    with lock:
                        state["failed"] = state["failed"] or e
                    return
                with lock:
                    state["done"] += view.numel() * view.element_size()
                    if not report or progress is None:
                        continue
                    delta, state["told"] = state["done"] - state["told"], state["done"]
                progress(delta)

        helpers = min(self._threads_for(jobs), len(jobs)) - 1
        futures = [self._executor().submit(work, False) for _ in range(helpers)] if helpers > 0 else []
        try:
            work(True)
        except BaseException as e:  # progress raised, or an interrupt came between pieces
            with lock:
                state["failed"] = state["failed"] or e
            raise
        finally:
            for f in futures:  # the helpers catch everything: this waits for the piece each holds
                f.result()
        if state["failed"] is not None:
            raise state["failed"]
        if progress is not None and state["done"] > state["told"]:
            progress(state["done"] - state["told"])

    def _threads_for(self, jobs: Sequence[tuple]) -> int:
        """How many threads read ``jobs`` (path, offset, destination): ``read_threads``, or no
        more than this process's CPUs where no count was asked for, the reader chooses per piece
        (its files' only reader, ``O_DIRECT=auto``) and the page cache holds at least half of
        the bytes (of a sample of at most 16 pieces, weighed by their size). Read from the
        cache, a piece is a copy, the CPUs' work: more threads only take turns, and starting
        them costs (0.27 GiB warm on 2 CPUs, 9 runs: 97.6 ms median with 8 threads,
        74.6 with 2, the read limit 75.1). Pieces the cache lacks wait on the device, where
        more requests in flight help: those keep every thread."""
        threads = self.read_threads
        if self._threads_asked or self._residency is None or threads <= 1:
            return threads
        cpus = _cpus()
        if cpus >= threads:
            return threads
        if any(_storage.is_url(path) for path, *_ in jobs):
            return threads
        # a sample of the pieces, evenly spaced in file order: a probe per piece (16 windows
        # each) took 10 ms over a 2 GiB file's 250 pieces, before any read starts; 16 pieces
        # took 0.43-0.66 ms, and each asked at its two ends, not in 16 windows, 0.15-0.18 ms
        # (bench/thread_probe.py, 0.27 and 2 GiB): a share of the whole, not a choice per piece
        step = max(1, -(-len(jobs) // _SAMPLED_PIECES))
        total = held = 0.0
        for path, offset, view, *_ in jobs[::step]:
            n = view.numel() * view.element_size()
            share = self._residency.held(path, self._fd(path), offset, n, windows=2)
            if share is None:  # not known (a file mincore will not tell of): as if cold
                return threads
            total += n
            held += n * share
        return cpus if total and 2 * held >= total else threads

    def _ordered_pieces(self, runs: Sequence[tuple], sinks: Optional[Sequence] = None) -> list:
        """(path, offset, destination, the run's sink or None, the piece's place in its run in
        bytes) of every run, cut at multiples of the piece size in the
        file (as :meth:`_pieces` cuts one read: at most ``split_bytes``, smaller where the runs
        in all would not keep every thread busy; runs of under two minimum pieces whole), in
        file order (the pieces, not the runs: two runs over the same bytes, into two
        destinations, interleave)."""
        size = self._piece_size(sum(out.numel() * out.element_size() for *_, out in runs))
        jobs = []
        for (path, offset, out), sink in zip(runs, sinks if sinks is not None else [None] * len(runs), strict=True):
            n = out.numel() * out.element_size()
            if n < 2 * _MIN_PIECE:  # (a tensor of one element may have any stride: not viewed as bytes)
                jobs.extend([(path, offset, out, sink, 0)] if n else [])
                continue
            raw = out.view(torch.uint8)  # many elements, contiguous: cut anywhere
            jobs.extend((path, offset + a, raw[a:b], sink, a) for a, b in _cut(offset, n, size))
        jobs.sort(key=lambda j: (j[0], j[1]))
        return jobs

    def _object_tensor(self, ext: Extent) -> torch.Tensor:
        if ext.path.endswith(".safetensors"):
            from safetensors import safe_open

            cached = self._objects.get((ext.path, ext.key))
            if cached is None:  # one tensor at a time: verify walks a tensor in chunks
                self._objects = {k: v for k, v in self._objects.items() if not isinstance(k, tuple)}
                with safe_open(ext.path, framework="pt") as handle:
                    cached = self._objects[(ext.path, ext.key)] = handle.get_tensor(ext.key).reshape(-1)
            return cached[ext.elem_offset: ext.elem_offset + ext.numel]
        if _header.dcp_data_file(ext.path):  # the chunk's own torch.save archive, loaded on its own
            cached = self._objects.get((ext.path, ext.key))
            if cached is None:
                self._objects = {k: v for k, v in self._objects.items() if not isinstance(k, tuple)}
                cached = self._objects[(ext.path, ext.key)] = chunk_tensor(ext.path, ext.key)
            return cached[ext.elem_offset: ext.elem_offset + ext.numel]
        obj = self._objects.get(ext.path)
        if obj is None:
            # Memory-mapped where the format allows; a legacy (pre-1.6) file cannot be, so it
            # is read whole and kept until close(): every part it holds is read from it
            # without loading it again (peak memory: the legacy files a load touches).
            obj = load_object(ext.path, trust_pickle=self.trust_pickle)
            self._objects[ext.path] = obj
        t = obj
        for part in ext.key.split("\x00"):
            t = t[part]
        return t.reshape(-1)[ext.elem_offset: ext.elem_offset + ext.numel]

    def read_extent(self, ext: Extent, start: int, out: torch.Tensor, dtype: torch.dtype, sink=None) -> None:
        """Fill 1-D ``out`` with elements ``start .. start+len(out)`` of ``ext`` (stored as
        ``dtype``), converting dtype/device as needed. ``sink(at, bytes)``, if given, is
        handed the stored bytes read, ``at`` bytes after those of element ``start``, as
        they land (before any cast)."""
        n = out.numel()
        if n == 0:
            return
        if ext.byte_offset is None:
            src = self._object_tensor(ext)[start: start + n]
            if sink is not None:
                src = src.contiguous()
                sink(0, _writable_buffer(src))
            out.copy_(src)
            return
        itemsize = torch.empty((), dtype=dtype).element_size()
        offset = ext.byte_offset + start * itemsize
        if out.device.type == "cpu" and out.dtype == dtype and out.is_contiguous():
            self._pread(ext.path, offset, out, sink)
            return
        self._staged(ext.path, offset, out, dtype, itemsize, sink)

    def _staged(self, path: str, offset: int, out: torch.Tensor, dtype: torch.dtype, itemsize: int,
                sink=None) -> None:
        """Read through staging buffers of at most ``chunk_bytes`` each, then copy (and cast)
        into ``out``. Onto CUDA: two pinned buffers, each copy to the device issued without
        waiting (``non_blocking``), so the read of the next chunk runs while the last one
        travels; a buffer is refilled only after its copy's event has completed, and every
        copy is complete on return. (A copy that also casts converts on the host first, into
        pageable memory, so it waits.) Host memory: two chunks (three where a copy casts);
        device memory: ``out``."""
        n = out.numel()
        step = max(1, self.chunk_bytes // itemsize)
        cuda = out.device.type == "cuda" and torch.cuda.is_available()
        bufs = [torch.empty(min(step, n), dtype=dtype, pin_memory=cuda) for _ in range(2 if cuda and n > step else 1)]
        done: list = [None] * len(bufs)  # the CUDA event of the copy out of each buffer
        try:
            for i, lo in enumerate(range(0, n, step)):
                hi, b = min(n, lo + step), i % len(bufs)
                if done[b] is not None:
                    done[b].synchronize()
                buf = bufs[b][: hi - lo]
                self._pread(path, offset + lo * itemsize, buf,
                            None if sink is None else (lambda at, v, base=lo * itemsize: sink(base + at, v)))
                out[lo:hi].copy_(buf, non_blocking=cuda)
                if cuda:
                    done[b] = torch.cuda.Event()
                    done[b].record(torch.cuda.current_stream(out.device))  # the stream copy_ used
        finally:
            for ev in done:
                if ev is not None:
                    ev.synchronize()

    def read_from_mmap(self, ext: Extent, start: int, n: int) -> torch.Tensor:
        """The same elements through ``torch.load(mmap=True)``: an independent path used by
        ``verify=True`` to check the byte arithmetic of :meth:`read_extent`."""
        return self._object_tensor(ext)[start: start + n]


def _cut(offset: int, n: int, size: int) -> list:
    """(start, stop) within a read of ``n`` bytes at file ``offset``, cut at the multiples of
    ``size`` in the file: pieces fall on the same boundaries whoever asks."""
    edges = [0, *range(-(-(offset + 1) // size) * size - offset, n, size), n]
    return list(zip(edges, edges[1:]))


def _pread_full(fd: int, offset: int, view: memoryview, block: int = 0) -> int:
    """``preadv`` until ``view`` is full or the file ends: the bytes read. ``block``: an
    O_DIRECT descriptor's alignment (``offset`` and ``view`` aligned), where a count off it
    stops the loop (the file's end, or a short reply the caller reads on from through the
    ordinary descriptor: an O_DIRECT retry from there would be refused)."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            break
        done += n
        if block and n % block:
            break
    return done


def _address(view: memoryview) -> int:
    """Where a writable memoryview's first byte lies in memory."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def _from(sink, base: int, at: int, view: memoryview) -> None:
    """``sink`` handed bytes ``at`` into a piece that lies ``base`` bytes into its run."""
    sink(base + at, view)


def _sunk(sink, at: int, view: memoryview, got: int) -> int:
    """Hand ``sink`` the ``got`` bytes just read into ``view`` (``at`` bytes into the read)."""
    if got:
        sink(at, view[:got])
    return got


def key_path(*parts: str) -> str:
    """Join the keys that lead to a tensor inside a checkpoint's pickle (see Extent.key)."""
    return "\x00".join(parts)

