"""Conversion safety: an error or a `kill -9` part-way leaves no file at any final name,
temporary files are cleaned (now, or by the next run), memory stays bounded."""

from __future__ import annotations

import json
import os
import re
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

    def hook(done, total):
        calls.append(done)
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
def hook(done, total):
    written[0] = done
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
    assert _temps(out) == [] and len([f for f in _finals(out) if f.endswith(".pt")]) == 4
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
    from metaseq_oneload import _outputs

    host, dead = _outputs._host(), _dead_pid()
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
    assert _outputs.stale_temps(final) == sorted([str(mine_dead), str(mine_dead_folder)])
    assert sorted(_outputs.remove_stale_temps(final)) == sorted([str(mine_dead), str(mine_dead_folder)])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        p.name for p in (other_host, other_host2, other_host3, mine_alive, legacy))
    # OutputSet.clean_stale is the same rule.
    mine_dead.write_bytes(b"x")
    out = _outputs.OutputSet([str(final)], overwrite=False)
    assert out.clean_stale() == [str(mine_dead)]


def test_temporary_files_are_created_exclusively(tmp_path, monkeypatch):
    """A temporary name is never one that exists, a planted link included: it is created
    with O_EXCL | O_NOFOLLOW, and a random tail makes it unpredictable."""
    from metaseq_oneload import _outputs

    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    tails = iter(["aaaaaaaa", "bbbbbbbb"])
    monkeypatch.setattr(_outputs.secrets, "token_hex", lambda n: next(tails))
    planted = tmp_path / f".ck.pt.oneload-tmp+{_outputs._host()}+{os.getpid()}+aaaaaaaa"
    os.symlink(victim, planted)
    tmp = _outputs.make_temp(str(tmp_path / "ck.pt"))
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
        write_torch(str(tmp_path / "out.pt"), {"w": torch.zeros(4)}, {}, None)
    assert victim.read_bytes() == b"precious"


class _NotAllowlisted:
    """A class no checkpoint carries."""


def test_write_torch_reads_its_header_back_with_the_allowlist(tmp_path):
    import torch

    from metaseq_oneload import UnsafeCheckpointError
    from metaseq_oneload._writing import write_torch

    obj = {"w": torch.arange(4.0), "odd": _NotAllowlisted()}
    with pytest.raises(UnsafeCheckpointError, match="outside the checkpoint allowlist"):
        write_torch(str(tmp_path / "a.pt"), obj, {}, None)
    # The caller that unpickled its source with trust_pickle=True may write what it read.
    write_torch(str(tmp_path / "b.pt"), obj, {}, None, trust_pickle=True)
    assert torch.equal(torch.load(tmp_path / "b.pt", weights_only=False)["w"], torch.arange(4.0))


# --------------------------------------------------------------------------- outputs a user owns


def _hashes(folder: Path) -> dict:
    import hashlib

    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def _small_source() -> str:
    from tests.conftest import FIXTURES, fixtures_available

    if not fixtures_available():
        pytest.skip(f"metaseq fixtures not found at {FIXTURES}")
    return str(FIXTURES / "fsdp_dp3" / "checkpoint_2-model_part-0-shard0.pt")


