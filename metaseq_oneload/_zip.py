"""A torch zip archive, as a zip reader (and so ``torch.load``) finds its records.

Recent torch (2.13 here) does not read a storage's place in the file when it unpickles onto
``meta``: it computes it, assuming the archive was written by torch's own writer (miniz:
records in key order, a 16- or 24-byte data descriptor after each, local headers padded to
``.storage_alignment`` with a fixed extra field). A valid zip written any other way (re-
stored with Python's zipfile, ZIP64 forced, another tool) gets offsets that point into the
wrong bytes, and no meta load checks a record's size. So every offset the engine reads is
taken from the archive itself here, as ``torch.load`` finds it when it reads the data:
central directory -> the record's *local* header -> its data, then checked against the
pickle's own claims (:mod:`._header`: record size == storage bytes, every tensor inside its
storage).
"""

from __future__ import annotations

import functools
import os
import struct
import zipfile
import zlib
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from . import _storage
from ._errors import CheckpointLayoutError, os_error_message

__all__ = ["ZipRecord", "ZipIndex", "zip_index", "parse_archive", "stat_key", "file_kind", "record_bytes", "check_deflated",
           "bad_zip", "NOT_TORCH_IN_A_SET"]

_ZIP_MAGIC = b"PK\x03\x04"
# Pickle protocol 2 opcode followed by a LONG1 of 10 bytes: the magic number that
# torch's pre-1.6 ("legacy") serialization writes first.
_LEGACY_MAGIC = b"\x80\x02\x8a\n"


def file_kind(path: str) -> str:
    """(local) 'zip', 'legacy', or raise a CheckpointLayoutError naming what the file is instead."""
    try:
        if _storage.is_url(path):  # an object: its first bytes through the header cache
            src = _storage.RemoteFile(path)
            size, head = src.size, src.pread(8, 0)
        else:
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                head = f.read(8)
    except OSError as e:
        raise CheckpointLayoutError(os_error_message(e, path)) from e
    if size == 0:
        raise CheckpointLayoutError(f"{path}: the file is empty (0 bytes); expected a torch checkpoint.")
    if head.startswith(_ZIP_MAGIC):
        if not zipfile.is_zipfile(src if _storage.is_url(path) else path):
            raise CheckpointLayoutError(
                f"{path}: truncated or corrupted: it starts like a torch zip checkpoint but its zip "
                f"directory, which torch writes at the very end, is missing ({size} bytes on disk). "
                "Copy the file again from its source, or delete it and re-create the set."
            )
        return "zip"
    if head.startswith(_LEGACY_MAGIC):
        return "legacy"
    raise CheckpointLayoutError(
        f"{path}: not a torch checkpoint: it starts with {head!r}, expected a torch zip archive "
        f"('PK\\x03\\x04') or torch's legacy pickle format.{NOT_TORCH_IN_A_SET}"
    )


# The advice for a non-torch file among a set's files; one file named alone gets another
# (formats/_torchsave.py), since removing it would leave nothing.
NOT_TORCH_IN_A_SET = " Remove it from the checkpoint set."


_EOCD = struct.Struct("<4s4H2LH")  # end of central directory
_EOCD64_LOCATOR = struct.Struct("<4sLQL")
_EOCD64 = struct.Struct("<4sQ2H2L4Q")
_CENTRAL = struct.Struct("<4s4B4HL2L5H2L")
_LOCAL = struct.Struct("<4s2B4HL2L2H")
_U16, _U32 = 0xFFFF, 0xFFFFFFFF
# What miniz, torch's zip reader, can decompress; anything else torch.load cannot read.
_METHODS = {0: "stored", 8: "deflate"}
_METHOD_NAMES = {12: "bzip2", 14: "lzma", 93: "zstandard", 95: "xz", 99: "AES-encrypted"}


