"""The pooled reader (RangeReader with read_threads > 1, optionally O_DIRECT) puts the same
bytes where the serial one does, across every sub-range boundary, and keeps the serial
reader's guards: a read outside one storage record is refused, a file that ends early says
where, and ``bytes_read`` counts exactly the bytes delivered. Real files, written by
torch.save and safetensors; the reference is torch's own load of them."""

from __future__ import annotations

import json
import os
import struct
import threading
import time

import pytest
import torch

from metaseq_oneload import CheckpointLayoutError
from metaseq_oneload._reading import Extent, RangeReader, key_path, read_header, storage_byte_offset

MiB = 1 << 20
# Odd sizes: no piece boundary falls where a tensor or a read starts or ends.
NUMEL = (5 * MiB + 4 * 1234 + 12) // 4


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(path, key, meta tensor, reference values) of a torch file holding a ~5 MiB tensor
    behind a small one, so the big record starts at no MiB boundary."""
    path = tmp_path_factory.mktemp("pooled") / "big.pt"
    g = torch.Generator().manual_seed(0)
    torch.save({"model": {"small": torch.rand(333, generator=g), "big": torch.rand(NUMEL, generator=g)}}, path)
    meta = read_header(str(path))["model"]["big"]
    ref = torch.load(path, weights_only=True)["model"]["big"]
    return str(path), key_path("model", "big"), meta, ref


def _extent(saved) -> Extent:
    path, key, meta, _ = saved
    return Extent(path, key, 0, meta.numel(), storage_byte_offset(meta))


READS = [(0, NUMEL), (1, NUMEL - 1), (7, NUMEL - 19), (MiB // 4 - 3, MiB // 2 + 6), (3 * MiB // 4 + 1, 2 * MiB // 4 + 3),
         (100, 600_000)]


@pytest.mark.parametrize("threads,split_mb,direct", [(4, 1, False), (8, 2, False), (3, 16, False), (4, 1, True)])
def test_pooled_reads_equal_serial_reads_byte_for_byte(saved, threads, split_mb, direct):
    ext, ref = _extent(saved), saved[3]
    with RangeReader(read_threads=1) as serial, \
            RangeReader(read_threads=threads, split_bytes=split_mb * MiB, direct=direct) as pooled:
        for start, n in READS:
            off = ext.byte_offset + start * 4
            assert len(pooled._pieces(off, n * 4)) > 1, "this read should be split"
            a, b = torch.empty(n), torch.empty(n)
            serial.read_extent(ext, start, a, torch.float32)
            pooled.read_extent(ext, start, b, torch.float32)
            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), (start, n)
            assert torch.equal(b, ref[start: start + n]), (start, n)
        assert pooled.bytes_read == serial.bytes_read == sum(n * 4 for _, n in READS)


def test_pieces_tile_the_read_and_cut_on_aligned_file_offsets():
    r = RangeReader(read_threads=4, split_bytes=2 * MiB)
    for offset, n in [(0, 9 * MiB), (64, 9 * MiB), (MiB - 1, 3 * MiB + 5), (12345, 2 * MiB), (7, MiB)]:
        pieces = r._pieces(offset, n)
        assert pieces[0][0] == 0 and pieces[-1][1] == n
        assert all(b0 == a1 for (_, a1), (b0, _) in zip(pieces, pieces[1:]))
        assert all(b > a for a, b in pieces)
        assert all((offset + a) % MiB == 0 for a, _ in pieces[1:]), pieces
        assert all(b - a <= 2 * MiB for a, b in pieces)
    assert RangeReader(read_threads=1)._pieces(0, 64 * MiB) == [(0, 64 * MiB)]
    r.close()


def test_the_pieces_are_read_on_the_pool(saved, monkeypatch):
    """The split read really runs on several threads (os.preadv is watched, not replaced)."""
    names, real = set(), os.preadv

    def watched(fd, buffers, offset):
        names.add(threading.current_thread().name)
        time.sleep(0.02)  # slow storage: a piece is still in flight when the next is handed out
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", watched)
    ext = _extent(saved)
    with RangeReader(read_threads=4, split_bytes=MiB) as reader:
        out = torch.empty(ext.numel)
        reader.read_extent(ext, 0, out, torch.float32)
    assert torch.equal(out, saved[3])
    assert len({n for n in names if n.startswith("oneload-read")}) >= 2, names


@pytest.mark.parametrize("direct", [False, True])
def test_a_read_outside_one_record_is_refused_and_not_counted(saved, direct):
    path, key, meta, _ = saved
    off = storage_byte_offset(meta)
    with RangeReader(read_threads=4, split_bytes=MiB, direct=direct) as reader:
        for ext in (Extent(path, key, 0, meta.numel() + 1, off), Extent(path, key, 0, 2 * MiB, off - 1)):
            with pytest.raises(CheckpointLayoutError, match=r"big\.pt: asked to read bytes \d+\.\.\d+, which do not "
                                                            r"lie inside one tensor record"):
                reader.read_extent(ext, 0, torch.empty(ext.numel), torch.float32)
        assert reader.bytes_read == 0


@pytest.mark.parametrize("direct", [False, True])
def test_a_file_cut_short_under_the_reader_says_where_it_ends(saved, tmp_path, direct):
    """The file shrinks after the reader checked it (another job rewrote it): the pieces past
    the end come back short, and the error names the first byte that is missing."""
    path = tmp_path / "copy.pt"
    path.write_bytes(open(saved[0], "rb").read())
    ext = Extent(str(path), saved[1], 0, saved[2].numel(), storage_byte_offset(saved[2]))
    with RangeReader(read_threads=4, split_bytes=MiB, direct=direct) as reader:
        reader.read_extent(ext, 0, torch.empty(10), torch.float32)  # checks the archive, opens the file
        cut = ext.byte_offset + 3 * MiB + 4 * 77 + 1
        os.truncate(path, cut)
        out = torch.empty(ext.numel)
        with pytest.raises(CheckpointLayoutError, match=rf"copy\.pt: truncated: needed bytes {ext.byte_offset}\.\."
                                                        rf"{ext.byte_offset + ext.numel * 4} but the file ends at {cut}\."):
            reader.read_extent(ext, 0, out, torch.float32)
        assert reader.bytes_read == 40


def _safetensors(path, tensors) -> dict:
    from safetensors.torch import save_file

    save_file(tensors, str(path))
    raw = open(path, "rb").read(8)
    (hlen,) = struct.unpack("<Q", raw)
    header = json.loads(open(path, "rb").read(8 + hlen)[8:])
    return {k: 8 + hlen + v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}


@pytest.mark.parametrize("direct", [False, True])
def test_a_tensor_that_ends_the_file_is_read_whole(tmp_path, direct):
    """The last tensor of a safetensors file ends exactly where the file does (no zip
    directory after it): O_DIRECT's page-rounded read comes back short there, and that is
    no truncation."""
    pytest.importorskip("safetensors")
    g = torch.Generator().manual_seed(1)
    tensors = {"a": torch.rand(1001, generator=g), "z": torch.rand(NUMEL + 3, generator=g)}
    path = tmp_path / "m.safetensors"
    offsets = _safetensors(path, tensors)
    assert offsets["z"] + tensors["z"].numel() * 4 == os.path.getsize(path)
    with RangeReader(read_threads=4, split_bytes=MiB, direct=direct) as reader:
        for name, t in tensors.items():
            out = torch.empty(t.numel())
            reader.read_extent(Extent(str(path), name, 0, t.numel(), offsets[name]), 0, out, torch.float32)
            assert torch.equal(out, t)
        assert reader.bytes_read == sum(t.numel() * 4 for t in tensors.values())
        # one element past the end: the file ends where the tensor does
        ext = Extent(str(path), "z", 0, tensors["z"].numel() + 1, offsets["z"])
        with pytest.raises(CheckpointLayoutError, match=rf"truncated: .* ends at {os.path.getsize(path)}\."):
            reader.read_extent(ext, 0, torch.empty(ext.numel), torch.float32)


def test_conversion_and_staging_reads_go_through_the_pool(saved):
    """A destination of another dtype is filled through the staging buffer, a chunk at a
    time; each chunk is itself split."""
    ext, ref = _extent(saved), saved[3]
    with RangeReader(read_threads=4, split_bytes=MiB, chunk_bytes=3 * MiB) as reader:
        out = torch.empty(ext.numel, dtype=torch.float64)
        reader.read_extent(ext, 0, out, torch.float32)
        assert reader.bytes_read == ext.numel * 4
    assert torch.equal(out, ref.double())


def test_bad_settings_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="read_threads=0"):
        RangeReader(read_threads=0)
    monkeypatch.setenv("METASEQ_ONELOAD_READ_THREADS", "many")
    with pytest.raises(ValueError, match=r"\$METASEQ_ONELOAD_READ_THREADS='many': expected a number"):
        RangeReader()
    monkeypatch.setenv("METASEQ_ONELOAD_READ_THREADS", "3")
    monkeypatch.setenv("METASEQ_ONELOAD_READ_SPLIT_MB", "4")
    monkeypatch.setenv("METASEQ_ONELOAD_O_DIRECT", "1")
    r = RangeReader()
    assert (r.read_threads, r.split_bytes, r.direct) == (3, 4 * MiB, True)


def test_a_forked_child_reads_with_a_pool_of_its_own(saved):
    """A reader whose pool was started before a fork (a DataLoader worker, a launcher) would
    hand its pieces to threads that do not exist in the child and wait for ever: the child
    starts a pool of its own."""
    import hashlib
    import select
    import signal

    ext, ref = _extent(saved), saved[3]
    want = hashlib.sha256(ref.numpy().tobytes()).digest()
    with RangeReader(read_threads=4, split_bytes=MiB) as reader:
        out = torch.empty(ext.numel)
        reader.read_extent(ext, 0, out, torch.float32)  # the parent's pool is running
        got = torch.empty(ext.numel)  # allocated here: the child runs no torch op (OpenMP after fork)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report, never return into pytest
            digest = b""
            try:
                reader.read_extent(ext, 0, got, torch.float32)
                digest = hashlib.sha256(got.numpy().tobytes()).digest()
            finally:
                os.write(w, digest or b"-")
                os._exit(0)
        os.close(w)
        try:
            ready, _, _ = select.select([r], [], [], 60)
            if not ready:
                os.kill(pid, signal.SIGKILL)
            assert ready, "the forked child's read did not finish within 60 s"
            assert os.read(r, 64) == want
        finally:
            os.close(r)
            os.waitpid(pid, 0)