def test_a_second_concurrent_convert_into_the_same_destination_fails_and_changes_nothing(tmp_path):
    """Two real processes, the first paused part-way: the second (the CLI) stops at once with
    OutputExistsError (exit 2) naming the first; the first completes; a file the user keeps
    in the destination folder is untouched."""
    src = _small_source()
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("the user's own file")
    mine = _hashes(out)
    source_before = _hashes(Path(src).parent)
    paused, go = tmp_path / "paused", tmp_path / "go"
    first = _python(f"""
import os, time
from metaseq_oneload._convert import convert
def hook(done, total):
    if not os.path.exists({str(paused)!r}):
        open({str(paused)!r}, "w").close()
        deadline = time.time() + 120
        while not os.path.exists({str(go)!r}) and time.time() < deadline:
            time.sleep(0.01)
r = convert({src!r}, {str(out / "ck")!r}, shards=2, jobs=1, progress=hook)
print(len(r.files))
""")
    try:
        deadline = time.time() + 120
        while not paused.exists():
            assert first.poll() is None, first.communicate()
            assert time.time() < deadline, "the first conversion never got part-way"
            time.sleep(0.02)
        t0 = time.perf_counter()
        second = subprocess.run([sys.executable, "-m", "metaseq_oneload", "convert", src, str(out / "ck"), "--shards",
                                 "2"], env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"),
                                capture_output=True, text=True, timeout=120)
        took = time.perf_counter() - t0
    finally:
        go.touch()
    stdout, stderr = first.communicate(timeout=120)
    assert first.returncode == 0, stderr
    assert second.returncode == 2, (second.returncode, second.stderr)
    assert re.search(rf"convert: error: {re.escape(str(out))}: another conversion \(pid {first.pid} on [^)]+\) is writing ck-model_part-0-"
                     r"shard0\.pt, ck-model_part-0-shard1\.pt right now; nothing was written", second.stderr), second.stderr
    assert "Traceback" not in second.stderr
    assert took < 60, took  # it did not wait for the first: the time is the CLI's start-up
    assert sorted(_finals(out)) == ["ck-model_part-0-shard0.pt", "ck-model_part-0-shard1.pt", "ck.oneload-index.json",
                                    "notes.txt"]
    assert {k: v for k, v in _hashes(out).items() if k in mine} == mine
    assert verify(str(out / "ck-model_part-0-shard0.pt"), src, atol=0, rtol=0).identical
    assert [p for p in os.listdir(out) if p.startswith(".")] == []  # no temporary file, no lock left
    assert _hashes(Path(src).parent) == source_before


def test_a_file_that_appears_at_a_final_name_is_never_replaced(tmp_path):
    """Another program writes one of the destination names while a conversion runs (no
    lock of ours can stop it): the conversion puts none of its files in place and theirs
    stays as it was, bit for bit."""
    from metaseq_oneload import OutputExistsError

    src = _small_source()
    out = tmp_path / "out"
    theirs = out / "ck-model_part-0-shard1.pt"

    def hook(done, total):
        if not theirs.exists():
            theirs.write_bytes(b"another program's file")

    t0 = time.perf_counter()
    with pytest.raises(OutputExistsError, match=r"ck-model_part-0-shard1\.pt: appeared while this conversion was "
                                                r"writing .* it was left as it is and this conversion put none of its "
                                                "files in place"):
        convert(src, out / "ck", shards=2, jobs=1, progress=hook)
    assert time.perf_counter() - t0 < 30
    assert theirs.read_bytes() == b"another program's file"
    assert sorted(os.listdir(out)) == ["ck-model_part-0-shard1.pt"]  # ours given back, temporaries and lock gone


def _without_override():
    """A child that obeys folder permissions even as root: CAP_DAC_OVERRIDE,
    CAP_DAC_READ_SEARCH and CAP_FOWNER leave its capability bounding set before exec."""
    if os.geteuid() != 0:
        return None

    def drop():
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        for cap in (1, 2, 3):
            if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
                raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")

    return drop


def test_a_destination_without_write_permission_is_a_conversion_error_exit_2(tmp_path):
    src = _small_source()
    top = tmp_path
    try:
        locked = top / "locked"
        locked.mkdir()
        (locked / "keep.pt").write_bytes(b"the user's checkpoint")
        before = _hashes(locked)
        locked.chmod(0o555)
        t0 = time.perf_counter()
        # Both CLIs side by side: each is a fresh interpreter importing torch, most of the time here.
        runs = {dst: subprocess.Popen([sys.executable, "-m", "metaseq_oneload", "convert", src, str(dst), "--shards", "2"],
                                      env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      preexec_fn=_without_override())
                for dst in (locked / "ck", locked / "sub" / "ck")}
        try:
            for dst, run in runs.items():
                _, err = run.communicate(timeout=120)
                assert run.returncode == 2, (run.returncode, err)
                assert "Traceback" not in err, err
                assert re.search(rf"convert: error: {re.escape(str(dst.parent))}: cannot (create|write)[^\n]*\(Permission "
                                 r"denied\); permission denied: choose a folder you can write to, or make this one "
                                 r"writable for you\. Nothing was written under a final name\.", err), err
        finally:  # (one that hung or failed an assertion leaves no sibling running)
            for run in runs.values():
                if run.poll() is None:
                    run.kill()
                    run.communicate()
        assert time.perf_counter() - t0 < 120
        locked.chmod(0o755)
        assert _hashes(locked) == before and sorted(os.listdir(locked)) == ["keep.pt"]
    finally:
        (top / "locked").chmod(0o755)  # pytest removes tmp_path