@dataclass(frozen=True)
class ZipRecord:
    """One member of a torch archive, located as a zip reader finds it (central directory
    entry, then the record's own local header, whose name and extra-field lengths may
    differ from the central directory's)."""

    name: str  # inside the archive's folder, e.g. "data/0"
    header_offset: int
    data_offset: int  # first byte of the (possibly compressed) data
    size: int  # bytes once uncompressed, per the central directory
    compressed_size: int
    method: int  # 0 stored, 8 deflate

    @property
    def stored(self) -> bool:
        return self.method == 0


@dataclass(frozen=True)
class ZipIndex:
    """The records of one torch archive that ``torch.load`` reads, by name."""

    path: str
    folder: str  # the archive's top folder: torch looks every record up under it
    records: Mapping[str, ZipRecord]
    byteorder: Optional[str]  # the "byteorder" record, None where absent (torch reads little)

    @property
    def why_not_range_readable(self) -> Optional[str]:
        """None when every storage record can be read in place, else why not."""
        for rec in self.records.values():
            if rec.name.startswith("data/") and not rec.stored:
                return f"record {self.folder}/{rec.name} is compressed ({_METHODS.get(rec.method)})"
        if self.byteorder == "big":
            return "tensors are stored big-endian"
        return None


def bad_zip(path: str, what: str) -> CheckpointLayoutError:
    """The refusal of an archive torch could not read (or could read two ways), saying ``what``."""
    return CheckpointLayoutError(
        f"{path}: not a readable torch zip archive: {what}. Copy the file again from its source; if it "
        "was re-packed by a tool, re-create it with torch.save (or Python's zipfile, uncompressed).")


def _pread_exact(fd: int, offset: int, n: int, path: str, what: str) -> bytes:
    data = _storage.pread(fd, n, offset)  # fd: a descriptor, or an object store's RemoteFile
    if len(data) != n:
        raise bad_zip(path, f"{what} at byte {offset} runs past the end of the file")
    return data


def _central_directory(fd: int, size: int, path: str) -> tuple:
    """(entries, start of the central directory): each entry (name, flags, method,
    compressed size, size, local header offset), ZIP64 fields resolved."""
    # An archive without a comment (torch.save's) ends with its end record: the search below
    # would pick that one out of the longer tail too, so those 22 bytes are all it takes (an
    # object store then serves no 64 KiB of tensor bytes per archive).
    tail_len = min(size, _EOCD.size)
    tail = _pread_exact(fd, size - tail_len, tail_len, path, "the end of the archive")
    if tail_len < _EOCD.size or tail[:4] != b"PK\x05\x06" or _EOCD.unpack_from(tail, 0)[-1] != 0:
        tail_len = min(size, _EOCD.size + _U16)
        tail = _pread_exact(fd, size - tail_len, tail_len, path, "the end of the archive")
    pos = tail.rfind(b"PK\x05\x06")
    while pos >= 0 and (len(tail) - pos < _EOCD.size
                        or pos + _EOCD.size + _EOCD.unpack_from(tail, pos)[-1] != len(tail)):
        pos = tail.rfind(b"PK\x05\x06", 0, pos)
    if pos < 0:
        raise bad_zip(path, "no end-of-central-directory record at the end of the file (truncated?)")
    eocd_at = size - tail_len + pos
    _, disk, cd_disk, _, count, cd_size, cd_offset, _ = _EOCD.unpack_from(tail, pos)
    limit = eocd_at  # the central directory ends before this
    loc_at = eocd_at - _EOCD64_LOCATOR.size
    if loc_at >= 0:
        loc = _pread_exact(fd, loc_at, _EOCD64_LOCATOR.size, path, "the ZIP64 locator")
        if loc[:4] == b"PK\x06\x07":
            _, _, eocd64_at, _ = _EOCD64_LOCATOR.unpack(loc)
            rec = _pread_exact(fd, eocd64_at, _EOCD64.size, path, "the ZIP64 end record")
            if rec[:4] != b"PK\x06\x06":
                raise bad_zip(path, f"the ZIP64 locator points at byte {eocd64_at}, which holds no ZIP64 end record")
            _, _, _, _, disk, cd_disk, _, count, cd_size, cd_offset = _EOCD64.unpack(rec)
            limit = eocd64_at
    if disk != 0 or cd_disk != 0:
        raise bad_zip(path, "it is a multi-volume (split) archive")
    if cd_offset + cd_size > limit:
        raise bad_zip(path, f"its central directory (bytes {cd_offset}..{cd_offset + cd_size}) "
                             "overlaps its end record")
    cd = _pread_exact(fd, cd_offset, cd_size, path, "the central directory")
    entries, p = [], 0
    for _ in range(count):
        if p + _CENTRAL.size > len(cd) or cd[p:p + 4] != b"PK\x01\x02":
            raise bad_zip(path, f"central directory entry at byte {cd_offset + p} is damaged")
        (_, _, _, _, _, flags, method, _, _, _, csize, usize, nlen, xlen, clen, _, _, _,
         hoff) = _CENTRAL.unpack_from(cd, p)
        raw = cd[p + _CENTRAL.size: p + _CENTRAL.size + nlen]
        extra = cd[p + _CENTRAL.size + nlen: p + _CENTRAL.size + nlen + xlen]
        p += _CENTRAL.size + nlen + xlen + clen
        if _U32 in (usize, csize, hoff):  # the real values are in the ZIP64 extra field, in this order
            x = 0
            while x + 4 <= len(extra):
                tag, ln = struct.unpack_from("<HH", extra, x)
                if tag == 1:
                    vals = list(struct.unpack_from(f"<{ln // 8}Q", extra, x + 4))
                    if usize == _U32 and vals:
                        usize = vals.pop(0)
                    if csize == _U32 and vals:
                        csize = vals.pop(0)
                    if hoff == _U32 and vals:
                        hoff = vals.pop(0)
                    break
                x += 4 + ln
        name = raw.decode("utf-8" if flags & 0x800 else "cp437", errors="replace")
        _check_sizes(path, name, method, csize, usize, hoff, size)
        entries.append((name, flags, method, csize, usize, hoff))
    return entries, cd_offset


