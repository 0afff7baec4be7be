"""Conversion safety: an error or a `kill -9` part-way leaves no file at any final name,
temporary files are cleaned (now, or by the next run), memory stays bounded."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench._synth import metaseq_lm, write_metaseq
from metaseq_oneload._convert import convert, verify

REPO = Path(__file__).resolve().parents[2]
# ~120 MiB of fp32 weights: long enough to write that a kill lands part-way.
BIG = dict(layers=4, dim=768, ffn=3072, vocab=4096, positions=512)


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> str:
    prefix = tmp_path_factory.mktemp("big") / "checkpoint_7"
    write_metaseq(str(prefix), metaseq_lm(**BIG), shards=2, optimizer=False)
    return str(prefix) + ".pt"


def _finals(folder: Path) -> list:
    return sorted(p for p in os.listdir(folder) if not p.startswith("."))


def _temps(folder: Path) -> list:
    return sorted(p for p in os.listdir(folder) if p.startswith(".") and ".oneload-tmp" in p)


def _python(code: str, **kw) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **kw)


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_an_error_part_way_removes_every_temporary_file(tmp_path, big, exc):
    calls = []

    def hook(nbytes, tensors):
        calls.append(nbytes)
        if len(calls) == 3:
            raise exc("stop here")

    with pytest.raises(exc, match="stop here"):
        convert(big, tmp_path / "out" / "ck", shards=3, chunk_mb=1, progress=hook)
    assert _finals(tmp_path / "out") == [] and _temps(tmp_path / "out") == []


def test_kill_9_while_writing_leaves_no_final_file(tmp_path, big):
    out = tmp_path / "out"
    marker = tmp_path / "stalled"
    code = f"""
import os, time
from metaseq_oneload._convert import convert
written = [0]
def hook(nbytes, tensors):
    written[0] += nbytes
    # Part-way: the first file is being written, others are waiting.
    if written[0] > (8 << 20) and not os.path.exists({str(marker)!r}):
        open({str(marker)!r}, "w").close()
        time.sleep(600)
convert({big!r}, {str(out / "ck")!r}, model_parallel=2, shards=2, chunk_mb=1, jobs=2, progress=hook)
"""
    p = _python(code)
    try:
        deadline = time.time() + 120
        while not marker.exists():
            assert p.poll() is None, p.communicate()
            assert time.time() < deadline, "the conversion never got part-way"
            time.sleep(0.02)
        assert p.poll() is None
        os.kill(p.pid, signal.SIGKILL)
        p.wait(30)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == -signal.SIGKILL
    assert _finals(out) == []  # no file at any final name
    stale = _temps(out)
    assert stale  # it was killed while writing
    # The next conversion to the same names removes the dead process's temporary files.
    r = convert(big, out / "ck", model_parallel=2, shards=2, chunk_mb=4)
    assert sorted(os.path.basename(x) for x in r.removed) == stale
    assert _temps(out) == [] and len(_finals(out)) == 4
    assert verify(r.files[0], big, atol=0, rtol=0).identical


def test_kill_9_of_the_cli_at_the_first_temporary_file(tmp_path, big):
    out = tmp_path / "out"
    out.mkdir()
    p = subprocess.Popen([sys.executable, "-m", "metaseq_oneload", "convert", big, str(out / "ck"),
                          "--shards", "3", "--chunk-mb", "1", "--jobs", "1"],
                         env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 120
        while not _temps(out):
            assert p.poll() is None, p.communicate()
            assert time.time() < deadline
            time.sleep(0.002)
        assert p.poll() is None, "finished before the kill: make BIG bigger"
        os.kill(p.pid, signal.SIGKILL)
        p.wait(30)
    finally:
        if p.poll() is None:
            p.kill()
    assert _finals(out) == []


def test_memory_stays_bounded(tmp_path, big):
    """Peak RSS added by a conversion is a few chunks, not the ~120 MiB model (loading
    every shard, as metaseq's scripts do, adds at least the model twice)."""
    code = f"""
import json
import metaseq_oneload, torch
from metaseq_oneload._convert import convert
def rss(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
open("/proc/self/clear_refs", "w").write("5")
start = rss("VmRSS")
convert({big!r}, {str(tmp_path / "ck")!r}, shards=3, chunk_mb=4, jobs=1, progress=False)
print(json.dumps({{"added": rss("VmHWM") - start}}))
"""
    p = _python(code)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    added = json.loads(out.strip().splitlines()[-1])["added"]
    model = sum(t.numel for t in metaseq_lm(**BIG).values()) * 4
    assert added < 48 << 20, f"conversion added {added >> 20} MiB of RSS for a {model >> 20} MiB model"


# --------------------------------------------------------------------------- temporary names


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_stale_temporaries_of_this_host_only(tmp_path):
    """On shared storage another host's temporary files may belong to a live writer: only
    this host's, of a dead pid, are removed (files and export-hf's folders alike)."""
    from metaseq_oneload import _writing

    host, dead = _writing._host(), _dead_pid()
    final = tmp_path / "ck.pt"
    mine_dead = tmp_path / f".ck.pt.oneload-tmp+{host}+{dead}+0a1b2c3d"
    mine_dead_folder = tmp_path / f".ck.pt.oneload-tmp-{host}-{dead}"  # export-hf's earlier form
    other_host = tmp_path / f".ck.pt.oneload-tmp+{host}x+{dead}+0a1b2c3d"
    other_host2 = tmp_path / f".ck.pt.oneload-tmp+{host}-1+{dead}+0a1b2c3d"  # node-1 is not node
    other_host3 = tmp_path / f".ck.pt.oneload-tmp-{host}-1-{dead}"
    mine_alive = tmp_path / f".ck.pt.oneload-tmp+{host}+{os.getppid()}+0a1b2c3d"
    legacy = tmp_path / f".ck.pt.tmp-{dead}"  # older name without a host: cannot be attributed
    for p in (mine_dead, other_host, other_host2, other_host3, mine_alive, legacy):
        p.write_bytes(b"x")
    mine_dead_folder.mkdir()
    (mine_dead_folder / "model.safetensors").write_bytes(b"x")
    assert _writing.stale_temps(final) == sorted([str(mine_dead), str(mine_dead_folder)])
    assert sorted(_writing.remove_stale_temps(final)) == sorted([str(mine_dead), str(mine_dead_folder)])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        p.name for p in (other_host, other_host2, other_host3, mine_alive, legacy))
    # OutputSet.clean_stale is the same rule.
    mine_dead.write_bytes(b"x")
    out = _writing.OutputSet([str(final)], overwrite=False)
    assert out.clean_stale() == [str(mine_dead)]


