"""With ``METASEQ_ONELOAD_O_DIRECT=auto`` (the default), a load with one process chooses, per
piece, how to read a local file from what the page cache holds (#26): pieces the cache lacks
with O_DIRECT straight into the destination, pieces it holds through ``preadv``; 1 reads every
piece with O_DIRECT, 0 none; a reader that is not its files' only reader never chooses
O_DIRECT (a node's ranks share what the cache holds). Real files from torch.save, torch's own load as the
reference; which path read what is watched (``_pread_full`` wrapped, never replaced), and
"cold" is ``posix_fadvise(DONTNEED)`` after an fsync, checked with ``mincore`` before use."""

from __future__ import annotations

import os
import threading

import pytest
import torch

import metaseq_oneload as mo
from metaseq_oneload import _reading
from metaseq_oneload._nodes import LOCAL_SIZES
from metaseq_oneload._pagecache import Residency
from metaseq_oneload._reading import Extent, RangeReader, key_path, read_header, storage_byte_offset
from metaseq_oneload._settings import Settings

MiB = 1 << 20
BIG = 12 * MiB // 4  # elements: a load's reads of it are pieces of 1 MiB or more


@pytest.fixture(autouse=True)
def no_launcher(monkeypatch):
    """As a process started by hand: a launcher's variables would make it not alone."""
    for var in LOCAL_SIZES + ("WORLD_SIZE",):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("auto") / "ck.pt"
    g = torch.Generator().manual_seed(5)
    sd = {"big": torch.rand(BIG, generator=g), "bias": torch.rand(33, generator=g)}
    torch.save({"model": sd}, path)
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
    except (OSError, AttributeError):
        pytest.skip("this filesystem refuses O_DIRECT (tmpfs?): nothing to choose")
    return str(path), sd


