"""Discovery once per cluster (issue 15): in a collective load one rank reads the headers
and sends the layout; the others check names, sizes and times only. Counted on real gloo
ranks (W=3) on a 24-file set, with and without the index convert leaves; each rank's
layout equals the one it discovers on its own, with its own paths."""

from __future__ import annotations

import os
import shutil

import metaseq_oneload as mo
from tests.conftest import FIXTURES, needs_fixtures
from tests.distributed.harness import run_ranks
from tests.distributed.workers import count_discovery

pytestmark = needs_fixtures


def test_headers_are_read_once_per_cluster(tmp_path):
    mo.convert(FIXTURES / "fsdp_dp3", tmp_path / "indexed" / "ck", shards=24, progress=False)
    shutil.copytree(tmp_path / "indexed", tmp_path / "plain")
    os.remove(tmp_path / "plain" / "ck.oneload-index.json")
    rows = run_ranks(3, count_discovery, [str(tmp_path / "plain"), str(tmp_path / "indexed")],
                     tmp_path=tmp_path, timeout=240)
    plain = [r[0] for r in rows]
    indexed = [r[1] for r in rows]
    # Without an index: rank 0 unpickles the 24 headers, nobody else any (not 3 x 24).
    assert [r["unpickled"] for r in plain] == [24, 0, 0], plain
    # With one: no header is unpickled anywhere, and only rank 0 checks the index.
    assert [r["unpickled"] for r in indexed] == [0, 0, 0], indexed
    assert [r["identities"] for r in indexed] == [24, 0, 0], indexed
    for r in plain + indexed:
        assert r["same_layout"] and r["paths_here"] and r["tensors"] == 30, r


def test_no_group_means_the_default_group_and_no_dist_means_alone(tmp_path):
    from tests.distributed.workers import default_group_load

    rows = run_ranks(3, default_group_load, tmp_path=tmp_path, timeout=240)
    # Collective by default: the 3 headers read by rank 0 only.
    assert [r["collective"]["headers"] for r in rows] == [3, 0, 0], rows
    # Alone: every rank reads its own 3.
    assert [r["alone"]["headers"] for r in rows] == [3, 3, 3], rows
    assert all("no_dist=True loads in this process alone" in r["refused"] for r in rows)
