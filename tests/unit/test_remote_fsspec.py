"""URLs through fsspec in general (issue 12, part 5), without a server: fsspec's in-memory
and local protocols take the same path as s3:// (discovery by listing, pointers, globs,
headers and tensors by ranged reads); and without fsspec the package still imports and a
URL says what to install."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import metaseq_oneload as mo
from metaseq_oneload import CheckpointNotFoundError, _storage
from tests.conftest import FIXTURES, REPO, needs_fixtures

pytestmark = needs_fixtures
fsspec = pytest.importorskip("fsspec", reason="fsspec not installed (pip install metaseq-oneload[remote])")


@pytest.fixture(scope="module")
def memory_sets():
    fs = fsspec.filesystem("memory")
    for name in ("mp2_dp2", "singleton"):
        for p in (FIXTURES / name).iterdir():
            fs.pipe_file(f"/oneload-test/{name}/{p.name}", p.read_bytes())
    yield "memory://oneload-test"
    fs.rm("/oneload-test", recursive=True)


@pytest.mark.parametrize("name,member", [
    ("mp2_dp2", "checkpoint_last-model_part-1-shard0.pt"),
    ("mp2_dp2", "checkpoint_2-model_part-*-shard*.pt"),
    ("mp2_dp2", ""),
    ("singleton", "checkpoint_2_consolidated.pt"),
])
def test_memory_urls_load_what_the_local_files_load(memory_sets, name, member):
    url = f"{memory_sets}/{name}/{member}".rstrip("/")
    local = FIXTURES / name / member if member and "*" not in member else FIXTURES / name
    got, want = mo.inspect(url), mo.inspect(local)
    assert got.fingerprint() == want.fingerprint() and got.display_name.startswith(f"{memory_sets}/{name}/")
    a, b = mo.load_state_dict(url, no_dist=True), mo.load_state_dict(local, no_dist=True)
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in b)


def test_file_urls_are_urls_too():
    url = "file://" + str(FIXTURES / "singleton")
    assert _storage.is_url(url) and not _storage.is_url(str(FIXTURES / "singleton"))
    assert mo.inspect(url).display_name == url + "/checkpoint_2_consolidated"


def test_a_missing_memory_object(memory_sets):
    with pytest.raises(CheckpointNotFoundError, match=r"memory://oneload-test/nothing/checkpoint_1\.pt"):
        mo.inspect(f"{memory_sets}/nothing/checkpoint_1.pt")


def test_an_unknown_protocol_is_named():
    with pytest.raises(ValueError, match=r"nosuchproto://x/checkpoint_1\.pt: fsspec does not know the protocol nosuchproto://"):
        mo.inspect("nosuchproto://x/checkpoint_1.pt")


def test_storage_settings_are_checked(monkeypatch):
    from metaseq_oneload import OptionError

    with pytest.raises(ValueError, match="concurrency >= 1"):
        _storage.RemoteSettings(concurrency=0)
    monkeypatch.setenv("METASEQ_ONELOAD_REMOTE_CONCURRENCY", "0")  # read by _settings, which names it
    with pytest.raises(OptionError, match=r"\$METASEQ_ONELOAD_REMOTE_CONCURRENCY='0': expected a number \(whole"):
        _storage.settings()
    monkeypatch.setenv("METASEQ_ONELOAD_REMOTE_CONCURRENCY", "4")
    monkeypatch.setenv("METASEQ_ONELOAD_REMOTE_PART_MB", "0.01")
    with pytest.raises(OptionError, match=r"\$METASEQ_ONELOAD_REMOTE_PART_MB='0.01': expected a number of MiB, at "
                                          r"least 0.0625 \(64 KiB\)"):
        _storage.settings()
    monkeypatch.delenv("METASEQ_ONELOAD_REMOTE_PART_MB")
    monkeypatch.setenv("METASEQ_ONELOAD_STORAGE_OPTIONS", '["anon"]')
    with pytest.raises(OptionError, match=r"\$METASEQ_ONELOAD_STORAGE_OPTIONS='\[\"anon\"\]': expected a JSON object"):
        _storage.settings()
    monkeypatch.setenv("METASEQ_ONELOAD_STORAGE_OPTIONS", '{"s3": {"endpoint_url": "http://127.0.0.1:1"}, "gs": {"token": "anon"}}')
    s = _storage.settings()
    assert s.options_for("s3") == {"endpoint_url": "http://127.0.0.1:1"} and s.options_for("az") == {}
    monkeypatch.setenv("METASEQ_ONELOAD_STORAGE_OPTIONS", '{"anon": true}')
    assert _storage.settings().options_for("s3") == {"anon": True}


def test_without_fsspec_the_package_imports_and_a_url_says_what_to_install(tmp_path):
    code = ("import sys; sys.modules['fsspec'] = None\n"
            "import metaseq_oneload as mo\n"
            "mo.inspect(r'%s')\n"
            "try:\n    mo.inspect('s3://bucket/ck/checkpoint_1.pt')\n"
            "except ImportError as e:\n    print('ERR', e)\n") % (FIXTURES / "singleton")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ERR s3://bucket/ck/checkpoint_1.pt: reading checkpoints from URLs needs fsspec" in out.stdout
    assert "pip install metaseq-oneload[remote]" in out.stdout




def test_hugging_face_files_at_urls_are_refused_clearly():
    with pytest.raises(mo.CheckpointLayoutError, match=r"memory://hf/model\.safetensors: a huggingface checkpoint at a URL, "
                                                       r"which this version reads from local files only"):
        mo.inspect("memory://hf/model.safetensors")