def _cold(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        r = Residency()
        try:
            held = r.held(path, fd, 0, os.fstat(fd).st_size)
            if held is None:
                pytest.skip("mincore does not tell this process of the file: no cold state to test")
            if held > 0.1:
                pytest.skip("the kernel kept the file's pages after DONTNEED: no cold state to test")
        finally:
            r.close()
    finally:
        os.close(fd)


def _warm(path: str) -> None:
    with open(path, "rb") as f:
        while f.read(8 * MiB):
            pass


@pytest.fixture
def watch(monkeypatch):
    """The file offsets and lengths each kind of read covered while a test runs."""
    seen = {"direct": [], "plain": []}
    real = _reading._pread_full

    def counted(fd, offset, view, block=0):
        seen["direct" if block else "plain"].append((offset, len(view)))
        return real(fd, offset, view, block)

    monkeypatch.setattr(_reading, "_pread_full", counted)
    return seen


def _direct_bytes(seen) -> int:
    return sum(n for _, n in seen["direct"])


def _equal(got, sd) -> None:
    assert set(got) == set(sd)
    for k, v in sd.items():
        assert torch.equal(got[k].view(torch.int32), v.view(torch.int32)), k


def test_a_cold_file_is_read_with_o_direct_by_a_one_process_load(saved, watch, monkeypatch):
    monkeypatch.setenv("METASEQ_ONELOAD_O_DIRECT", "auto")
    path, sd = saved
    _cold(path)
    _equal(mo.load_state_dict(path, no_dist=True), sd)
    # all of the big tensor but the few bytes before and after its 512-byte aligned middle
    assert _direct_bytes(watch) >= BIG * 4 - 1024


def test_a_warm_file_is_read_through_the_cache(saved, watch, monkeypatch):
    monkeypatch.setenv("METASEQ_ONELOAD_O_DIRECT", "auto")
    path, sd = saved
    _warm(path)
    _equal(mo.load_state_dict(path, no_dist=True), sd)
    assert watch["direct"] == []


def test_only_the_pieces_the_cache_lacks_are_read_with_o_direct(saved, watch, monkeypatch):
    monkeypatch.setenv("METASEQ_ONELOAD_O_DIRECT", "auto")
    path, sd = saved
    meta = read_header(path)["model"]["big"]
    start = storage_byte_offset(meta)
    _cold(path)
    half = start + BIG * 2 // MiB * MiB  # the first half of the tensor's bytes, from a MiB boundary
    fd = os.open(path, os.O_RDONLY)
    try:  # the cache now holds the file up to ``half`` (no read-ahead past it)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        os.pread(fd, half, 0)
        r = Residency()
        try:
            assert r.held(path, fd, 0, half) == 1.0 and r.held(path, fd, half, BIG * 4 + start - half) < 0.1
        finally:
            r.close()
    finally:
        os.close(fd)
    out = torch.empty(BIG)
    with RangeReader(read_threads=4, split_bytes=2 * MiB, alone=True) as reader:
        reader.read_extent(Extent(path, key_path("model", "big"), 0, BIG, start), 0, out, torch.float32)
    assert torch.equal(out.view(torch.int32), sd["big"].view(torch.int32))
    assert watch["direct"], "the cold half was read through the cache"
    assert all(o >= half - 2 * MiB for o, _ in watch["direct"]), "a piece the cache held was read with O_DIRECT"
    assert _direct_bytes(watch) >= (start + BIG * 4 - half) - 4 * MiB


@pytest.mark.parametrize("value", ["0", "1", None])
def test_the_variable_set_decides_alone_and_unset_is_auto(saved, watch, monkeypatch, value):
    if value is None:
        monkeypatch.delenv("METASEQ_ONELOAD_O_DIRECT", raising=False)
    else:
        monkeypatch.setenv("METASEQ_ONELOAD_O_DIRECT", value)
    path, sd = saved
    if value == "1":
        _warm(path)  # warm, yet with O_DIRECT
    else:
        _cold(path)  # cold: through the cache with 0, straight into the destination unset
    _equal(mo.load_state_dict(path, no_dist=True), sd)
    assert (_direct_bytes(watch) > 0) == (value != "0")
    if value is None:
        assert _direct_bytes(watch) >= BIG * 4 - 1024


@pytest.mark.parametrize("var,value", [("LOCAL_WORLD_SIZE", "2"), ("SLURM_NTASKS_PER_NODE", "4(x2)"),
                                       ("LOCAL_SIZE", "8"), ("SLURM_STEP_TASKS_PER_NODE", "8"),
                                       ("HOROVOD_LOCAL_SIZE", "2"), ("WORLD_SIZE", "4")])
def test_a_process_a_launcher_started_beside_others_reads_through_the_shared_cache(saved, watch, monkeypatch,
                                                                                   var, value):
    # each process of such a launch may load the same file alone (no_dist=True): O_DIRECT
    # would make every one of them read it from the device
    monkeypatch.setenv("METASEQ_ONELOAD_O_DIRECT", "auto")
    monkeypatch.setenv(var, value)
    path, sd = saved
    _cold(path)
    _equal(mo.load_state_dict(path, no_dist=True), sd)
    assert watch["direct"] == []


def test_a_reader_that_is_not_its_files_only_reader_never_chooses_o_direct(saved, watch, monkeypatch):
    monkeypatch.setenv("METASEQ_ONELOAD_O_DIRECT", "auto")
    path, sd = saved
    meta = read_header(path)["model"]["big"]
    _cold(path)
    out = torch.empty(BIG)
    with RangeReader(read_threads=4, split_bytes=2 * MiB) as reader:  # alone=False: a rank among others
        reader.read_extent(Extent(path, key_path("model", "big"), 0, BIG, storage_byte_offset(meta)), 0, out,
                           torch.float32)
    assert torch.equal(out.view(torch.int32), sd["big"].view(torch.int32))
    assert watch["direct"] == []


def test_the_probe_tells_cold_from_warm_without_touching_the_pages_and_unmaps_them(saved):
    path, _ = saved
    size = os.path.getsize(path)
    _cold(path)
    fd = os.open(path, os.O_RDONLY)
    r = Residency()
    try:
        assert r.held(path, fd, 0, size) < 0.1
        assert r.held(path, fd, 0, size) < 0.1  # asking faulted nothing in
        _warm(path)
        assert r.held(path, fd, 0, size) == 1.0
        assert r.held(path, fd, size, 0) == 1.0  # nothing asked: nothing to read from the device
    finally:
        r.close()
        os.close(fd)
    with open("/proc/self/maps") as f:
        assert path not in f.read()  # nothing left in the address space


def test_the_probe_of_a_large_range_asks_of_a_sample_of_its_pages_and_tells_its_share(saved, monkeypatch):
    """mincore walks the page cache a page at a time (0.3 ms per 16 MiB piece here, a tenth of
    a warm 0.27 GiB load): a range of many pages is asked of in 16 windows of 16 pages. The
    file is cold, then every other 512 KiB is read with read-ahead off; the share told is the
    true one within 0.2, and no more than 256 pages were asked of."""
    from metaseq_oneload import _pagecache

    path, _ = saved
    size = os.path.getsize(path)
    _cold(path)
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    run = 512 << 10
    for at in range(0, size, 2 * run):
        os.pread(fd, run, at)
    truth = sum(min(run, size - at) for at in range(0, size, 2 * run)) / size
    real, asked = _pagecache._LIBC, []

    class Counting:  # the C library as it is, with mincore's ranges noted
        def __getattr__(self, name):
            return getattr(real, name)

        def mincore(self, addr, length, vec):
            asked.append(length)
            return real.mincore(addr, length, vec)

    monkeypatch.setattr(_pagecache, "_LIBC", Counting())
    r = Residency()
    try:
        share = r.held(path, fd, 0, size)
    finally:
        r.close()
        os.close(fd)
    assert share is not None and abs(share - truth) < 0.2, (share, truth)
    assert 0 < sum(-(-n // _pagecache._PAGE) for n in asked) <= 256, asked


def test_a_cache_that_holds_only_the_sampled_pages_misleads_the_choice_not_the_bytes(saved, watch):
    """The sample is trusted: a cold file whose cache holds exactly the probe's windows (what
    a crafted reader elsewhere could arrange) is told as held and read through the cache, a
    slower read of the right bytes, never wrong ones."""
    from metaseq_oneload import _pagecache

    path, sd = saved
    start = storage_byte_offset(read_header(path)["model"]["big"])
    page, n = _pagecache._PAGE, BIG * 4
    a = start // page * page
    pages = -(-(start + n - a) // page)
    gap = (pages - _pagecache._WINDOW) // (_pagecache._WINDOWS - 1)
    firsts = [a + i * gap * page for i in range(_pagecache._WINDOWS - 1)] + [a + (pages - _pagecache._WINDOW) * page]
    _cold(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        for at in firsts:
            os.pread(fd, _pagecache._WINDOW * page, at)
        r = Residency()
        try:
            assert r.held(path, fd, start, n) == 1.0  # misled: about 1 page in 12 is held
        finally:
            r.close()
    finally:
        os.close(fd)
    out = torch.empty(BIG)
    with RangeReader(read_threads=1, alone=True) as reader:
        reader.read_extent(Extent(path, key_path("model", "big"), 0, BIG, start), 0, out, torch.float32)
    assert torch.equal(out.view(torch.int32), sd["big"].view(torch.int32))
    assert watch["direct"] == []


def test_a_process_with_a_limited_address_space_maps_nothing_and_reads_through_the_cache(saved, tmp_path):
    # (a child: the limit cannot be lifted again in this process)
    import subprocess
    import sys

    path, _ = saved
    _cold(path)
    code = ("import os, resource, sys\n"
            "resource.setrlimit(resource.RLIMIT_AS, (64 << 30, resource.RLIM_INFINITY))\n"
            "from metaseq_oneload._pagecache import Residency\n"
            "fd = os.open(sys.argv[1], os.O_RDONLY)\n"
            "r = Residency()\n"
            "print(r.held(sys.argv[1], fd, 0, os.fstat(fd).st_size))\n"
            "print(sys.argv[1] in open('/proc/self/maps').read())\n")
    out = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["None", "False"]


_AS_ANOTHER_USER = """
import os, sys
import torch
from metaseq_oneload._pagecache import Residency
from metaseq_oneload._reading import RangeReader, read_header, storage_byte_offset
from metaseq_oneload._settings import Settings
path = sys.argv[1]
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
fd = os.open(path, os.O_RDONLY)
r = Residency()
print(r.held(path, fd, 0, os.fstat(fd).st_size))
r.close()
run = (path, storage_byte_offset(read_header(path)["model"]["big"]), torch.empty(int(sys.argv[2])))
with RangeReader(alone=True, settings=Settings(o_direct=None)) as reader:
    print(reader._threads_for(reader._ordered_pieces([run])) == reader.read_threads)
"""


def test_a_file_mincore_will_not_tell_of_is_not_known_and_keeps_every_thread(saved):
    # Linux tells mincore's truth only to a process that owns the file or could write it; to
    # any other it says every page is resident, which must not read as "warm" (fewer threads
    # for what is in fact a read from the device)
    import shutil
    import subprocess
    import sys
    import tempfile

    if not hasattr(os, "geteuid") or os.geteuid() != 0 or not hasattr(os, "sched_setaffinity"):
        pytest.skip("needs root, to read a file as a user that neither owns it nor may write it")
    folder = tempfile.mkdtemp(dir="/tmp")
    try:
        os.chmod(folder, 0o755)
        path = os.path.join(folder, "ck.pt")
        shutil.copyfile(saved[0], path)
        os.chmod(path, 0o644)
        _cold(path)
        try:
            out = subprocess.run([sys.executable, "-c", _AS_ANOTHER_USER, path, str(BIG)], capture_output=True,
                                 text=True, timeout=120, user=65534, group=65534, extra_groups=[], cwd=folder)
        except PermissionError as e:  # (an interpreter under /root, say)
            pytest.skip(f"user 65534 cannot run this interpreter here: {e}")
        if out.returncode and "Permission denied" in out.stderr:
            pytest.skip(f"user 65534 cannot import the package here: {out.stderr.strip()[-200:]}")
        assert out.returncode == 0, out.stderr[-3000:]
        assert out.stdout.split() == ["None", "True"]
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def one_cpu():
    """This thread (a reader's caller) may run on one CPU only, whatever the machine has."""
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no CPU affinity on this platform")
    # torch's own threads start here first, else one started while pinned would stay pinned
    torch.ones(1 << 22).sum()
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(before)})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _big_run(path: str) -> tuple:
    return path, storage_byte_offset(read_header(path)["model"]["big"]), torch.empty(BIG)


@pytest.mark.parametrize("state", ["warm", "cold"])
def test_a_lone_reader_of_cached_bytes_uses_no_more_threads_than_cpus(saved, one_cpu, state):
    # read from the cache a piece is a copy, the CPU's work; from the device it is a wait,
    # where more requests in flight help
    path, sd = saved
    _warm(path) if state == "warm" else _cold(path)
    with RangeReader(alone=True, settings=Settings(o_direct=None)) as reader:
        assert reader.read_threads == _reading.DEFAULT_READ_THREADS > 1
        jobs = reader._ordered_pieces([_big_run(path)])
        assert len(jobs) > 1
        assert reader._threads_for(jobs) == (1 if state == "warm" else reader.read_threads)


@pytest.mark.parametrize("how", ["asked", "not alone", "through the cache"])
def test_a_count_asked_for_or_a_reader_that_does_not_choose_keeps_its_threads(saved, one_cpu, how):
    path, _ = saved
    _warm(path)
    kwargs = {"asked": dict(alone=True, read_threads=4, settings=Settings(o_direct=None)),
              "not alone": dict(alone=False, settings=Settings(o_direct=None)),
              "through the cache": dict(alone=True, settings=Settings(o_direct=False))}[how]
    with RangeReader(**kwargs) as reader:
        jobs = reader._ordered_pieces([_big_run(path)])
        assert reader._threads_for(jobs) == reader.read_threads > 1


def _quarter_pieces(run: tuple) -> list:
    """The run as 48 jobs of 256 KiB in file order (more than the thread count samples)."""
    path, offset, out = run
    raw, k = out.view(torch.uint8), 256 * 1024
    return [(path, offset + a, raw[a:a + k]) for a in range(0, raw.numel(), k)]


@pytest.mark.parametrize("held", [0.25, 0.75])
def test_the_thread_count_asks_the_cache_of_a_sample_of_the_pieces(saved, one_cpu, monkeypatch, held):
    # a probe per piece, before any read starts, took 10 ms over 2 GiB: at most 16 pieces,
    # evenly spaced, still tell a file three quarters cached from one a quarter cached
    from metaseq_oneload import _pagecache

    path, _ = saved
    run = _big_run(path)
    jobs = _quarter_pieces(run)
    n = len(jobs) * 256 * 1024
    _cold(path)
    # the whole file read, then all past the held share dropped: a read of the share alone
    # left the rest to read-ahead, which on a disk set to 8 MiB of it cached past half. Cut
    # at 2 MiB in the file: DONTNEED keeps a cached folio (up to 2 MiB, built by read-ahead)
    # that straddles the cut, which would move the share by a window's worth
    _warm(path)
    cached = (run[1] + int(held * n)) // (2 * MiB) * (2 * MiB)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, cached, 0, os.POSIX_FADV_DONTNEED)
        r = Residency()
        try:  # every page of the run asked
            told = r.held(path, fd, run[1], n, windows=-(-n // (_pagecache._WINDOW * _pagecache._PAGE)))
        finally:
            r.close()
    finally:
        os.close(fd)
    if told is None or (told > 0.5) != (held > 0.5) or abs(told - 0.5) < 0.1:
        pytest.skip(f"the cache holds {told} of the run, not a share on the side of half this case needs")
    asked = []
    real = Residency.held

    def counted(self, path, fd, offset, *args, **kwargs):
        asked.append(offset)
        return real(self, path, fd, offset, *args, **kwargs)

    monkeypatch.setattr(Residency, "held", counted)
    with RangeReader(alone=True, settings=Settings(o_direct=None)) as reader:
        assert len(jobs) == 48 > _reading._SAMPLED_PIECES
        assert reader._threads_for(jobs) == (1 if held > 0.5 else reader.read_threads)
    assert 0 < len(asked) <= _reading._SAMPLED_PIECES
    assert asked[0] == jobs[0][1] and max(asked) > jobs[len(jobs) * 3 // 4][1]  # spread over the file


def _reading_threads(monkeypatch) -> set:
    """The threads that read from now on (``_pread_full`` wrapped, never replaced)."""
    threads = set()
    real = _reading._pread_full

    def on_thread(fd, offset, view, block=0):
        threads.add(threading.get_ident())
        return real(fd, offset, view, block)

    monkeypatch.setattr(_reading, "_pread_full", on_thread)
    return threads


def test_a_warm_lone_read_on_one_cpu_is_read_on_the_calling_thread(saved, one_cpu, monkeypatch):
    path, sd = saved
    _warm(path)
    threads = _reading_threads(monkeypatch)
    run = _big_run(path)
    with RangeReader(alone=True, settings=Settings(o_direct=None)) as reader:
        reader.read_runs([run])
    assert torch.equal(run[2].view(torch.int32), sd["big"].view(torch.int32))
    assert threads == {threading.get_ident()}


def test_a_reader_that_cannot_tell_what_the_cache_holds_reads_as_without_a_probe(saved, one_cpu, watch,
                                                                                  monkeypatch):
    # as where the kernel will not tell (the test above, where it can run as another user):
    # no O_DIRECT chosen and every thread kept, as a reader without a probe reads
    from metaseq_oneload import _pagecache

    path, sd = saved
    _cold(path)
    monkeypatch.setattr(_pagecache, "_tells", lambda fd, st: False)
    run = _big_run(path)
    with RangeReader(alone=True, settings=Settings(o_direct=None)) as reader:
        assert reader._residency.held(path, reader._fd(path), 0, 1 << 20) is None
        assert reader._threads_for(reader._ordered_pieces([run])) == reader.read_threads > 1
        reader.read_runs([run])
    assert torch.equal(run[2].view(torch.int32), sd["big"].view(torch.int32))
    assert watch["direct"] == []


@pytest.mark.parametrize("env,alone", [
    ({}, True),
    ({"WORLD_SIZE": "1"}, True),
    ({"WORLD_SIZE": " 8 "}, False),
    ({"LOCAL_WORLD_SIZE": "1", "WORLD_SIZE": "8"}, True),  # torchrun, one process per node
    ({"SLURM_TASKS_PER_NODE": "1", "WORLD_SIZE": "4"}, False),  # an allocation's 1 says nothing of a spawn
    ({"SLURM_NTASKS_PER_NODE": "1(x2),3"}, False),  # uneven nodes: the text is every node's
    ({"SLURM_STEP_TASKS_PER_NODE": "1(x2)"}, True),
    ({"LOCAL_SIZE": "8"}, False),
    ({"PMI_LOCAL_SIZE": "2"}, False),
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "many"}, False),  # not a count: as if several
])
def test_which_launches_count_as_alone(monkeypatch, env, alone):
    from metaseq_oneload._nodes import launched_alone

    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert launched_alone() is alone


def test_a_cache_that_holds_only_the_thread_counts_sample_misleads_the_count_not_the_bytes(saved, one_cpu, watch,
                                                                                          monkeypatch):
    """The thread count's sample is trusted too: a cold file whose cache holds exactly the
    pages that count asks (the two ends of each sampled piece, which a crafted reader elsewhere
    could arrange) is read with the warm count, on the calling thread here: a slower read of the
    right bytes, never wrong ones; each piece's own choice, asked in more windows, still reads
    what the cache lacks with O_DIRECT."""
    from metaseq_oneload import _pagecache

    path, sd = saved
    page, window = _pagecache._PAGE, _pagecache._WINDOW
    run = _big_run(path)
    _cold(path)
    with RangeReader(alone=True, settings=Settings(o_direct=None)) as reader:
        jobs = reader._ordered_pieces([run])
        step = max(1, -(-len(jobs) // _reading._SAMPLED_PIECES))
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            # most sampled pieces larger than the two windows asked of each: else (64 KiB pages,
            # say) the sample is the whole and there is nothing to mislead
            if sum(v.numel() * v.element_size() > 4 * window * page for _, _, v, *_ in jobs[::step]) < 4:
                pytest.skip("the pieces are too few pages for their two ends to differ from the whole")
            for _, offset, view, *_ in jobs[::step]:  # each sampled piece's first and last window
                a = offset // page * page
                pages = -(-(offset + view.numel() * view.element_size() - a) // page)
                if pages <= 2 * window:  # (the run's last bytes, say) asked whole
                    os.pread(fd, pages * page, a)
                    continue
                os.pread(fd, window * page, a)
                os.pread(fd, window * page, a + (pages - window) * page)
            r = Residency()
            try:  # what the sample is told (reads a file system does not cache leave it cold), and the truth
                sample = {r.held(path, fd, o, v.numel() * v.element_size(), windows=2) for _, o, v, *_ in jobs[::step]}
                told = r.held(path, fd, run[1], BIG * 4, windows=-(-BIG * 4 // (window * page)))
            finally:
                r.close()
        finally:
            os.close(fd)
        if sample != {1.0}:
            pytest.skip(f"the sampled pages are not all cached after reading them ({sample}): nothing to mislead")
        if told is None or told > 0.4:
            pytest.skip(f"the cache holds {told} of the run after reading the sample alone: no cold file to test")
        assert reader._threads_for(jobs) == 1  # misled: the warm count, for a file mostly not held
        threads = _reading_threads(monkeypatch)
        reader.read_runs([run])
    assert torch.equal(run[2].view(torch.int32), sd["big"].view(torch.int32))
    assert threads == {threading.get_ident()}
    assert _direct_bytes(watch) > BIG * 4 // 2
