"""Object storage (issue 12, part 5): checkpoints at ``s3://`` URLs load through the engine,
against an S3 endpoint the test starts on 127.0.0.1 (moto's server mode behind a proxy that
counts the bytes it relays and can answer data reads with 503). Every load is compared with
the same load from the local files; the bytes inspection fetches are counted by the proxy,
independently of the package."""

from __future__ import annotations

import json
import os
import tracemalloc

import pytest
import torch

import metaseq_oneload as mo
from metaseq_oneload import CheckpointLayoutError, CheckpointNotFoundError, _storage
from tests.conftest import FIXTURES, needs_fixtures
from tests.s3_server import S3Endpoint
from tests.tiny_metaseq import TinyMetaseqLM

pytestmark = needs_fixtures

SETS = ("singleton", "fsdp_dp3", "mp2_ddp", "mp2_dp2")


@pytest.fixture(scope="module")
def s3():
    ep = S3Endpoint()
    urls = {name: ep.upload(FIXTURES / name, "ckpt", name) for name in SETS}
    yield ep, urls
    ep.stop()


@pytest.fixture
def remote(s3, monkeypatch):
    ep, urls = s3
    for k, v in ep.env().items():
        monkeypatch.setenv(k, v)
    _storage.reset_stats()
    ep.reset()
    yield ep, urls
    ep.reset()


