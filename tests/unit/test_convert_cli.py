"""`metaseq-oneload convert / consolidate / verify`: tables, --json, exit codes, progress."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import struct
import subprocess
import sys
import termios
import threading
from pathlib import Path

import pytest

from metaseq_oneload.cli import main
from tests.conftest import FIXTURES, needs_fixtures

pytestmark = needs_fixtures
REPO = Path(__file__).resolve().parents[2]


def _cli(*args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "metaseq_oneload", *map(str, args)], capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=str(REPO)), **kw)


def test_convert_table_and_json(tmp_path, capsys):
    assert main(["convert", str(FIXTURES / "fsdp_dp3"), str(tmp_path / "a" / "ck"), "-m", "2", "-s", "2"]) == 0
    out = capsys.readouterr().out
    for line in ("target     " + str(tmp_path / "a" / "ck") + "  (2x2 flat, torch)", "optimizer  carried",
                 "ck-model_part-1-shard1.pt", "(1x3 flat)"):
        assert line in out, out
    assert main(["convert", str(FIXTURES / "mp2_dp2"), str(tmp_path / "b" / "ck"), "--model-parallel", "1",
                 "--shards", "1", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["files"] == [str(tmp_path / "b" / "ck.pt")] and d["optimizer"] == "dropped" and not d["flat"]
    assert any("cannot be mapped onto unflattened parameters" in n for n in d["notes"])


def test_consolidate_and_verify(tmp_path, capsys):
    assert main(["consolidate", str(FIXTURES / "mp2_dp2" / "checkpoint_last.pt"), str(tmp_path / "one.pt")]) == 0
    capsys.readouterr()
    # Different training runs of the same model: equal to ~1e-5, not bit for bit.
    assert main(["verify", str(tmp_path / "one.pt"), str(FIXTURES / "singleton")]) == 1
    out = capsys.readouterr().out
    assert "largest differences" in out and "decoder.layers.0.self_attn.qkv_proj.bias" in out
    assert "DIFFER: " in out
    assert main(["verify", str(tmp_path / "one.pt"), str(FIXTURES / "singleton"), "--atol", "1e-4"]) == 0
    assert "MATCH: 30 tensors" in capsys.readouterr().out
    assert main(["verify", str(tmp_path / "one.pt"), str(FIXTURES / "mp2_dp2"), "--atol", "0", "--rtol", "0"]) == 0
    assert "bit-identical" in capsys.readouterr().out
    assert main(["verify", str(tmp_path / "one.pt"), str(FIXTURES / "singleton"), "--json"]) == 1
    d = json.loads(capsys.readouterr().out)
    assert d["match"] is False and d["mismatched_tensors"] >= 1 and len(d["diffs"]) == 30


def test_errors_exit_2_without_traceback(tmp_path, capsys):
    assert main(["convert", str(FIXTURES / "fsdp_dp3"), str(tmp_path / "ck"), "-s", "2"]) == 0
    capsys.readouterr()
    r = _cli("convert", FIXTURES / "fsdp_dp3", tmp_path / "ck", "-s", "2")  # a real process, its exit code
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.startswith("metaseq-oneload convert: error: ") and "--overwrite" in r.stderr
    assert main(["convert", str(FIXTURES / "singleton"), str(tmp_path / "x"), "-s", "2", "--unflat"]) == 2
    assert "not split into shards" in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "nothing"), str(tmp_path / "y")]) == 2
    assert "no such file or folder" in capsys.readouterr().err
    assert main(["verify", str(FIXTURES / "singleton"), str(tmp_path / "nothing"), "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["type"] == "CheckpointNotFoundError"


def test_quiet_in_a_pipe(tmp_path):
    r = _cli("convert", FIXTURES / "fsdp_dp3", tmp_path / "ck", "-s", "4")
    assert r.returncode == 0 and r.stderr == ""


def test_progress_bar_on_a_terminal(tmp_path):
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a 0-column pty shows no bar
    seen = []

    def drain():  # while the process runs: a pty may drop what is unread once it exits
        while True:
            try:
                chunk = os.read(master, 1 << 16)
            except OSError:
                return
            if not chunk:
                return
            seen.append(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        p = subprocess.Popen([sys.executable, "-m", "metaseq_oneload", "convert", str(FIXTURES / "fsdp_dp3"),
                              str(tmp_path / "ck"), "-s", "2"], stdout=subprocess.PIPE, stderr=slave,
                             env=dict(os.environ, PYTHONPATH=str(REPO)))
        p.communicate(timeout=120)
    finally:
        os.close(slave)
        reader.join(10)
        os.close(master)
    text = b"".join(seen)
    assert p.returncode == 0
    assert b"convert" in text and b"tensors" in text, text


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_format_flag(tmp_path, fmt, capsys):
    assert main(["convert", str(FIXTURES / "shard_only"), str(tmp_path / "ck"), "-s", "3", "--format", fmt,
                 "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    ext = ".pt" if fmt == "torch" else ".safetensors"
    assert [os.path.basename(f) for f in d["files"]] == [f"ck-model_part-0-shard{i}{ext}" for i in range(3)]
    assert len(d["sidecars"]) == (3 if fmt == "safetensors" else 0)