# deflate's densest code (a 258-byte match in about 2 bits) bounds what a stream can inflate to
_DEFLATE_RATIO = 1032
_DEFLATE_SLACK = 1 << 10
# A record read into memory whole (the pickle, byteorder: every record but the storages
# under data/) inflates to at most max(64 MiB, 64 x its compressed bytes): torch.save's
# pickles are at most tens of MB (11 MB for 40,000 optimizer entries) and deflate 3-10:1,
# where 1 GiB of zeros after a pickle's STOP deflates 1032:1 into a 1 MB file.
_INFLATED_CAP = 64 << 20
_INFLATED_RATIO = 64


def _check_sizes(path: str, name: str, method: int, csize: int, usize: int, hoff: int, size: int) -> None:
    """Refuse a directory entry whose sizes torch's zip reader (miniz) refuses when it opens
    the archive, whichever record it is: every later read of a record is sized by these
    numbers, so an entry that disagrees with itself would have us read another record's
    bytes (a stored record read for its uncompressed size runs into the next one)."""
    if method == 0 and csize != usize:
        raise bad_zip(path, f"record {name} is stored uncompressed, yet its directory entry gives {csize} bytes "
                             f"in the file and {usize} once read; torch.load refuses the archive too ('invalid "
                             "header or archive is corrupted')")
    if usize and not csize:
        raise bad_zip(path, f"record {name} claims {usize} bytes from 0 bytes in the file; torch.load refuses "
                             "the archive too ('invalid header or archive is corrupted')")
    if hoff + _LOCAL.size + csize > size:
        raise bad_zip(path, f"record {name} ({csize} bytes from byte {hoff}) runs past the end of the file "
                             f"({size} bytes); torch.load refuses the archive too")


def _parse_zip(path: str) -> ZipIndex:
    """The archive's records as a zip reader (and so torch.load) reads them; raises
    CheckpointLayoutError on anything torch could not read or could read two ways."""
    fd = _storage.open_ro(path)
    try:
        return parse_archive(fd, path)
    finally:
        _storage.close(fd)