def test_a_destination_under_a_file_is_a_conversion_error(tmp_path):
    from metaseq_oneload import ConversionError

    src = _small_source()
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(ConversionError, match=r"a_file/out: cannot create the destination folder \(Not a directory\); a "
                                              "part of the path is a file, not a folder"):
        convert(src, tmp_path / "a_file" / "out" / "ck", shards=2)
    assert (tmp_path / "a_file").read_text() == "x"


# --------------------------------------------------------------------------- save identity


def _saves(paths) -> list:
    import torch

    return [torch.load(p, map_location="cpu", weights_only=False).get("oneload_save") for p in paths]


def test_every_file_of_one_output_set_carries_the_same_save_identity(tmp_path):
    from metaseq_oneload._convert import consolidate

    src = _small_source()
    ids = set()
    for name, kw, (M, N) in (("flat", dict(model_parallel=2, shards=2), (2, 2)),
                             ("parts", dict(model_parallel=2, shards=1, flat=False), (2, 1))):
        r = convert(src, tmp_path / name / "ck", **kw)
        saves = _saves(r.files)
        assert len({s["save_id"] for s in saves}) == 1, saves
        assert all(s == {"save_id": saves[0]["save_id"], "parts": M, "shards": N} for s in saves), saves
        assert re.fullmatch(r"[0-9a-f]{32}", saves[0]["save_id"])
        ids.add(saves[0]["save_id"])
    # A second conversion of the same source is another save, and so is a conversion of a
    # file this package wrote (its identity is replaced, not copied).
    r = consolidate(tmp_path / "flat" / "ck-model_part-0-shard0.pt", tmp_path / "one.pt")
    (save,) = _saves(r.files)
    assert save["parts"] == 1 and save["shards"] == 1 and save["save_id"] not in ids


def test_safetensors_outputs_carry_it_in_the_sidecar_and_the_header(tmp_path):
    from safetensors import safe_open

    r = convert(_small_source(), tmp_path / "st" / "ck", model_parallel=2, shards=1, flat=False, format="safetensors")
    sides = [json.loads(Path(s).read_text())["oneload_save"] for s in r.sidecars]
    heads = []
    for f in r.files:
        with safe_open(f, "pt") as st:
            heads.append(json.loads(st.metadata()["oneload_save"]))
    assert sides == heads and len({s["save_id"] for s in sides}) == 1 and sides[0]["parts"] == 2


def test_a_bare_state_dict_stays_bare_and_says_it_carries_no_identity(tmp_path):
    import torch

    from metaseq_oneload._convert import consolidate
    from tests.conftest import FIXTURES, raw_load

    if not (FIXTURES / "singleton").is_dir():
        pytest.skip("fixtures missing")
    model = raw_load(FIXTURES / "singleton" / "checkpoint_2_consolidated.pt")["model"]
    torch.save(dict(model), tmp_path / "bare.pt")
    r = consolidate(tmp_path / "bare.pt", tmp_path / "out" / "bare.pt")
    obj = torch.load(r.files[0], weights_only=True)
    assert "oneload_save" not in obj and all(torch.is_tensor(v) for v in obj.values())
    assert any("bare state dict" in n and "no oneload_save save identity" in n for n in r.notes), r.notes