def _same(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for k in b:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("name,member", [
    ("singleton", "checkpoint_2_consolidated.pt"),
    ("fsdp_dp3", "checkpoint_2-model_part-0-shard1.pt"),  # any file of the set names it
    ("fsdp_dp3", "checkpoint_last-model_part-0-shard2.pt"),  # a pointer object
    ("fsdp_dp3", ""),  # the folder
    ("mp2_ddp", "checkpoint_2-model_part-1.pt"),
    ("mp2_dp2", "checkpoint_2.pt"),  # the un-suffixed name metaseq scripts take
])
def test_s3_loads_what_the_local_files_load(remote, name, member):
    ep, urls = remote
    url = f"{urls[name]}/{member}" if member else urls[name]
    local = FIXTURES / name / member if member else FIXTURES / name
    want = mo.inspect(local)
    got = mo.inspect(url)
    assert (got.kind, got.model_parallel_size, got.shards_per_part, got.flat) == \
        (want.kind, want.model_parallel_size, want.shards_per_part, want.flat)
    assert got.fingerprint() == want.fingerprint()
    assert got.display_name.startswith(urls[name] + "/")
    _same(mo.load_state_dict(url, no_dist=True), mo.load_state_dict(local, no_dist=True))
    st = _storage.stats()
    assert st["requests"] > 0 and st["retries"] == 0 and ep.counters.failed == 0


def test_load_checkpoint_and_load_into_from_s3(remote):
    ep, urls = remote
    lc = mo.load_checkpoint(urls["fsdp_dp3"], flat=False, no_dist=True)
    ref = mo.load_checkpoint(FIXTURES / "fsdp_dp3", flat=False, no_dist=True)
    _same(lc.model, ref.model)
    assert lc.report.bytes_read == ref.report.bytes_read > 0
    torch.manual_seed(0)
    a, b = TinyMetaseqLM(), TinyMetaseqLM()
    mo.load_into(a, urls["mp2_dp2"], no_dist=True)
    mo.load_into(b, FIXTURES / "mp2_dp2", no_dist=True)
    _same(a.state_dict(), b.state_dict())


def test_cli_inspect_takes_a_url(remote, capsys):
    ep, urls = remote
    from metaseq_oneload.cli import main

    assert main(["inspect", "--json", urls["mp2_dp2"] + "/checkpoint_2-model_part-1-shard0.pt"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["kind"] == "fsdp_sharded" and d["model_parallel_size"] == 2
    assert main(["inspect", urls["fsdp_dp3"]]) == 0
    out = capsys.readouterr().out
    assert "s3://ckpt/fsdp_dp3/checkpoint_2" in out and "checkpoint_2-model_part-0-shard2.pt" in out


def _big_checkpoint(path, mib: int = 24):
    """A metaseq-shaped checkpoint whose tensors dwarf its header (as real ones do)."""
    g = torch.Generator().manual_seed(1)
    n = mib * (1 << 20) // 4 // 6
    model = {f"decoder.layers.{i}.fc1.weight": torch.randn(n // 256, 256, generator=g) for i in range(6)}
    model.update({f"decoder.layers.{i}.fc1.bias": torch.randn(256, generator=g) for i in range(6)})
    torch.save({"model": model, "cfg": {"model": {"arch": "x"}}, "extra_state": {}}, path)
    return path


def test_inspection_fetches_headers_only(remote, tmp_path):
    ep, urls = remote
    local = _big_checkpoint(tmp_path / "big.pt")
    size = os.path.getsize(local)
    url = ep.upload(local, "ckpt", "big/checkpoint_1.pt")
    ep.reset()
    _storage.reset_stats()
    _storage.forget()
    layout = mo.inspect(url)
    assert len(layout.parts[0].tensors) == 12
    # measured by the proxy, not the package: the object's bytes only (not listings)
    fetched = ep.counters.bytes_by_key["/ckpt/big/checkpoint_1.pt"]
    assert fetched == _storage.stats()["bytes"]
    print(f"\ninspect {url}: {fetched} of {size} bytes fetched ({100 * fetched / size:.2f}%), "
          f"{_storage.stats()['requests']} requests")
    assert fetched < 256 << 10 and fetched < size / 50, (fetched, size)
    # then the load reads the tensors' bytes once, not the file twice
    ep.reset()
    sd = mo.load_state_dict(url, no_dist=True)
    _same(sd, mo.load_state_dict(local, no_dist=True))
    tensor_bytes = sum(t.numel() * t.element_size() for t in sd.values())
    loaded = ep.counters.bytes_by_key["/ckpt/big/checkpoint_1.pt"]
    print(f"load: {loaded} bytes fetched for {tensor_bytes} bytes of tensors")
    assert tensor_bytes <= loaded < tensor_bytes + (512 << 10), (loaded, tensor_bytes)


def test_small_tensors_between_large_ones_are_fetched_once(remote, tmp_path):
    # A decoder's biases and norms sit between its large weights: runs of small reads share
    # windows that grow into the next large weight, whose read then takes the window's part
    # and fetches only the rest (it used to fetch it again: 1.13x the tensors' bytes here).
    from bench._synth import metaseq_lm, write_metaseq

    ep, _ = remote
    model = metaseq_lm(layers=3, dim=256, ffn=1024, vocab=2048, positions=256)
    write_metaseq(str(tmp_path / "synth"), model)
    url = ep.upload(tmp_path / "synth.pt", "ckpt", "synth/checkpoint_1.pt")
    _storage.forget()
    ep.reset()
    sd = mo.load_state_dict(url, no_dist=True, verify=False)
    _same(sd, mo.load_state_dict(tmp_path / "synth.pt", no_dist=True, verify=False))
    stored = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in sd.values()}.values())
    loaded = ep.counters.bytes_by_key["/ckpt/synth/checkpoint_1.pt"]
    assert stored <= loaded <= 1.002 * stored + (160 << 10), (loaded, stored)


def test_transient_errors_are_retried_and_counted(remote, tmp_path):
    ep, urls = remote
    local = _big_checkpoint(tmp_path / "big.pt", mib=4)
    url = ep.upload(local, "ckpt", "retry/checkpoint_1.pt")
    want = mo.load_state_dict(local, no_dist=True)
    _storage.reset_stats()
    ep.reset()
    ep.fail_next(5)  # the next five ranged GETs answer 503 ServiceUnavailable
    _same(mo.load_state_dict(url, no_dist=True), want)
    assert ep.counters.failed == 5
    assert _storage.stats()["retries"] == 5, _storage.stats()


def test_persistent_errors_give_up_with_the_url(remote, tmp_path, monkeypatch):
    ep, urls = remote
    url = ep.upload(_big_checkpoint(tmp_path / "big.pt", mib=1), "ckpt", "down/checkpoint_1.pt")
    monkeypatch.setenv("METASEQ_ONELOAD_REMOTE_RETRIES", "2")
    mo.inspect(url)  # headers fetched (and kept): what fails below is the first tensor's read
    _storage.reset_stats()
    ep.fail_next(10 ** 6)
    with pytest.raises(Exception, match=r"s3://ckpt/down/checkpoint_1\.pt.*failed after 3 tries"):
        mo.load_state_dict(url, no_dist=True)
    assert ep.counters.failed == 3 and _storage.stats()["retries"] == 2


def test_missing_objects_are_not_found(remote):
    ep, urls = remote
    with pytest.raises(CheckpointNotFoundError, match=r"s3://ckpt/singleton/checkpoint_9\.pt: no such file"):
        mo.inspect(urls["singleton"] + "/checkpoint_9.pt")
    with pytest.raises(CheckpointNotFoundError, match=r"s3://no-such-bucket/x/checkpoint_1\.pt"):
        mo.load_state_dict("s3://no-such-bucket/x/checkpoint_1.pt", no_dist=True)
    with pytest.raises(CheckpointNotFoundError, match=r"s3://ckpt/nothing-here"):
        mo.inspect("s3://ckpt/nothing-here/")
    assert ep.counters.failed == 0 and _storage.stats()["retries"] == 0  # not retried


def test_a_damaged_object_is_named(remote, tmp_path):
    ep, urls = remote
    data = (FIXTURES / "singleton" / "checkpoint_2_consolidated.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 2])
    url = ep.upload(tmp_path / "cut.pt", "ckpt", "cut/checkpoint_1.pt")
    with pytest.raises(CheckpointLayoutError, match=r"s3://ckpt/cut/checkpoint_1\.pt: truncated or corrupted"):
        mo.inspect(url)


def test_concurrency_is_bounded_and_memory_stays_small(remote, tmp_path, monkeypatch):
    ep, urls = remote
    local = _big_checkpoint(tmp_path / "big.pt", mib=8)
    url = ep.upload(local, "ckpt", "conc/checkpoint_1.pt")
    monkeypatch.setenv("METASEQ_ONELOAD_REMOTE_PART_MB", "0.25")
    monkeypatch.setenv("METASEQ_ONELOAD_REMOTE_CONCURRENCY", "3")
    layout = mo.inspect(url)
    _storage.reset_stats()
    name = "decoder.layers.0.fc1.weight"
    t = layout.parts[0].tensors[name]
    out = torch.empty(t.shape, dtype=t.dtype)
    ext = t.extents[0]
    tracemalloc.start()
    got = _storage.read_into(url, ext.byte_offset, memoryview(out.numpy()).cast("B"))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert got == out.numel() * 4
    st = _storage.stats()
    print(f"\nread_into {got} bytes: {st['requests']} requests, at most {st['max_in_flight']} in flight, "
          f"peak {peak} bytes allocated outside the destination")
    # 1.33 MiB in parts of 256 KiB: 6 requests, never more than 3 at once, and no more than
    # a few parts' bytes held outside the destination at any time
    assert st["requests"] == -(-got // (256 << 10)) and 1 < st["max_in_flight"] <= 3, st
    assert peak < 3 * 3 * (256 << 10) + (1 << 20), peak
    torch.testing.assert_close(out, torch.load(local, weights_only=True)["model"][name], rtol=0, atol=0)


def test_the_library_patches_take_urls_through_the_engine(remote, tmp_path):
    """What metaseq's and fairseq's patches call for an s3:// path (they no longer hand it
    back to the library): the set located from any name, the rest of a file (cfg, optimizer
    state) read without fetching the weights."""
    from metaseq_oneload.integrations import _checkpoint

    ep, urls = remote
    assert not _checkpoint.remote(urls["fsdp_dp3"] + "/checkpoint_2.pt")
    assert _checkpoint.remote("manifold://bucket/checkpoint_2.pt")  # no fsspec protocol: the library's own
    layout = _checkpoint.locate(urls["fsdp_dp3"] + "/checkpoint_2.pt", "-model_part-0-shard1")
    assert (layout.shards_per_part, layout.flat) == (3, True)
    assert _checkpoint.named_part(urls["mp2_ddp"] + "/checkpoint_2-model_part-1.pt", mo.inspect(urls["mp2_ddp"])) == 1

    g = torch.Generator().manual_seed(2)
    model = {f"w{i}": torch.randn(512, 1024, generator=g) for i in range(4)}
    opt = {"state": {0: {"exp_avg": torch.randn(512, 1024, generator=g), "step": torch.tensor(3.0)}},
           "param_groups": [{"lr": 0.1, "params": [0]}]}
    torch.save({"model": model, "cfg": {"model": {"arch": "x"}}, "extra_state": {"epoch": 2},
                "last_optimizer_state": opt, "optimizer_history": [{"num_updates": 7}]}, tmp_path / "ck.pt")
    url = ep.upload(tmp_path / "ck.pt", "ckpt", "rest/checkpoint_1.pt")
    size = os.path.getsize(tmp_path / "ck.pt")
    for skip in (True, False):
        _storage.forget()
        ep.reset()
        got = _checkpoint.read_rest(url, skip_optimizer=skip)
        want = _checkpoint.read_rest(str(tmp_path / "ck.pt"), skip_optimizer=skip)
        assert set(got) == set(want) and "model" not in got
        assert got["extra_state"] == want["extra_state"] and got["optimizer_history"] == want["optimizer_history"]
        fetched = ep.counters.bytes_by_key["/ckpt/rest/checkpoint_1.pt"]
        if skip:
            assert fetched < size / 20, (fetched, size)
        else:
            a, b = got["last_optimizer_state"]["state"][0], want["last_optimizer_state"]["state"][0]
            assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["step"], b["step"])
            assert a["exp_avg"].device.type == "cpu"
            assert fetched < size / 2, (fetched, size)  # the optimizer state, not the weights
        print(f"\n_read_rest(skip_optimizer={skip}): {fetched} of {size} bytes fetched")


def test_cli_plan_takes_a_url(remote, capsys):
    ep, urls = remote
    from metaseq_oneload.cli import main

    assert main(["plan", "--world", "2", urls["fsdp_dp3"] + "/checkpoint_2.pt"]) == 0
    out = capsys.readouterr().out
    assert "s3://ckpt/fsdp_dp3/checkpoint_2" in out


def _load_in_child(url, q):
    try:
        sd = mo.load_state_dict(url, no_dist=True)
        q.put(sorted((k, float(v.double().sum())) for k, v in sd.items()))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        q.put(f"{type(e).__name__}: {e}")


def test_a_forked_child_reads_urls_on_its_own(remote):
    """A DataLoader worker (fork) after the parent read: the child must not use the parent's
    event loop, connection pool or reader threads, which it inherits but cannot run."""
    import multiprocessing

    ep, urls = remote
    url = urls["mp2_ddp"]
    want = sorted((k, float(v.double().sum())) for k, v in mo.load_state_dict(url, no_dist=True).items())
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_load_in_child, args=(url, q))
    p.start()
    got = q.get(timeout=120)
    p.join(30)
    assert got == want


def test_verify_and_files_read_whole_from_s3(remote, tmp_path):
    """verify=True's independent reading, and a legacy (pre-1.6) file, which cannot be read
    in place: fetched whole (by the header read, and again by the load), and equal to the
    local load."""
    ep, urls = remote
    lc = mo.load_checkpoint(urls["fsdp_dp3"], verify=True, no_dist=True)
    assert lc.report.verified
    _same(lc.model, mo.load_state_dict(FIXTURES / "fsdp_dp3", no_dist=True))
    g = torch.Generator().manual_seed(3)
    torch.save({"model": {"a.weight": torch.randn(64, 32, generator=g), "a.bias": torch.randn(64, generator=g)}},
               tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    url = ep.upload(tmp_path / "legacy.pt", "ckpt", "legacy/checkpoint_1.pt")
    assert mo.inspect(url).files[0][0].format == "legacy"
    ep.reset()
    _same(mo.load_state_dict(url, no_dist=True), mo.load_state_dict(tmp_path / "legacy.pt", no_dist=True))
    assert ep.counters.bytes_by_key["/ckpt/legacy/checkpoint_1.pt"] <= 2 * os.path.getsize(tmp_path / "legacy.pt")


def test_small_reads_that_follow_each_other_share_requests(remote):
    """A model's many small tensors (biases, norms, a flat parameter's members) cost a few
    requests, not one each; what read-ahead fetches beyond them stays within the run."""
    ep, urls = remote
    url = urls["singleton"] + "/checkpoint_2_consolidated.pt"
    layout = mo.inspect(url)
    tensors = list(layout.parts[0].tensors.values())
    _storage.forget()
    _storage.reset_stats()
    sd = mo.load_state_dict(url, no_dist=True)
    st = _storage.stats()
    need = sum(t.numel() * t.element_size() for t in sd.values())
    print(f"\n{len(tensors)} tensors, {need} bytes: {st['requests']} requests, {st['bytes']} bytes fetched")
    assert st["requests"] <= len(tensors) // 3, st
    assert need <= st["bytes"] <= 2 * need + (64 << 10), (st, need)
    # scattered small reads fetch exactly what they ask
    _storage.forget()
    _storage.stat(url)
    _storage.reset_stats()
    buf = bytearray(100)
    size = os.path.getsize(FIXTURES / "singleton" / "checkpoint_2_consolidated.pt")
    for off in (0, size // 2, size - 200):
        assert _storage.read_into(url, off, memoryview(buf)) == 100
    assert _storage.stats()["bytes"] == 300 and _storage.stats()["requests"] == 3
