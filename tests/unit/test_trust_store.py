"""Issue 21, class 2, object stores: a ranged read's answer is checked, never taken as given.

Against the moto S3 server on 127.0.0.1 behind a proxy that misbehaves on purpose (as a
broken cache, CDN or S3-compatible server does): it ignores ``Range`` and sends the whole
object, answers another range (saying so in ``Content-Range``), sends a short or a long
body under the right ``Content-Range``, redirects, or replaces the object in the store
between a load's header read and its data read. Each used to fill tensors with the wrong
bytes, or raise a raw ``ValueError``/``OSError`` (after retries); each is now a
``RemoteStoreError`` (``RemoteObjectChangedError`` for a replaced object) that names the
object, raised at the first wrong answer, on every rank of a collective load.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

import metaseq_oneload as mo
from metaseq_oneload import _storage
from metaseq_oneload._errors import DistributedLoadError, RemoteObjectChangedError, RemoteStoreError
from tests.conftest import needs_fixtures
from tests.s3_server import S3Endpoint, proxy_control

pytestmark = needs_fixtures

QUICK_S = 5.0  # a wrong answer is refused at once: no retries, no backoff


def _checkpoint(folder, seed: int, *, rows: int = 256):
    """A metaseq-shaped file: large weights (ranged reads in parts) with small biases
    between them (read-ahead windows). Same ``rows``: the same size, other bytes (the
    file's name is the archive's folder name: always the same)."""
    path = folder / "checkpoint_1.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    model = {}
    for i in range(4):
        model[f"decoder.layers.{i}.fc1.weight"] = torch.randn(rows, 1024, generator=g)
        model[f"decoder.layers.{i}.fc1.bias"] = torch.randn(rows, generator=g)
    torch.save({"model": model, "cfg": {"model": {"arch": "x"}}, "extra_state": {}}, path)
    return path


@pytest.fixture(scope="module")
def s3():
    ep = S3Endpoint()
    yield ep
    ep.stop()


@pytest.fixture
def store(s3, monkeypatch, tmp_path):
    """The endpoint, with the process reaching it through the proxy; a fresh object per test."""
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("METASEQ_ONELOAD_REMOTE_PART_MB", "0.25")  # several parts per weight
    _storage.forget()
    s3.reset()
    yield s3
    s3.reset()
    _storage.forget()


def _put(ep, tmp_path, name: str, seed: int = 1, **kw):
    local = _checkpoint(tmp_path / f"{name}-{seed}", seed, **kw)
    return local, ep.upload(local, "trust", f"{name}/checkpoint_1.pt")


def _same(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in b)


# --------------------------------------------------------------------------- wrong answers


@pytest.mark.parametrize("mode,why", [
    ("ignore_range", r"HTTP 200.*not 206"),
    ("other_range", r"Content-Range bytes \d+-\d+/\d+.*asked for bytes \d+-\d+"),
    ("short_body", r"\d+ bytes.*asked for \d+"),
    ("long_body", r"\d+ bytes.*asked for \d+"),
])
def test_a_wrong_answer_to_a_data_read_is_refused(store, tmp_path, mode, why):
    local, url = _put(store, tmp_path, mode)
    mo.inspect(url)  # headers read (and kept) while the proxy behaves
    store.misbehave(mode, key=f"/trust/{mode}/checkpoint_1.pt")
    t0 = time.monotonic()
    with pytest.raises(RemoteStoreError, match=rf"s3://trust/{mode}/checkpoint_1\.pt.*{why}") as e:
        mo.load_state_dict(url, no_dist=True)
    took = time.monotonic() - t0
    print(f"\n{mode}: {type(e.value).__name__} after {took:.2f}s: {e.value}")
    assert took < QUICK_S, took
    assert store.counters.misbehaved >= 1
    # what the store sends when it behaves is loaded as before
    store.misbehave("")
    _storage.forget()
    assert _same(mo.load_state_dict(url, no_dist=True), mo.load_state_dict(local, no_dist=True))


@pytest.mark.parametrize("mode", ["ignore_range", "other_range", "short_body", "long_body"])
def test_a_wrong_answer_to_a_header_read_is_refused(store, tmp_path, mode):
    _, url = _put(store, tmp_path, f"h-{mode}")
    store.misbehave(mode, key=f"/trust/h-{mode}/checkpoint_1.pt")
    with pytest.raises(RemoteStoreError, match=rf"s3://trust/h-{mode}/checkpoint_1\.pt"):
        mo.inspect(url)


def test_a_whole_object_range_answered_200_is_read(store, tmp_path):
    """Some S3-compatible servers and CDNs answer 200 (no Content-Range) for a range that
    covers the whole object. A file under 64 KiB is read whole at once (the zip's end is
    looked for in its last 64 KiB). Before: refused ('answered HTTP 200, not 206'). Now: a
    200 is taken where the range asked for is the whole pinned object, its Content-Length is
    that size and its ETag the pinned one; a 200 for any other range stays refused (the
    ignore_range cases above)."""
    local = tmp_path / "small" / "checkpoint_1.pt"
    local.parent.mkdir()
    torch.save({"model": {"w": torch.randn(16, 16), "b": torch.randn(16)}, "cfg": {"model": {"arch": "x"}},
                "extra_state": {}}, local)
    assert local.stat().st_size < 60 << 10
    url = store.upload(local, "trust", "whole200/checkpoint_1.pt")
    store.misbehave("whole_as_200", key="/trust/whole200/checkpoint_1.pt")
    layout = mo.inspect(url)
    assert sorted(layout.parts[0].tensors) == ["b", "w"]
    assert _same(mo.load_state_dict(url, no_dist=True), mo.load_state_dict(local, no_dist=True))
    assert store.counters.whole_as_200 >= 1


@pytest.mark.parametrize("mode", ["redirect", "ignore_range"])
def test_a_redirect_or_a_server_that_ignores_ranges_is_refused_quickly(store, tmp_path, monkeypatch, mode):
    """Every ranged read answered wrongly, from the first: a clear error at once, not a raw
    error after every retry's backoff (retries and backoff as a user has them)."""
    monkeypatch.setenv("METASEQ_ONELOAD_REMOTE_BACKOFF", "0.2")
    _, url = _put(store, tmp_path, f"q-{mode}")
    store.misbehave(mode)
    t0 = time.monotonic()
    with pytest.raises(RemoteStoreError, match=rf"s3://trust/q-{mode}/checkpoint_1\.pt.*(redirect|HTTP 200)") as e:
        mo.load_state_dict(url, no_dist=True)
    took = time.monotonic() - t0
    print(f"\n{mode} from the start: {type(e.value).__name__} after {took:.2f}s: {e.value}")
    assert took < QUICK_S, took
    assert _storage.stats()["retries"] == 0


