"""How a read of an object on S3 is cut into requests: parts of ``4 * ttfb * rate`` bytes
(clamped to 8 .. 32 MiB), from what this process measured of the endpoint's answers, where
the user did not set ``METASEQ_ONELOAD_REMOTE_PART_MB``; exactly that size where they did.

The store is moto on 127.0.0.1 behind the counting proxy of ``tests/s3_server.py``, told to
hold every ranged GET's answer back before its first byte (a store whose requests cost more
than their bytes): the GETs are counted there, independently of the code under test.
"""

from __future__ import annotations

import math

import pytest
import torch

import metaseq_oneload as mo
from metaseq_oneload import _remote, _storage
from metaseq_oneload._errors import RemoteStoreError

MiB = 1 << 20
SIZE = 20 * MiB  # 3 parts of 8 MiB; one of the largest the rule gives
DELAY_S = 0.3  # what moto itself takes per GET on this machine (docs/dcp.md, Benchmark)


@pytest.fixture(scope="module")
def endpoint():
    from tests.s3_server import running_endpoint

    yield from running_endpoint()


@pytest.fixture
def blob(endpoint, tmp_path, monkeypatch):
    """(url, bytes) of a 20 MiB object, the environment pointing at the endpoint, nothing
    measured yet, every ranged GET answered DELAY_S late."""
    from tests.s3_server import apply_env

    data = torch.randint(0, 256, (SIZE,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    path = tmp_path / "blob.bin"
    path.write_bytes(data.numpy().tobytes())
    url = endpoint.upload(path, "part-size", "blob.bin")
    apply_env(endpoint.env(), monkeypatch)
    monkeypatch.delenv("METASEQ_ONELOAD_REMOTE_PART_MB", raising=False)
    _storage.forget()
    _storage.stat(url)  # (pinned before counting)
    endpoint.reset()
    endpoint.delay(DELAY_S)
    yield url, path.read_bytes()
    endpoint.reset()  # (the delay too)
    _storage.forget()


def _read_all_counted(endpoint, url: str) -> tuple:
    """(bytes read by one read of the whole object, ranged GETs the proxy relayed for it)."""
    before = endpoint.counters.ranged_gets
    buf = bytearray(SIZE)
    got = _storage.read_into(url, 0, memoryview(buf))
    assert got == SIZE
    return bytes(buf), endpoint.counters.ranged_gets - before


# --------------------------------------------------------------------------- the rule


def test_the_rule_gives_four_times_the_wait_times_the_rate_clamped_to_8_32_mib():
    assert _remote.part_size(None, None) == _remote.PART_DEFAULT == 8 * MiB
    assert _remote.part_size(0.3, None) == _remote.part_size(None, 1e9) == 8 * MiB  # half known: the default
    # real S3: 10 ms at 100 MB/s is 4 MB, under the floor; 50 ms at 100 MB/s is 20 MB
    assert _remote.part_size(0.010, 100e6) == 8 * MiB
    assert _remote.part_size(0.050, 100e6) == 19 * MiB  # (whole MiB, rounded down)
    # this endpoint: 0.3 s before a byte, then memory speed: the cap
    assert _remote.part_size(0.3, 2e9) == _remote.PART_CAP == 32 * MiB
    assert _remote.part_size(0.3, float("inf")) == 32 * MiB
    assert _remote.part_size(0.0, 1e9) == 8 * MiB
    assert _remote.part_size(0.05, 100e6, floor=1 * MiB, cap=16 * MiB) == 16 * MiB
    assert _remote.part_size(0.001, 100e6, floor=1 * MiB, cap=16 * MiB) == 1 * MiB


def test_an_estimate_is_the_median_of_the_last_answers_and_needs_three():
    pace = _remote._Pace()
    key = ("pid", "s3", "{}")
    pace.record(key, 8 * MiB, 0.05, 0.1)
    pace.record(key, 8 * MiB, 0.05, 0.1)
    assert pace.estimate(key) == (None, None)  # two answers: not yet
    pace.record(key, 8 * MiB, 5.0, 10.0)  # one answer very slow to come, and to stream
    ttfb, rate = pace.estimate(key)
    assert ttfb == 0.05 and rate == 8 * MiB / 0.1  # the slow one moved nothing
    pace.record(key, 4096, 0.05, 0.0)  # a small body: its wait counts, its rate does not
    assert pace.estimate(key) == (0.05, 8 * MiB / 0.1)
    assert pace.estimate(("pid", "s3", '{"endpoint_url": "elsewhere"}')) == (None, None)
    for _ in range(_remote._PACE_KEEP):  # only the last few count
        pace.record(key, 8 * MiB, 0.2, 0.1)
    assert pace.estimate(key)[0] == 0.2


# --------------------------------------------------------------------------- on the endpoint


def test_once_requests_are_found_costly_a_large_read_takes_fewer_larger_gets(endpoint, blob):
    url, want = blob
    assert _remote.estimates(url) == (None, None)
    assert _remote.part_size_for(url) == 8 * MiB  # nothing measured: the default
    got, gets = _read_all_counted(endpoint, url)
    assert got == want
    assert gets == math.ceil(SIZE / (8 * MiB)) == 3
    # each of those answers waited DELAY_S for its first byte, then streamed on 127.0.0.1
    ttfb, rate = _remote.estimates(url)
    # (what the rule needs of them for parts over SIZE / 2: a rate of 9 MB/s, which even a
    # loaded machine's loopback through the Python proxy exceeds many times)
    assert ttfb >= DELAY_S and _remote._PACE_K * ttfb * rate > SIZE / 2 + MiB, (ttfb, rate)
    got, gets = _read_all_counted(endpoint, url)
    assert got == want
    assert gets < 3, gets  # 8 MiB parts would have taken 3 again
    assert _remote.part_size_for(url) > SIZE / 2
    # the bytes the proxy served are those of the two reads: larger parts, not more bytes
    assert endpoint.counters.body_bytes == 2 * SIZE


def test_a_part_size_the_user_set_is_used_exactly(endpoint, blob, monkeypatch):
    url, want = blob
    _read_all_counted(endpoint, url)  # (measured: costly requests)
    assert _remote.part_size_for(url) > SIZE / 2
    for mb, parts in (("8", 3), ("4", 5), ("2.5", 8)):
        monkeypatch.setenv("METASEQ_ONELOAD_REMOTE_PART_MB", mb)
        got, gets = _read_all_counted(endpoint, url)
        assert got == want and gets == parts, (mb, gets)
        assert _remote.part_size_for(url) == int(float(mb) * MiB)
    monkeypatch.setenv("METASEQ_ONELOAD_REMOTE_PART_MB", "64")  # above the rule's cap: as set
    assert _remote.part_size_for(url) == 64 * MiB
    got, gets = _read_all_counted(endpoint, url)
    assert got == want and gets == 1


def test_a_wrong_answer_to_a_larger_part_fails_as_any_read_does(endpoint, blob):
    url, _ = blob
    _read_all_counted(endpoint, url)
    size = _remote.part_size_for(url)
    assert size > SIZE / 2
    endpoint.misbehave("short_body", key="/part-size/blob.bin")
    try:
        # one request for the whole read, refused: the answer's length is checked as always
        with pytest.raises(RemoteStoreError, match=rf"bytes 0-{SIZE - 1} wrongly: it announced {SIZE - 7} bytes"):
            _storage.read_into(url, 0, memoryview(bytearray(SIZE)))
    finally:
        endpoint.misbehave("")


def test_a_load_of_neighbouring_items_merges_them_into_one_get_once_measured(endpoint, blob, tmp_path):
    """Through the engine: a one-file DCP folder of adjacent 5 MiB items is read as merged
    spans (``_storage.expecting``), one GET per part of each span."""
    import torch.distributed.checkpoint as dcp

    url, _ = blob
    g = torch.Generator().manual_seed(6)
    sd = {f"blocks.{i}.w": torch.randn(5 * MiB // 4, generator=g) for i in range(5)}
    dcp.save(sd, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    folder = endpoint.upload(tmp_path / "ck", "part-size", "ck")
    _read_all_counted(endpoint, url)  # (measured: costly requests)
    mo.inspect(folder)  # (the header reads, counted apart)
    before = endpoint.counters.ranged_gets
    got = mo.load_state_dict(folder, no_dist=True)
    assert set(got) == set(sd) and all(torch.equal(got[k], sd[k]) for k in sd)
    # 25 MiB in one span: 1 GET (4 in 8 MiB parts); what discovery asks again aside
    assert endpoint.counters.ranged_gets - before <= 2, endpoint.counters.ranged_gets - before