def test_temporary_files_are_created_exclusively(tmp_path, monkeypatch):
    """A temporary name is never one that exists, a planted link included: it is created
    with O_EXCL | O_NOFOLLOW, and a random tail makes it unpredictable."""
    from metaseq_oneload import _writing

    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    tails = iter(["aaaaaaaa", "bbbbbbbb"])
    monkeypatch.setattr(_writing.secrets, "token_hex", lambda n: next(tails))
    planted = tmp_path / f".ck.pt.oneload-tmp+{_writing._host()}+{os.getpid()}+aaaaaaaa"
    os.symlink(victim, planted)
    tmp = _writing.make_temp(str(tmp_path / "ck.pt"))
    assert tmp.endswith("+bbbbbbbb") and os.path.isfile(tmp) and not os.path.islink(tmp)
    assert victim.read_bytes() == b"precious"
    old = os.umask(0o022)
    os.umask(old)
    assert os.stat(tmp).st_mode & 0o777 == 0o666 & ~old  # as any new file, not mkstemp's 0600


def test_write_torch_never_writes_through_a_link(tmp_path):
    import torch

    from metaseq_oneload._writing import write_torch

    victim = tmp_path / "victim.pt"
    victim.write_bytes(b"precious")
    os.symlink(victim, tmp_path / "out.pt")
    with pytest.raises(OSError):
        write_torch(str(tmp_path / "out.pt"), {"w": torch.zeros(4)}, {}, None, chunk_bytes=1 << 16)
    assert victim.read_bytes() == b"precious"


class _NotAllowlisted:
    """A class no checkpoint carries."""


def test_write_torch_reads_its_header_back_with_the_allowlist(tmp_path):
    import torch

    from metaseq_oneload import UnsafeCheckpointError
    from metaseq_oneload._writing import write_torch

    obj = {"w": torch.arange(4.0), "odd": _NotAllowlisted()}
    with pytest.raises(UnsafeCheckpointError, match="outside the checkpoint allowlist"):
        write_torch(str(tmp_path / "a.pt"), obj, {}, None, chunk_bytes=1 << 16)
    # The caller that unpickled its source with trust_pickle=True may write what it read.
    write_torch(str(tmp_path / "b.pt"), obj, {}, None, chunk_bytes=1 << 16, trust_pickle=True)
    assert torch.equal(torch.load(tmp_path / "b.pt", weights_only=False)["w"], torch.arange(4.0))