# --------------------------------------------------------------------------- a replaced object


@pytest.mark.parametrize("rows", [256, 320], ids=["same-size", "other-size"])
def test_an_object_replaced_between_header_and_data_read_is_named(store, tmp_path, rows):
    """The store itself changes the object after the load read its header (the proxy
    PUTs the new bytes just before the first data read reaches the store)."""
    local, url = _put(store, tmp_path, f"swap-{rows}")
    new = _checkpoint(tmp_path / f"new-{rows}", 2, rows=rows)
    assert (os.path.getsize(new) == os.path.getsize(local)) == (rows == 256)
    mo.inspect(url)  # the headers: the data reads below are the load's only ranged GETs
    store.swap_after(f"/trust/swap-{rows}/checkpoint_1.pt", 0, new)
    with pytest.raises(RemoteObjectChangedError,
                       match=rf"s3://trust/swap-{rows}/checkpoint_1\.pt.*changed while it was being read") as e:
        mo.load_state_dict(url, no_dist=True)
    print(f"\nreplaced ({rows} rows): {e.value}")
    assert store.counters.swapped == 1
    # the next load reads the new object from its start, as a whole
    assert _same(mo.load_state_dict(url, no_dist=True), mo.load_state_dict(new, no_dist=True))


def test_a_layout_whose_object_was_replaced_is_not_read(store, tmp_path):
    """Loading in two steps: inspect, the object is replaced, then the load of that layout."""
    local, url = _put(store, tmp_path, "twostep")
    layout = mo.inspect(url)
    new = _checkpoint(tmp_path / "new", 3)
    store.upload(new, "trust", "twostep/checkpoint_1.pt")
    with pytest.raises(RemoteObjectChangedError, match=r"s3://trust/twostep/checkpoint_1\.pt"):
        mo.load_state_dict(layout, no_dist=True)


def test_an_object_replaced_between_loads_is_read_anew(store, tmp_path):
    """Two loads of one URL, the object replaced between them (within the seconds a stat
    is kept): the second load reads the new object, header and data alike."""
    _, url = _put(store, tmp_path, "between")
    mo.load_state_dict(url, no_dist=True)
    new = _checkpoint(tmp_path / "new", 4)
    store.upload(new, "trust", "between/checkpoint_1.pt")
    assert _same(mo.load_state_dict(url, no_dist=True), mo.load_state_dict(new, no_dist=True))


def test_a_rank_that_adopts_a_layout_reads_the_version_it_describes(store, tmp_path):
    """A rank that never saw the object takes the coordinating rank's layout; the object is
    replaced before this rank's first read: it must not read the new bytes under the old
    layout (it did: a same-size replacement loaded without a word)."""
    from metaseq_oneload import formats

    _, url = _put(store, tmp_path, "adopt")
    payload = formats.to_wire(mo.inspect(url), url)  # what the coordinating rank sends
    store.upload(_checkpoint(tmp_path / "new", 6), "trust", "adopt/checkpoint_1.pt")
    _storage.forget()  # this rank's process has seen nothing of the object
    layout = formats.adopt(payload, url)
    with pytest.raises(RemoteObjectChangedError, match=r"s3://trust/adopt/checkpoint_1\.pt"):
        mo.load_state_dict(layout, no_dist=True)


# --------------------------------------------------------------------------- every rank


def _replaced_mid_load(rank, world, url, proxy, key, new):
    import torch.distributed as dist

    import metaseq_oneload as mo

    if rank == 0:
        mo.inspect(url)  # its headers kept: the swap below waits for the load's first data read
    dist.barrier()
    if rank == 0:
        proxy_control(proxy, f"swap?key={key}&after=0&src={new}")
    dist.barrier()
    t0 = time.monotonic()
    try:
        mo.load_state_dict(url)
        return {"error": None}
    except DistributedLoadError as e:
        return {"error": str(e), "s": time.monotonic() - t0}


def test_every_rank_raises_when_an_object_changes_mid_load(store, tmp_path):
    from tests.distributed.harness import run_ranks

    _, url = _put(store, tmp_path, "ranks")
    new = _checkpoint(tmp_path / "new", 5)
    rows = run_ranks(2, _replaced_mid_load, url, store.url, "/trust/ranks/checkpoint_1.pt", str(new),
                     tmp_path=tmp_path, timeout=120)
    for r in rows:
        assert r["error"] and "RemoteObjectChangedError" in r["error"], r
        assert "s3://trust/ranks/checkpoint_1.pt" in r["error"], r
        assert r["s"] < 30, r