def parse_archive(fd: Any, path: str) -> ZipIndex:
    """(local) :func:`_parse_zip` of an archive read through ``fd`` (a descriptor, a
    RemoteFile, or a window onto part of a larger file: a ``.distcp`` item, see
    :mod:`._dcp_items`), offsets relative to its start; ``fd`` stays open."""
    size = _storage.fsize(fd)
    entries, cd_offset = _central_directory(fd, size, path)
    if not entries:
        raise bad_zip(path, "the archive holds no records")
    if not isinstance(fd, int):  # an object: every local header in one concurrent batch
        fd.prefetch([(e[5], _LOCAL.size + 1024) for e in entries])
    # torch looks every record up under the folder of the archive's first entry.
    folder = entries[0][0].split("/", 1)[0]
    prefix = folder + "/"
    records: dict = {}
    for name, flags, method, csize, usize, hoff in entries:
        if not name.startswith(prefix):
            continue
        short = name[len(prefix):]
        if short in records:
            raise CheckpointLayoutError(
                f"{path}: the archive holds two records named {name}; which one a reader takes is "
                "undefined. Re-create the file with torch.save.")
        if flags & 0x1:
            raise CheckpointLayoutError(f"{path}: record {name} is encrypted; torch cannot read it.")
        if method not in _METHODS:
            raise CheckpointLayoutError(
                f"{path}: record {name} is compressed with zip method {method} "
                f"({_METHOD_NAMES.get(method, 'unknown')}), which torch.load cannot read either. "
                "Re-store the archive uncompressed (zip -0, or Python zipfile with ZIP_STORED).")
        if method == 8 and usize > csize * _DEFLATE_RATIO + _DEFLATE_SLACK:
            # before anything is allocated: torch's reader allocates the declared size, then
            # inflates into it (and hands back what it did not fill where the stream stops)
            raise bad_zip(path, f"record {name} claims to inflate to {usize} bytes from {csize} compressed "
                                 f"bytes, more than deflate can produce ({_DEFLATE_RATIO}:1)")
        cap = max(_INFLATED_CAP, _INFLATED_RATIO * csize)
        if method == 8 and not short.startswith("data/") and usize > cap:
            # read into memory whole (by torch's reader too): refused before anything is inflated
            raise bad_zip(path, f"record {name} declares {usize} bytes once inflated, from {csize} compressed "
                                 f"bytes; a record read whole into memory (the pickle) may declare at most "
                                 f"{cap} (64 MiB, or {_INFLATED_RATIO} times its compressed size): torch.save's "
                                 "pickles are at most tens of MB and deflate a few times, so this one was "
                                 "padded or crafted")
        local = _pread_exact(fd, hoff, _LOCAL.size, path, f"the local header of {name}")
        if local[:4] != b"PK\x03\x04":
            raise bad_zip(path, f"the central directory places {name} at byte {hoff}, "
                                 "which holds no local file header")
        lnlen, lxlen = _LOCAL.unpack(local)[-2:]
        data = hoff + _LOCAL.size + lnlen + lxlen
        if data + csize > cd_offset:
            raise bad_zip(path, f"record {name} (bytes {data}..{data + csize}) runs into the central "
                                 f"directory at byte {cd_offset}")
        records[short] = ZipRecord(short, hoff, data, usize, csize, method)
    # Records must not share bytes: one record's data read as another's is the failure
    # this whole check exists to prevent.
    spans = sorted(records.values(), key=lambda r: r.header_offset)
    for a, b in zip(spans, spans[1:]):
        if a.data_offset + a.compressed_size > b.header_offset:
            raise bad_zip(path, f"records {prefix}{a.name} and {prefix}{b.name} overlap")
    byteorder = None
    if "byteorder" in records:
        byteorder = record_bytes(fd, records["byteorder"], path, folder).decode("ascii", "replace").strip()
    return ZipIndex(path, folder, records, byteorder)


