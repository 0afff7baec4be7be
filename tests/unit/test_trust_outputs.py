"""Issue 21, class 3: files we create next to the user's files. Whatever is planted at a
name we write (a link to a user's file, a hard link to one, a FIFO), no user file is
written, truncated or blocked on; a failed write leaves no side file; a commit cut short
by a real kill is refused at load with what happened and how to recover."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import metaseq_oneload as mo
from metaseq_oneload import OneloadError
from tests.conftest import FIXTURES, needs_fixtures

pytestmark = needs_fixtures
REPO = Path(__file__).resolve().parents[2]
SRC = FIXTURES / "fsdp_dp3"
PRECIOUS = b"the user's own file, not ours\n" * 100


@pytest.fixture(autouse=True)
def _own_key(tmp_path, monkeypatch):
    monkeypatch.setenv("METASEQ_ONELOAD_INDEX_KEY", str(tmp_path / "keys" / "index-key"))


@pytest.fixture
def victim(tmp_path) -> Path:
    p = tmp_path / "victim.txt"
    p.write_bytes(PRECIOUS)
    return p


def _side_files(folder: Path) -> list:
    return sorted(n for n in os.listdir(folder) if n.startswith(".") or ".tmp" in n)


def _python(code: str, env: dict, timeout: float) -> tuple:
    """(returncode or None if it had to be killed, stdout, stderr, seconds)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **env)
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
        return p.returncode, out, err, time.perf_counter() - t0
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        return None, out, err, time.perf_counter() - t0


# --------------------------------------------------------------------------- the index's temporary name


def _old_index_temp(out: Path) -> Path:
    """The index's temporary name before this fix: predictable from the pid."""
    return out / f"ck.oneload-index.json.tmp-{os.getpid()}"


@pytest.mark.parametrize("plant", ["symlink", "hardlink"])
def test_a_link_planted_at_the_index_temporary_name_never_reaches_the_users_file(tmp_path, victim, plant):
    out = tmp_path / "out"
    out.mkdir()
    (os.symlink if plant == "symlink" else os.link)(victim, _old_index_temp(out))
    report = mo.convert(SRC, out / "ck", shards=2, progress=False)
    assert victim.read_bytes() == PRECIOUS
    assert (out / "ck.oneload-index.json").is_file() and not any("no index" in n for n in report.notes)
    assert mo.inspect(out).index == str(out / "ck.oneload-index.json")


