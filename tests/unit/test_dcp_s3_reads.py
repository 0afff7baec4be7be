"""What a DCP folder on S3 costs the store: describing it fetches each item's header bytes,
not 64 KiB of tensor bytes per item; loading it serves each byte about once, in few
requests, written in place; and an archive that does carry a zip comment (the one case
where the end record is not the last 22 bytes) is still read as torch reads it.

The store is moto on 127.0.0.1 behind the counting proxy of ``tests/s3_server.py``: the
bytes and GETs are counted there, independently of the code under test.
"""

from __future__ import annotations

import re
import zipfile

import pytest
import torch
import torch.distributed.checkpoint as dcp

import metaseq_oneload as mo
from metaseq_oneload import _storage
from metaseq_oneload._reading import read_header


def _folder(tmp_path):
    """A one-file folder of whole tensors, as ``dcp.save(no_dist=True)`` writes it: large
    items (1 MiB, a data read's worth) between small ones (what header batching meets)."""
    g = torch.Generator().manual_seed(0)
    sd = {}
    for i in range(6):
        sd[f"layers.{i}.weight"] = torch.randn(512, 512, generator=g)
        sd[f"layers.{i}.bias"] = torch.randn(512, generator=g)
    dcp.save(sd, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    return tmp_path / "ck", sd


@pytest.fixture(scope="module")
def endpoint():
    from tests.s3_server import running_endpoint

    yield from running_endpoint()


def test_describing_a_folder_fetches_each_items_header_not_its_tail(endpoint, tmp_path, monkeypatch):
    from tests.s3_server import apply_env

    folder, sd = _folder(tmp_path)
    url = endpoint.upload(folder, "dcp-reads", "describe")
    apply_env(endpoint.env(), monkeypatch)
    _storage.forget()
    endpoint.reset()
    layout = mo.inspect(url)
    assert layout.fingerprint() == mo.inspect(folder).fingerprint()
    c = endpoint.counters
    distcp = sum(n for k, n in c.bytes_by_key.items() if k.endswith(".distcp"))
    # each item: its first 4 KiB and its last 4 KiB, a neighbour's in the same request (and
    # one 16 KiB fetch at the file's end); the zip's 64 KiB tail read fetched 80 KiB per item
    assert distcp <= len(sd) * (8 << 10) + (16 << 10), (distcp, len(sd))


def test_a_load_serves_each_byte_about_once_in_few_requests(endpoint, tmp_path, monkeypatch):
    from tests.s3_server import apply_env

    folder, sd = _folder(tmp_path)
    url = endpoint.upload(folder, "dcp-reads", "load")
    apply_env(endpoint.env(), monkeypatch)
    _storage.forget()
    endpoint.reset()
    got = mo.load_state_dict(url, no_dist=True)
    assert set(got) == set(sd) and all(torch.equal(got[k], sd[k]) for k in sd)
    c = endpoint.counters
    files = sum(p.stat().st_size for p in folder.glob("*.distcp"))
    assert c.body_bytes <= 1.05 * files + (64 << 10), (c.body_bytes, files)
    # the header batches, then about one request per 1 MiB weight (its bias rides along)
    assert c.gets <= 2 * len(sd) + 4, c.gets


def test_an_archive_with_a_zip_comment_reads_as_torch_reads_it(tmp_path):
    # (every archive torch.save writes has none: this is the path that reads the longer tail)
    t = torch.arange(1000, dtype=torch.float32)
    path = tmp_path / "commented.pt"
    torch.save({"w": t}, path)
    with zipfile.ZipFile(path, "a") as z:
        z.comment = b"a comment ends the archive after its end record" * 20
    assert torch.load(path, weights_only=True)["w"].equal(t)
    assert read_header(str(path))["w"].shape == t.shape
    assert torch.equal(mo.load_state_dict(str(path), no_dist=True)["w"], t)


def test_a_large_part_is_written_in_place_as_it_arrives(endpoint, tmp_path, monkeypatch):
    import tracemalloc

    from tests.s3_server import apply_env

    data = torch.randn(3 << 20, generator=torch.Generator().manual_seed(1))  # 12 MiB
    path = tmp_path / "blob.bin"
    path.write_bytes(data.numpy().tobytes())
    url = endpoint.upload(path, "dcp-reads", "blob.bin")
    apply_env(endpoint.env(), monkeypatch)
    monkeypatch.setenv("METASEQ_ONELOAD_REMOTE_CONCURRENCY", "1")
    _storage.forget()
    out = torch.empty_like(data)
    _storage.stat(url)  # (pinned before measuring)
    tracemalloc.start()
    got = _storage.read_into(url, 0, memoryview(out.numpy()).cast("B"))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert got == data.numel() * 4 and torch.equal(out, data)
    # parts of 8 MiB, one at a time: a part's body held whole (and copied) was 16 MiB
    assert peak < (3 << 20), peak


def _many_small(tmp_path, n=40, numel=80_000):
    """A one-file folder of many adjacent items of ~312 KiB each (above the read-ahead's
    small reads): one request each until neighbouring reads shared them."""
    g = torch.Generator().manual_seed(2)
    sd = {f"blocks.{i}.w": torch.randn(numel, generator=g) for i in range(n)}
    dcp.save(sd, checkpoint_id=str(tmp_path / "many"), no_dist=True)
    return tmp_path / "many", sd


def test_neighbouring_items_share_requests(endpoint, tmp_path, monkeypatch):
    import math

    from tests.s3_server import apply_env

    folder, sd = _many_small(tmp_path)
    url = endpoint.upload(folder, "dcp-reads", "many")
    apply_env(endpoint.env(), monkeypatch)
    monkeypatch.setenv("METASEQ_ONELOAD_REMOTE_PART_MB", "2")
    _storage.forget()
    mo.inspect(url)  # (the header reads, counted apart)
    endpoint.reset()
    _storage.reset_stats()
    got = mo.load_state_dict(url, no_dist=True)
    assert set(got) == set(sd) and all(torch.equal(got[k], sd[k]) for k in sd)
    c = endpoint.counters
    data = sum(t.numel() * t.element_size() for t in sd.values())
    files = sum(p.stat().st_size for p in folder.glob("*.distcp"))
    # one ranged GET per 2 MiB part of the merged run (and what discovery asks again),
    # where there was one per item (40)
    assert c.gets <= math.ceil(data / (2 << 20)) + 6, c.gets
    assert c.body_bytes <= 1.05 * files, (c.body_bytes, files)
    # the counters say what the store served of the data files, the gaps between items included
    distcp = sum(n for k, n in c.bytes_by_key.items() if k.endswith(".distcp"))
    assert data < distcp <= _storage.stats()["bytes"] <= c.body_bytes, (data, distcp, _storage.stats(), c.body_bytes)


@pytest.mark.parametrize("mode", ["short_body", "other_range"])
def test_a_wrong_answer_to_a_merged_read_fails_as_any_read_does(endpoint, tmp_path, monkeypatch, mode):
    from metaseq_oneload._errors import RemoteStoreError
    from tests.s3_server import apply_env

    folder, sd = _many_small(tmp_path, n=8)
    url = endpoint.upload(folder, "dcp-reads", f"bad-{mode}")
    apply_env(endpoint.env(), monkeypatch)
    _storage.forget()
    mo.inspect(url)
    endpoint.misbehave(mode, key=f"/dcp-reads/bad-{mode}/__0_0.distcp")
    try:
        with pytest.raises(RemoteStoreError) as e:
            mo.load_state_dict(url, no_dist=True)
    finally:
        endpoint.misbehave("")
    # the request that was refused is a merged one: more bytes than any one item's
    m = re.search(r"read of bytes (\d+)-(\d+)", str(e.value))
    assert m and int(m.group(2)) + 1 - int(m.group(1)) > 2 * 80_000 * 4, str(e.value)


def test_announced_reads_in_any_order_keep_at_most_two_spans(endpoint, tmp_path, monkeypatch):
    import tracemalloc

    from tests.s3_server import apply_env

    data = torch.randn(3 << 20, generator=torch.Generator().manual_seed(3))  # 12 MiB
    path = tmp_path / "spans.bin"
    path.write_bytes(data.numpy().tobytes())
    url = endpoint.upload(path, "dcp-reads", "spans.bin")
    apply_env(endpoint.env(), monkeypatch)
    _storage.forget()
    _storage.stat(url)
    piece = 300 << 10
    # three runs of four adjacent reads, 4 MiB apart: three spans of 1.2 MiB
    reads = [(g * (4 << 20) + i * piece, piece) for g in range(3) for i in range(4)]
    order = [reads[g * 4 + i] for i in range(4) for g in range(3)]  # hopping between the runs
    raw = data.numpy().tobytes()
    endpoint.reset()
    tracemalloc.start()
    with _storage.expecting([(url, a, n) for a, n in reads]):
        for a, n in order:
            buf = bytearray(n)
            assert _storage.read_into(url, a, memoryview(buf)) == n
            assert bytes(buf) == raw[a:a + n], a
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    # a span each for the first reads of the runs; the third let the first go (two kept),
    # whose three later reads went alone; the other two runs were served from their spans
    assert endpoint.counters.gets == 3 + 3, endpoint.counters.gets
    # two spans' buffers, an answer's piece in flight (1 MiB), this test's own buffers
    assert peak < 2 * 4 * piece + (1 << 20) + 3 * piece + (256 << 10), peak


def test_a_span_being_fetched_when_the_spans_are_cleared_keeps_no_buffer(endpoint, tmp_path, monkeypatch):
    """``_storage.forget`` clears the spans while a read may be fetching one (another
    thread's load): that span is dead from then on, as ``drop`` makes an object's spans, so
    its buffer is not kept among the held ones once its answer comes."""
    import threading

    from tests.s3_server import apply_env

    raw = bytes(range(256)) * 4096  # 1 MiB
    path = tmp_path / "clear.bin"
    path.write_bytes(raw)
    url = endpoint.upload(path, "dcp-reads", "clear.bin")
    apply_env(endpoint.env(), monkeypatch)
    _storage.forget()
    _storage.stat(url)
    fetching, go = threading.Event(), threading.Event()
    real = _storage._read_parts

    def held_back(*a, **k):  # the span's fetch, held until the spans were cleared
        fetching.set()
        assert go.wait(30)
        return real(*a, **k)

    monkeypatch.setattr(_storage, "_read_parts", held_back)
    buf = bytearray(1000)
    got: list = []
    with _storage.expecting([(url, 0, 1000), (url, 1000, 1000)]):  # one span of both
        t = threading.Thread(target=lambda: got.append(_storage.read_into(url, 0, memoryview(buf))))
        t.start()
        assert fetching.wait(30)
        _storage._SPANS.clear()
        go.set()
        t.join(30)
        assert got == [1000] and bytes(buf) == raw[:1000]
        assert not _storage._SPANS._held
