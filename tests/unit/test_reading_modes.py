"""Each way RangeReader can take a piece of a local file (``preadv``; under ``direct=True``,
O_DIRECT into the destination itself, its aligned middle moved down in place where the
destination's address and the file offset disagree modulo 512, or a bounce buffer for short
pieces) puts the same bytes in the same places and fails alike on a file cut short. Real files from torch.save; the reference is torch's own load;
cold means ``posix_fadvise(DONTNEED)`` after an fsync, and which path ran is watched (the
functions are wrapped, never replaced)."""

from __future__ import annotations

import os

import pytest
import torch

from metaseq_oneload import CheckpointLayoutError
from metaseq_oneload import _reading
from metaseq_oneload._reading import Extent, RangeReader, key_path, read_header, storage_byte_offset

MiB = 1 << 20
NUMEL = (6 * MiB + 4 * 333 + 8) // 4  # no piece boundary where the record starts or ends


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("modes") / "big.pt"
    g = torch.Generator().manual_seed(3)
    torch.save({"model": {"small": torch.rand(77, generator=g), "big": torch.rand(NUMEL, generator=g)}}, path)
    meta = read_header(str(path))["model"]["big"]
    ref = torch.load(path, weights_only=True)["model"]["big"]
    return str(path), Extent(str(path), key_path("model", "big"), 0, NUMEL, storage_byte_offset(meta)), ref


def _cold(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _direct_ok(path: str) -> bool:
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
        return True
    except (OSError, AttributeError):
        return False


@pytest.fixture
def watch(monkeypatch):
    """How many O_DIRECT reads ran while a test runs."""
    seen = {"direct": 0}
    real = _reading._pread_full

    def counted(fd, offset, view, block=0):
        seen["direct"] += bool(block)  # an O_DIRECT read passes its alignment
        return real(fd, offset, view, block)

    monkeypatch.setattr(_reading, "_pread_full", counted)
    return seen


# (first element, count, elements of slack before the destination): the slack moves the
# destination's address off O_DIRECT's 512-byte alignment by 4-byte steps
READS = [(0, NUMEL, 0), (1, NUMEL - 1, 1), (333, 3 * MiB // 4 + 5, 17), (5, 2 * MiB // 4 + 9, 64), (0, NUMEL, 3)]


@pytest.mark.parametrize("mode", ["warm-plain", "cold-plain", "cold-direct", "warm-direct"])
def test_every_way_of_reading_gives_torchs_bytes(saved, watch, mode):
    path, ext, ref = saved
    with RangeReader(read_threads=4, split_bytes=2 * MiB, direct=mode.endswith("direct")) as reader:
        for start, n, slack in READS:
            if mode.startswith("cold"):
                _cold(path)
            big = torch.full((n + slack,), -1.0)
            reader.read_extent(ext, start, big[slack:], torch.float32)
            assert torch.equal(big[slack:].view(torch.int32), ref[start: start + n].view(torch.int32)), (start, n)
            assert (big[:slack] == -1).all()  # nothing written before the destination
        assert reader.bytes_read == sum(n * 4 for _, n, _ in READS)
    if mode.endswith("plain"):
        assert watch["direct"] == 0, watch
    elif _direct_ok(path):
        assert watch["direct"] > 0, watch


@pytest.mark.parametrize("mode", ["plain", "cold-plain", "direct"])
def test_a_file_cut_short_fails_alike_whichever_way_it_is_read(saved, tmp_path, mode):
    """The file shrinks after the reader checked it: every way of reading names the same
    first missing byte and counts nothing."""
    path = tmp_path / "copy.pt"
    path.write_bytes(open(saved[0], "rb").read())
    ext = Extent(str(path), saved[1].key, 0, NUMEL, saved[1].byte_offset)
    with RangeReader(read_threads=4, split_bytes=2 * MiB, direct=mode == "direct") as reader:
        reader.read_extent(ext, 0, torch.empty(10), torch.float32)  # checks the archive, opens the file
        for cut in (ext.byte_offset + 5 * MiB, ext.byte_offset + 3 * MiB + 4 * 77 + 1, ext.byte_offset + 700):
            os.truncate(path, cut)
            if mode != "plain":
                _cold(str(path))
            for slack in (0, 3):
                big = torch.empty(NUMEL + slack)
                with pytest.raises(CheckpointLayoutError,
                                   match=rf"copy\.pt: truncated: needed bytes {ext.byte_offset}\.\."
                                         rf"{ext.byte_offset + NUMEL * 4} but the file ends at {cut}\."):
                    reader.read_extent(ext, 0, big[slack:], torch.float32)
        assert reader.bytes_read == 40


@pytest.mark.parametrize("mode", ["cold", "warm"])
def test_an_o_direct_read_that_stops_short_mid_file_is_read_on(saved, monkeypatch, mode):
    """A filesystem may answer an O_DIRECT read with fewer bytes than asked mid-file (a
    network filesystem's short reply, a signal), at a count off the 512-byte block that
    otherwise marks the file's end: the reader reads on from there through the ordinary
    descriptor and gives torch's bytes, not a "truncated" error. The syscall is wrapped to
    report half of what it read (what a short reply looks like to the reader)."""
    import fcntl

    path, ext, ref = saved
    if not _direct_ok(path):
        pytest.skip("this filesystem refuses O_DIRECT")
    real, cut = os.preadv, {"n": 0}

    def short(fd, buffers, offset, *flags):
        n = real(fd, buffers, offset, *flags)
        if n > 4096 and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            cut["n"] += 1
            return n // 2 + 100
        return n

    monkeypatch.setattr(os, "preadv", short)
    with RangeReader(read_threads=4, split_bytes=2 * MiB, direct=True) as reader:
        for start, n, slack in READS:
            if mode == "cold":
                _cold(path)
            big = torch.full((n + slack,), -1.0)
            reader.read_extent(ext, start, big[slack:], torch.float32)
            assert torch.equal(big[slack:].view(torch.int32), ref[start: start + n].view(torch.int32)), (start, n)
            assert (big[:slack] == -1).all()
    assert cut["n"] >= len(READS), cut
