"""RangeReader.read_runs: a list of byte runs (a load's plain reads) read in file order, cut
at the file's piece boundaries, on the reader's threads. The same bytes as torch's own load
of the file, the reader's guards kept, pieces started in file order whatever order the
runs came in, and every started piece finished before a failure is raised."""

from __future__ import annotations

import random
import shutil
import threading
import time

import pytest
import torch

import metaseq_oneload as mo
from metaseq_oneload import CheckpointLayoutError
from metaseq_oneload._reading import RangeReader, read_header, storage_byte_offset

MiB = 1 << 20
# Odd sizes: piece boundaries fall inside tensors, and no tensor starts on a MiB.
SIZES = {"a": 333, "b": (3 * MiB + 4 * 77) // 4, "c": 1001, "d": (5 * MiB + 12) // 4, "e": 7, "f": (2 * MiB + 4) // 4}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(path, {name: (file offset, reference tensor)}) of a torch.save file."""
    path = tmp_path_factory.mktemp("runs") / "model.pt"
    g = torch.Generator().manual_seed(1)
    torch.save({"model": {k: torch.rand(n, generator=g) for k, n in SIZES.items()}}, path)
    meta, ref = read_header(str(path))["model"], torch.load(path, weights_only=True)["model"]
    return str(path), {k: (storage_byte_offset(meta[k]), ref[k]) for k in SIZES}


def _runs(saved, seed: int) -> tuple:
    """Runs over every tensor whole and over parts of some, shuffled, with their destinations
    and the references they must equal."""
    path, where = saved
    runs, checks = [], []
    for k, (offset, ref) in where.items():
        spans = [(0, ref.numel())] + ([(11, ref.numel() // 2 + 3)] if ref.numel() > 1000 else [])
        for lo, hi in spans:
            out = torch.full((hi - lo,), float("nan"))
            runs.append((path, offset + 4 * lo, out))
            checks.append((out, ref[lo:hi]))
    random.Random(seed).shuffle(runs)
    return runs, checks


@pytest.mark.parametrize("threads,split_mb", [(1, 16), (4, 1), (8, 2), (3, 1)])
def test_runs_in_any_order_land_as_torch_loads_them(saved, threads, split_mb):
    runs, checks = _runs(saved, seed=threads)
    told = []
    with RangeReader(read_threads=threads, split_bytes=split_mb * MiB) as reader:
        reader.read_runs(runs, told.append)
        assert reader.bytes_read == sum(out.numel() * 4 for _, _, out in runs)
    for out, ref in checks:
        assert torch.equal(out, ref)
    assert sum(told) == sum(out.numel() * 4 for _, _, out in runs)


def _spy_reads(monkeypatch) -> list:
    """(path, offset, bytes, split) of every _pread, as each starts."""
    started, real = [], RangeReader._pread

    def spy(self, path, offset, out, sink=None, split=True):
        started.append((path, offset, out.numel() * out.element_size(), split))
        return real(self, path, offset, out, sink, split)

    monkeypatch.setattr(RangeReader, "_pread", spy)
    return started


def test_pieces_are_read_in_file_order_cut_at_the_file_s_piece_boundaries(saved, monkeypatch):
    """Shuffled runs (two over the same bytes); on one thread the reads come in file order
    exactly, each piece past a run's first starting on a multiple of the piece size in the
    file, none cut again inside the reader."""
    runs, checks = _runs(saved, seed=7)
    started = _spy_reads(monkeypatch)
    with RangeReader(read_threads=1, split_bytes=MiB) as reader:
        reader.read_runs(runs)
    assert [s[:2] for s in started] == sorted(s[:2] for s in started), started
    assert all(not split for *_, split in started), "read_runs' pieces are not cut again"
    whole = {(p, off, out.numel() * 4) for p, off, out in runs}
    for path, offset, n, _ in started:
        if (path, offset, n) in whole and n < 2 * MiB:
            continue  # a run of under two pieces is read whole
        assert n <= MiB, (offset, n)
        assert offset % MiB == 0 or any(p == path and off == offset for p, off, _ in whole), (offset, n)
    assert len(started) > len(runs), "no run was cut"
    for out, ref in checks:
        assert torch.equal(out, ref)


def test_a_one_element_destination_of_any_stride_is_read(saved):
    """A module's one-element parameter may be a view with any stride (contiguous all the
    same); it cannot be viewed as bytes, and needs not be."""
    path, where = saved
    offset, ref = where["e"]
    holder = torch.zeros(1, 5)
    out = holder[:, 0].view(-1)
    assert out.is_contiguous() and out.stride() == (5,)
    with RangeReader(read_threads=4, split_bytes=MiB) as reader:
        reader.read_runs([(path, offset, out)])
    assert torch.equal(holder[0, 0:1], ref[:1])


def _slow_helpers(monkeypatch, main_hook):
    """The pool's pieces take 50 ms each; ``main_hook()`` runs on the main thread's pieces
    once every helper holds one. Returns (pieces read, pieces being read now)."""
    active, read = [0], []
    lock = threading.Lock()
    real = RangeReader._pread

    def spy(self, path, offset, out, sink=None, split=True):
        with lock:
            active[0] += 1
        try:
            if threading.current_thread() is threading.main_thread():
                deadline = time.monotonic() + 5
                while active[0] < 4 and time.monotonic() < deadline:
                    time.sleep(0.001)
                main_hook()
            else:
                time.sleep(0.05)
            read.append(offset)
            return real(self, path, offset, out, sink, split)
        finally:
            with lock:
                active[0] -= 1

    monkeypatch.setattr(RangeReader, "_pread", spy)
    return read, active


def test_an_interrupt_stops_the_read_once_every_started_piece_has_finished(saved, monkeypatch):
    runs, _ = _runs(saved, seed=3)

    def interrupt():
        raise KeyboardInterrupt  # as check_signals raises it on the main thread

    read, active = _slow_helpers(monkeypatch, interrupt)
    with RangeReader(read_threads=4, split_bytes=MiB) as reader:
        with pytest.raises(KeyboardInterrupt):
            reader.read_runs(runs)
        assert active[0] == 0, "a piece was still being read when the interrupt was raised"
        # each of the pool's 3 threads finishes the piece it holds and takes no other
        assert len(read) <= 3 < len(reader._ordered_pieces(runs)), read


def test_a_progress_callback_that_raises_stops_the_read_too(saved, monkeypatch):
    runs, _ = _runs(saved, seed=4)
    read, active = _slow_helpers(monkeypatch, lambda: None)

    def progress(nbytes):
        raise RuntimeError("the bar broke")

    with RangeReader(read_threads=4, split_bytes=MiB) as reader:
        with pytest.raises(RuntimeError, match="the bar broke"):
            reader.read_runs(runs, progress)
        assert active[0] == 0, "a piece was still being read when the error was raised"
        # the main thread's piece, then the piece each helper held
        assert len(read) <= 4 < len(reader._ordered_pieces(runs)), read


def test_a_file_cut_short_and_a_run_outside_its_record_are_refused(saved, tmp_path):
    path, where = saved
    short = tmp_path / "short.pt"
    shutil.copyfile(path, short)
    offset, ref = where["d"]
    with open(short, "r+b") as f:
        f.truncate(offset + 4 * (ref.numel() // 2))
    with RangeReader(read_threads=4, split_bytes=MiB) as reader:
        with pytest.raises(CheckpointLayoutError, match="truncated"):
            reader.read_runs([(str(short), offset, torch.empty(ref.numel()))])
    a_off, a = where["a"]
    with RangeReader(read_threads=4, split_bytes=MiB) as reader:
        with pytest.raises(CheckpointLayoutError, match="do not lie inside one tensor record"):
            reader.read_runs([(path, a_off, torch.empty(a.numel() + 64))])


def test_a_load_reads_its_plain_tensors_as_one_list_of_runs(saved, monkeypatch):
    """load_state_dict of a plain file: every byte of the model through one read_runs call
    (the tensors stored as the model wants them), and the weights torch.load gives."""
    path, where = saved
    calls, real = [], RangeReader.read_runs

    def spy(self, runs, progress=None):
        calls.append(sum(out.numel() * out.element_size() for *_, out in runs))
        return real(self, runs, progress)

    monkeypatch.setattr(RangeReader, "read_runs", spy)
    monkeypatch.setenv("METASEQ_ONELOAD_READ_THREADS", "4")  # 10 MiB: read serially by default
    got = mo.load_state_dict(path, no_dist=True)
    assert calls == [sum(ref.numel() * 4 for _, ref in where.values())], calls
    for k, (_, ref) in where.items():
        assert torch.equal(got[k], ref)