def record_bytes(fd: int, rec: ZipRecord, path: str, folder: str = "") -> "bytes | bytearray":
    """(local) A small record's bytes (the pickle, byteorder), never more than its directory
    entry declares: a stream that would inflate past it stops there and is refused. A
    deflated record comes back as the bytearray it was inflated into (declared sizes capped
    in :func:`_parse_zip`); read it through :func:`._opscan.stream`, which copies nothing."""
    label = f"{folder}/{rec.name}" if folder else rec.name
    if rec.method == 8:
        return _inflate_exact(fd, rec, path, keep=True, label=label)
    raw = _pread_exact(fd, rec.data_offset, rec.compressed_size, path, f"record {label}")
    if len(raw) != rec.size:
        raise bad_zip(path, f"record {label} holds {len(raw)} bytes, its directory entry says {rec.size}")
    return raw


_INFLATE_STEP = 4 << 20


def _inflate_exact(fd: int, rec: ZipRecord, path: str, *, keep: bool, label: str = "") -> Optional[bytearray]:
    """(local) Inflate a deflated record, refusing a stream that does not end exactly at the
    record's declared size within its compressed bytes. Memory: when ``keep``, one buffer of
    the declared size that the stream is inflated into (no second copy), else a few MiB.

    torch's reader inflates into a buffer of the declared size and, where the stream stops
    early or runs on, hands back that buffer without a word: its unfilled bytes are whatever
    the allocator left there. So a record is inflated here, and checked, before torch reads it.
    """
    label = label or rec.name
    d = zlib.decompressobj(-15)
    out = bytearray(rec.size) if keep else None
    done, pos, end = 0, rec.data_offset, rec.data_offset + rec.compressed_size
    pending = b""
    try:
        while not d.eof and done <= rec.size:
            if not pending:
                if pos >= end:
                    break
                n = min(_INFLATE_STEP, end - pos)
                pending = _pread_exact(fd, pos, n, path, f"record {label}")
                pos += n
            # max_length: one call never produces more than a step, nor more than one byte
            # past the declared size (enough to see a stream that goes on)
            piece = d.decompress(pending, min(_INFLATE_STEP, rec.size + 1 - done))
            pending = d.unconsumed_tail
            if keep and done + len(piece) <= rec.size:
                out[done:done + len(piece)] = piece
            done += len(piece)
    except zlib.error as e:
        raise bad_zip(path, f"record {label} does not inflate ({e})") from None
    if done > rec.size:
        raise bad_zip(path, f"record {label} inflates to more than the {rec.size} bytes its directory entry "
                             "declares (inflating stopped there)")
    if not d.eof:
        raise bad_zip(path, f"record {label}'s compressed stream ends after {done} of its {rec.size} bytes "
                             f"(its {rec.compressed_size} compressed bytes hold no end of stream)")
    if done != rec.size:
        raise bad_zip(path, f"record {label} holds {done} bytes, its directory entry says {rec.size}")
    return out


@functools.lru_cache(maxsize=256)
def check_deflated(key: tuple) -> None:
    """(local) Every deflated record of a zip inflates to exactly its declared size: checked
    once per file version before ``torch.load`` reads it whole (see :func:`_inflate_exact`)."""
    path = key[0]
    index = zip_index(key)
    records = [r for r in index.records.values() if r.method == 8]
    if not records:
        return
    fd = _storage.open_ro(path)
    try:
        for rec in records:
            _inflate_exact(fd, rec, path, keep=False, label=f"{index.folder}/{rec.name}")
    finally:
        _storage.close(fd)


@functools.lru_cache(maxsize=4096)
def zip_index(key: tuple) -> ZipIndex:
    """(local) The records of the file version ``key`` (:func:`stat_key`), parsed once."""
    try:
        return _parse_zip(key[0])
    except OSError as e:
        raise CheckpointLayoutError(os_error_message(e, key[0])) from e


def stat_key(path: str) -> tuple:
    """(local) What identifies one version of a file, for the caches keyed on it."""
    if _storage.is_url(path):  # (url, size, ETag or the store's version, -)
        st = _storage.stat(path)
        return (path, st.size, st.version, 0)
    st = os.stat(path)
    return (os.path.realpath(path), st.st_size, st.st_mtime_ns, st.st_ino)
