"""Object storage on real gloo ranks (issue 12, part 5): 2 ranks of one process group load
``s3://`` checkpoints from an S3 endpoint on 127.0.0.1 (moto behind a counting proxy, in a
process of its own), collectively, and get what the same load from the local files gives;
a missing object, and a store that stops answering mid-load, are a clear error on every
rank, not a hang."""

from __future__ import annotations

from tests.conftest import FIXTURES, needs_fixtures
from tests.distributed.harness import run_ranks
from tests.s3_server import S3Endpoint

pytestmark = needs_fixtures


def _remote_loads(rank, world, urls, proxy):
    import torch

    import metaseq_oneload as mo
    from metaseq_oneload import DistributedLoadError, _storage
    from tests.conftest import FIXTURES

    def same(a, b):
        return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in b)

    out = {}
    # the default group: collective; rank 0 discovers, rank 1 adopts its layout
    _storage.reset_stats()
    got = mo.load_state_dict(urls["fsdp_dp3"] + "/checkpoint_last-model_part-0-shard1.pt")
    out["full"] = same(got, mo.load_state_dict(FIXTURES / "fsdp_dp3", no_dist=True))
    out["full_stats"] = _storage.stats()
    # flat FSDP shards for a world of 2 from a set saved by 3
    lc = mo.load_checkpoint(urls["fsdp_dp3"], flat=True)
    ref = mo.load_checkpoint(FIXTURES / "fsdp_dp3", flat=True)
    out["flat"] = same(lc.model, ref.model) and lc.report.strategy == ref.report.strategy
    out["flat_bytes"] = [lc.report.bytes_read, ref.report.bytes_read]
    # model parallel 2 merged on each rank
    out["mp"] = same(mo.load_state_dict(urls["mp2_ddp"]), mo.load_state_dict(FIXTURES / "mp2_ddp", no_dist=True))
    # a missing object: every rank raises, naming it
    try:
        mo.load_state_dict(urls["fsdp_dp3"] + "/checkpoint_7.pt")
        out["missing"] = "loaded"
    except DistributedLoadError as e:  # what every rank raises when any rank cannot go on
        out["missing"] = str(e)
    # the store stops answering (503 to every ranged read): retries run out, every rank stops
    import os

    import torch.distributed as dist

    from tests.s3_server import proxy_control

    os.environ["METASEQ_ONELOAD_REMOTE_RETRIES"] = "1"
    dist.barrier()
    if rank == 0:
        proxy_control(proxy, "fail?n=1000000")
    dist.barrier()
    try:
        mo.load_state_dict(urls["mp2_ddp"])
        out["down"] = "loaded"
    except DistributedLoadError as e:
        out["down"] = str(e)
    dist.barrier()
    if rank == 0:
        proxy_control(proxy, "reset")
    return out


def test_two_ranks_load_from_s3(tmp_path, monkeypatch):
    ep = S3Endpoint()
    try:
        urls = {name: ep.upload(FIXTURES / name, "ckpt", name) for name in ("fsdp_dp3", "mp2_ddp")}
        for k, v in ep.env().items():
            monkeypatch.setenv(k, v)
        rows = run_ranks(2, _remote_loads, urls, ep.url, tmp_path=tmp_path, timeout=180)
    finally:
        ep.stop()
    for r in rows:
        assert r["full"] and r["flat"] and r["mp"], r
        assert r["flat_bytes"][0] == r["flat_bytes"][1] > 0, r
        assert "failed on 2 rank(s) (0, 1)" in r["missing"], r
        assert r["missing"].count("CheckpointNotFoundError: s3://ckpt/fsdp_dp3/checkpoint_7.pt: no such file") == 2, r
        assert "loading s3://ckpt/mp2_ddp:" in r["down"] and "failed on 2 rank(s) (0, 1)" in r["down"], r
        assert r["down"].count("failed after 2 tries (OSError: [Errno 16] Service is unable") >= 2, r
    # only the coordinator reads pickles; the other rank fetches its files' zip directories
    # and its tensor bytes
    print("\nper-rank fetched bytes:", [r["full_stats"]["bytes"] for r in rows])
