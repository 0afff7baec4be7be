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
    return sorted(p for p in os.listdir(folder) if p.startswith(".") and ".tmp-" in p)


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
