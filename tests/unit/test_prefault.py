"""A large buffered read maps its destination's fresh pages in one call before ``preadv``
fills them (``MADV_POPULATE_WRITE``, #26: a page fault per 4 KiB was a fifth of a warm
load's time). What the kernel maps is read back with ``mincore`` (anonymous memory too), the
bytes are compared with torch's own load, and which reads asked for it is watched by wrapping
the helper (never replacing it)."""

from __future__ import annotations

import ctypes
import mmap

import pytest
import torch

from metaseq_oneload import _pagecache, _reading
from metaseq_oneload._reading import Extent, RangeReader, key_path, read_header, storage_byte_offset

MiB = 1 << 20


def _resident(address: int, nbytes: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
    pages = nbytes // mmap.PAGESIZE
    vec = ctypes.create_string_buffer(pages)
    assert libc.mincore(address, nbytes, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec.raw)


def _populate_write_supported() -> bool:
    probe = mmap.mmap(-1, mmap.PAGESIZE)
    try:
        address = ctypes.addressof(ctypes.c_char.from_buffer(probe))
        ok = _pagecache.advise(address, mmap.PAGESIZE, 23)
        del address
        return ok
    finally:
        probe.close()


needs_populate = pytest.mark.skipif(not _populate_write_supported(), reason="kernel before 5.14: no MADV_POPULATE_WRITE")


@needs_populate
def test_prefault_maps_every_whole_page_of_fresh_memory_and_changes_no_byte():
    n = 8 * MiB
    buf = mmap.mmap(-1, n)  # anonymous: nothing mapped until touched
    view = (ctypes.c_char * n).from_buffer(buf)
    address = ctypes.addressof(view)
    assert _resident(address, n) == 0
    _pagecache.prefault(address + 100, n - 200)  # whole pages inside only: the first and last are not
    assert _resident(address, n) == n // mmap.PAGESIZE - 2
    assert bytes(view[:4096]) == bytes(4096) and bytes(view[-4096:]) == bytes(4096)
    view[5000:5004] = b"abcd"
    _pagecache.prefault(address, n)
    assert bytes(view[5000:5004]) == b"abcd"  # mapped pages keep their bytes
    del view
    buf.close()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("prefault") / "ck.pt"
    g = torch.Generator().manual_seed(7)
    sd = {"big": torch.rand(3 * MiB, generator=g), "small": torch.rand(1000, generator=g)}
    torch.save({"model": sd}, path)
    return str(path), sd


def _read(path: str, key: str, reader: RangeReader) -> torch.Tensor:
    meta = read_header(path)["model"][key]
    out = torch.empty(meta.numel(), dtype=meta.dtype)
    ext = Extent(path, key_path("model", key), 0, meta.numel(), storage_byte_offset(meta))
    reader.read_extent(ext, 0, out, meta.dtype)
    return out


@pytest.mark.parametrize("threads", [1, 4])
def test_large_reads_prefault_their_destination_and_small_ones_do_not(saved, monkeypatch, threads):
    path, sd = saved
    asked = []
    real = _reading.prefault
    monkeypatch.setattr(_reading, "prefault", lambda a, n: (asked.append((a, n)), real(a, n)))
    with RangeReader(read_threads=threads, direct=False) as reader:
        big = _read(path, "big", reader)
        lo, hi = big.data_ptr(), big.data_ptr() + big.numel() * 4
        assert all(lo <= a and a + n <= hi and n >= MiB for a, n in asked)
        # every piece of it once, but a head cut short by the pieces' file-offset grid (under 1 MiB)
        assert hi - lo - MiB < sum(n for _, n in asked) <= hi - lo
        assert len({a for a, _ in asked}) == len(asked)
        asked.clear()
        small = _read(path, "small", reader)
        assert asked == []  # under 1 MiB: a call would cost more than the faults it saves
    assert torch.equal(big, sd["big"]) and torch.equal(small, sd["small"])


class _CountingLibc:
    """The process's libc, with its madvise calls counted (everything else passed through)."""

    def __init__(self, libc):
        self._libc, self.madvise_calls = libc, 0

    def madvise(self, *args):
        self.madvise_calls += 1
        return self._libc.madvise(*args)

    def __getattr__(self, name):
        return getattr(self._libc, name)


@needs_populate
def test_a_destination_already_mapped_is_left_alone(monkeypatch):
    # (a reused staging buffer, a module's parameters: walking mapped pages cost more than it saved)
    _pagecache._populates()
    counting = _CountingLibc(_pagecache._LIBC)
    monkeypatch.setattr(_pagecache, "_LIBC", counting)
    fresh = mmap.mmap(-1, 4 * MiB)  # anonymous: nothing mapped until touched
    view = (ctypes.c_char * (4 * MiB)).from_buffer(fresh)
    _pagecache.prefault(ctypes.addressof(view), 4 * MiB)
    assert counting.madvise_calls == 1
    _pagecache.prefault(ctypes.addressof(view), 4 * MiB)  # mapped by the first call now
    del view
    fresh.close()
    touched = torch.zeros(4 * MiB, dtype=torch.uint8)
    _pagecache.prefault(touched.data_ptr(), touched.numel())
    assert counting.madvise_calls == 1
