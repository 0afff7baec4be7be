"""metaseq's own entry points on s3:// paths (issue 12, part 5): after install() they go
through the engine (before, every URL was handed back to metaseq, whose PathManager needs
an iopath handler for it). Real metaseq, one gloo rank, an S3 endpoint on 127.0.0.1; the
model reproduces the logits metaseq produced from the local files. Skips where metaseq is
not importable (it is not on PyPI)."""

from __future__ import annotations

import pytest

from tests.conftest import FIXTURES, needs_fixtures
from tests.distributed.harness import run_ranks
from tests.unit.test_metaseq_patch import _why_not

pytestmark = [needs_fixtures, pytest.mark.skipif(bool(_why_not()), reason=_why_not() or "metaseq available")]
s3_server = pytest.importorskip("tests.s3_server")


def s3_metaseq_worker(rank: int, world: int, urls: dict) -> dict:
    from tests.unit.test_metaseq_patch import logits_diff, setup_metaseq

    setup_metaseq(1)
    from metaseq import checkpoint_utils, file_io

    from metaseq_oneload import _storage, integrations

    integrations.install()
    out = {}
    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task([urls["singleton"] + "/checkpoint_2_consolidated.pt"])
    out["singleton"] = logits_diff(models[0], "singleton")
    # a flat FSDP set named by its un-suffixed name, merged for this one rank
    models, _, _ = checkpoint_utils.load_model_ensemble_and_task([urls["fsdp_dp3"] + "/checkpoint_2.pt"])
    out["fsdp_dp3"] = logits_diff(models[0], "fsdp_dp3")
    state = checkpoint_utils.load_checkpoint_to_cpu(urls["singleton"] + "/checkpoint_2_consolidated.pt")
    out["state_keys"] = sorted(state)
    out["torch_load_cpu"] = sorted(file_io.torch_load_cpu(urls["singleton"] + "/checkpoint_2_consolidated.pt"))
    out["fetched"] = _storage.stats()["bytes"]
    integrations.uninstall()
    return out


def test_metaseq_loads_s3_paths_through_the_engine(tmp_path, monkeypatch):
    ep = s3_server.S3Endpoint()
    try:
        urls = {n: ep.upload(FIXTURES / n, "ckpt", n) for n in ("singleton", "fsdp_dp3")}
        for k, v in ep.env().items():
            monkeypatch.setenv(k, v)
        out = run_ranks(1, s3_metaseq_worker, urls, tmp_path=tmp_path, timeout=240)[0]
    finally:
        ep.stop()
    assert out["singleton"] < 1e-5 and out["fsdp_dp3"] < 1e-5, out
    assert "cfg" in out["state_keys"] and "model" in out["state_keys"], out
    assert "model" in out["torch_load_cpu"] and out["fetched"] > 0, out