def test_a_fifo_planted_at_the_index_temporary_name_does_not_hang_convert(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    code = f"""
import os, metaseq_oneload as mo
os.mkfifo(os.path.join({str(out)!r}, f"ck.oneload-index.json.tmp-{{os.getpid()}}"))
r = mo.convert({str(SRC)!r}, {str(out / 'ck')!r}, shards=2, progress=False)
print("done", [n for n in r.notes if "index" in n])
"""
    rc, stdout, stderr, seconds = _python(code, {"METASEQ_ONELOAD_INDEX_KEY": str(tmp_path / "k")}, timeout=90)
    assert rc == 0, f"convert did not finish in {seconds:.0f} s (rc {rc}): {stderr[-2000:]}"
    assert "done []" in stdout
    rest = sorted(n for n in os.listdir(out) if not n.startswith("ck-"))
    assert rest[0] == "ck.oneload-index.json" and len(rest) == 2 and rest[1].startswith("ck.oneload-index.json.tmp-")
    assert Path(out / rest[1]).is_fifo()  # the plant, left as it was


# --------------------------------------------------------------------------- the lock


@pytest.mark.parametrize("plant", ["symlink", "hardlink", "fifo"])
def test_whatever_is_planted_at_the_lock_name_is_refused_untouched(tmp_path, victim, plant):
    out = tmp_path / "out"
    out.mkdir()
    lock = out / ".ck.oneload-lock"
    if plant == "symlink":
        os.symlink(victim, lock)
    elif plant == "hardlink":
        os.link(victim, lock)
    else:
        os.mkfifo(lock)
    with pytest.raises(OneloadError) as e:
        mo.convert(SRC, out / "ck", shards=2, progress=False)
    found = {"symlink": "a symbolic link", "hardlink": "a file with 2 names", "fifo": "a FIFO"}[plant]
    assert f"{lock}: found {found}" in str(e.value) and "remove it" in str(e.value), str(e.value)
    assert victim.read_bytes() == PRECIOUS
    assert sorted(os.listdir(out)) == [".ck.oneload-lock"]  # nothing else written, the plant left as it was


def test_a_lock_a_killed_conversion_left_is_taken_over(tmp_path):
    """A regular lock file of one name is what a dead conversion leaves: not an obstacle."""
    out = tmp_path / "out"
    out.mkdir()
    (out / ".ck.oneload-lock").write_text("pid 1 on elsewhere\n")
    mo.convert(SRC, out / "ck", shards=2, progress=False)
    assert not (out / ".ck.oneload-lock").exists() and _side_files(out) == []


# --------------------------------------------------------------------------- files the writers open


@pytest.mark.parametrize("writer", ["write_torch", "write_json", "write_safetensors"])
def test_a_writer_never_truncates_a_file_it_did_not_create(tmp_path, victim, writer):
    from metaseq_oneload import _writing

    name = tmp_path / "out.bin"
    os.link(victim, name)
    with pytest.raises(OneloadError, match="a file this process did not create"):
        if writer == "write_torch":
            _writing.write_torch(str(name), {"w": torch.zeros(4)}, {}, None)
        elif writer == "write_json":
            _writing.write_json(str(name), {"a": 1})
        else:
            _writing.write_safetensors(str(name), [], {}, None)
    assert victim.read_bytes() == PRECIOUS


# --------------------------------------------------------------------------- a full disk


_FULL = """
import json, os, resource, signal, sys
from metaseq_oneload.formats import discover, _index
layout = discover({out!r})
os.unlink({index!r})
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))
try:
    _index.write(layout)
    print(json.dumps({{"error": None}}))
except BaseException as e:
    from metaseq_oneload import OneloadError
    print(json.dumps({{"error": type(e).__name__, "ours": isinstance(e, OneloadError), "message": str(e)}}))
"""


def test_a_full_disk_while_writing_the_index_leaves_nothing_behind(tmp_path):
    out = tmp_path / "out"
    mo.convert(SRC, out / "ck", shards=2, progress=False)
    index = out / "ck.oneload-index.json"
    limit = index.stat().st_size // 2
    code = _FULL.format(out=str(out), index=str(index), limit=limit)
    rc, stdout, stderr, _ = _python(code, {"METASEQ_ONELOAD_INDEX_KEY": os.environ["METASEQ_ONELOAD_INDEX_KEY"]}, 120)
    assert rc == 0, stderr[-2000:]
    got = json.loads(stdout.strip().splitlines()[-1])
    assert got["error"] is not None and got["ours"], got
    assert "free space" in got["message"] or "File too large" in got["message"], got
    assert sorted(os.listdir(out)) == ["ck-model_part-0-shard0.pt", "ck-model_part-0-shard1.pt"], os.listdir(out)


def test_a_full_disk_while_converting_leaves_nothing_behind(tmp_path):
    out = tmp_path / "out"
    code = f"""
import json, resource, signal
import metaseq_oneload as mo
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (50_000, 50_000))
try:
    mo.convert({str(SRC)!r}, {str(out / 'ck')!r}, shards=2, progress=False)
    print(json.dumps({{"error": None}}))
except BaseException as e:
    print(json.dumps({{"error": type(e).__name__, "ours": isinstance(e, mo.OneloadError), "message": str(e)}}))
"""
    rc, stdout, stderr, _ = _python(code, {"METASEQ_ONELOAD_INDEX_KEY": str(tmp_path / "k")}, 120)
    assert rc == 0, stderr[-2000:]
    got = json.loads(stdout.strip().splitlines()[-1])
    assert got["error"] is not None and got["ours"], got
    assert os.listdir(out) == [], os.listdir(out)


# --------------------------------------------------------------------------- a commit cut short


_KILL_AT_COMMIT = """
import os, signal
import metaseq_oneload as mo
real = os.replace
def replace(src, dst, *a, **k):
    real(src, dst, *a, **k)
    if str(dst).endswith(".pt"):  # the first checkpoint file is in place: die before the next
        os.kill(os.getpid(), signal.SIGKILL)
os.replace = replace
mo.convert({src!r}, {dst!r}, model_parallel=1, shards=2, overwrite=True, progress=False)
"""


def test_a_commit_killed_between_two_renames_is_refused_with_how_to_recover(tmp_path):
    out = tmp_path / "out"
    mo.convert(SRC, out / "ck", shards=2, progress=False)  # the older set
    other = FIXTURES / "shard_only"  # another model's weights, written to the same names
    rc, _, stderr, _ = _python(_KILL_AT_COMMIT.format(src=str(other), dst=str(out / "ck")),
                               {"METASEQ_ONELOAD_INDEX_KEY": os.environ["METASEQ_ONELOAD_INDEX_KEY"]}, 120)
    assert rc == -signal.SIGKILL, stderr[-2000:]
    with pytest.raises(OneloadError) as e:
        mo.inspect(out)
    msg = str(e.value)
    assert "was interrupted while it renamed its finished files into place" in msg, msg
    assert "1 name(s) hold the new files (ck-model_part-0-shard0.pt)" in msg, msg
    assert "1 still hold the older set's or are missing (ck-model_part-0-shard1.pt)" in msg, msg
    assert "overwrite=True" in msg, msg
    with pytest.raises(OneloadError, match="was interrupted"):
        mo.load_state_dict(out)
    # What the message says to do, done: the set is whole again, every tensor the source's.
    mo.convert(other, out / "ck", model_parallel=1, shards=2, overwrite=True, progress=False)
    sd, ref = mo.load_state_dict(out, verify=True), mo.load_state_dict(other)
    assert set(sd) == set(ref) and all(torch.equal(sd[k], ref[k]) for k in ref)
    assert _side_files(out) == []
