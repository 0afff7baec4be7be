"""Two nodes on one machine: two torchrun agents (``--nnodes 2 --nproc-per-node 2``, a c10d
rendezvous on 127.0.0.1), each node seeing its own copy of the checkpoints, or one node
seeing none, or both one object store. Where the nodes share one storage (the store), or
one sees nothing, or ``parallel`` is asked for, every byte is read from storage once for the
cluster and crosses between the nodes at most once per node; a node with its own copy on
its own disk reads it there. Every rank ends with exactly the weights."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench._synth import materialize, metaseq_lm, write_metaseq
from tests.conftest import FIXTURES, assert_matches_reference, needs_fixtures, reference_weights

pytestmark = needs_fixtures
REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _agents(out: Path, root: Path, extra_env: dict, timeout: float = 300) -> list:
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1", METASEQ_ONELOAD_NODE="", **extra_env)
    env.pop("METASEQ_ONELOAD_NODE")
    # The rendezvous store lives here, not in one of the agents: an agent that hosts it and
    # is done first takes it away while the other still passes torchrun's exit barrier.
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # noqa: F841
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"oneload-{port}",
           "--rdzv-conf", "is_host=false",
           "--max-restarts", "0", str(REPO / "tests" / "distributed" / "node_worker.py"), str(out), str(root)]
    logs = [open(out / f"agent{i}.log", "w") for i in range(2)]
    # Each agent leads a session of its own: on a hang, its workers go with it.
    procs = [subprocess.Popen(cmd, env=env, stdout=logs[i], stderr=subprocess.STDOUT, cwd=REPO,
                              start_new_session=True) for i in range(2)]
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        pytest.fail("the two torchrun agents did not finish: a hang\n" + _tail(out))
    finally:
        for f in logs:
            f.close()
    if any(codes):
        pytest.fail(f"torchrun agents exited with {codes}\n" + _tail(out))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


def _tail(out: Path) -> str:
    return "\n".join(f"--- agent {i}\n" + (out / f"agent{i}.log").read_text()[-4000:] for i in range(2))


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("two-nodes")
    big = metaseq_lm(layers=3, dim=256, ffn=1024, vocab=2048, positions=256)  # ~12 MB fp32
    src = tmp / "src"
    (src / "big").mkdir(parents=True)
    write_metaseq(str(src / "big" / "synth"), big)
    for name in ("singleton", "fsdp_dp3"):
        shutil.copytree(FIXTURES / name, src / name)
    for n in (0, 1):  # each node its own copy (copytree keeps the times, as rsync -a does)
        shutil.copytree(src, tmp / f"node{n}")
    out = tmp / "out"
    out.mkdir()
    # One storage behind both nodes: an S3 endpoint on 127.0.0.1 (moto behind a proxy that
    # counts the bytes it serves), where it can run.
    endpoint, env = None, {}
    try:
        from tests.s3_server import S3Endpoint

        endpoint = S3Endpoint()
        url = endpoint.upload(src / "big", "ckpt", "big")
        env = dict(endpoint.env(), ONELOAD_TEST_S3=url.rsplit("/", 1)[0], ONELOAD_TEST_S3_PROXY=endpoint.url)
    except (ImportError, pytest.skip.Exception) as e:
        print(f"no S3 endpoint ({e}): the shared-storage scenario is not run")
    try:
        results = _agents(out, tmp, env)
    finally:
        if endpoint is not None:
            endpoint.stop()
    yield results, out, materialize(big), os.path.getsize(src / "big" / "synth.pt")


def _rows(results, scenario):
    rows = [next((row for row in res["rows"] if row["scenario"] == scenario), None) for res in results]
    if None in rows:
        pytest.skip(f"{scenario}: not run (see the fixture's output)")
    return rows


def _weights(out, scenario, rank):
    return torch.load(out / f"{scenario.replace(' ', '_').replace(',', '')}-r{rank}.pt", weights_only=True)


def test_own_copies_on_own_disks_are_read_there(two_nodes):
    results, out, big, size = two_nodes
    rows = _rows(results, "own copies")
    model_bytes = rows[0]["bytes_out"]
    # Each node's copy lies on a disk of its own (this machine's ext4/xfs/overlay): its ranks
    # read it there, through its page cache, and nothing crosses between the nodes; a read
    # of the other node's copy over the network would take from no storage but the network.
    assert {r["strategy"] for r in rows} == {"reshard"}, rows  # 1 saved shard onto 4 ranks: no exchange
    assert "copy on a disk of its own" in rows[0]["reason"] and "page cache" in rows[0]["reason"], rows[0]["reason"]
    for r in rows:
        assert r["bytes_read"] == model_bytes and r["received"] == r["sent"] == r["from_other_nodes"] == 0, r
        assert r["rchar"] <= r["bytes_read"] + (1 << 20), r
    for rank in range(4):
        got = _weights(out, "own copies", rank)
        for k, v in big.items():
            assert torch.equal(got[k], v), (rank, k)


def test_one_shared_storage_is_read_once_for_the_cluster(two_nodes):
    results, out, big, size = two_nodes
    rows = _rows(results, "one object store")
    model_bytes = rows[0]["bytes_out"]
    assert {r["strategy"] for r in rows} == {"parallel"}, rows
    # what the store served (counted by the proxy, not by the engine): the model once, and
    # the headers inspection reads
    assert size <= rows[0]["served"] <= 1.05 * size + (256 << 10), (rows[0]["served"], size)


@pytest.mark.parametrize("scenario", ["one object store", "own copies, strict", "own copies, strict, no shared memory",
                                      "node 1 sees none"])
def test_read_once_per_cluster_each_node_receives_once(two_nodes, scenario):
    results, out, big, size = two_nodes
    rows = _rows(results, scenario)
    model_bytes = rows[0]["bytes_out"]  # flat=False: every rank holds the whole model
    assert {r["strategy"] for r in rows} == {"parallel"}, rows
    # (an object store has no page cache: inside a node, as across nodes, each byte is read once)
    strict = "strict" in scenario or "object store" in scenario
    by_node = {0: [], 1: []}
    for res, row in zip(results, rows):
        by_node[res["node"]].append(row)
    if strict:
        # Every byte read once in all, by the engine's count and by rchar (which counts gloo's
        # socket reads too: what arrived over a socket is taken off; what a node's ranks share
        # through /dev/shm is no read at all).
        assert sum(r["bytes_read"] for r in rows) == model_bytes
        sockets = sum(r["received"] if "no shared memory" in scenario else r["from_other_nodes"] for r in rows)
        if "object store" in scenario:  # rchar has botocore's model files, read at first use
            assert rows[0]["served"] <= 1.05 * size + (256 << 10)  # the proxy's count, the cluster's
        else:
            assert sum(r["rchar"] for r in rows) <= 1.05 * size + sockets + (1 << 20), [r["rchar"] for r in rows]
    else:
        # The ranks of a node each read what their node reads, through its page cache (one
        # storage read for the node, the repeat a copy out of the cache): the same bytes on
        # both, and by rchar no more (nothing but the node's share and what crossed sockets).
        assert "page cache" in rows[0]["reason"], rows[0]["reason"]
        for node_rows in by_node.values():
            assert len({r["bytes_read"] for r in node_rows}) == 1, node_rows
            # every rank receives exactly what its node did not read (from the other node, or
            # from its node's relay), nothing its node read
            assert all(r["received"] == model_bytes - r["bytes_read"] for r in node_rows), node_rows
        for r in rows:
            assert r["rchar"] <= r["bytes_read"] + r["from_other_nodes"] + (1 << 20), r
    for node, node_rows in by_node.items():
        # What this node read plus what crossed into the node covers the model, and nothing
        # crossed twice: at most what the node did not read itself.
        local = sum(r["bytes_read"] for r in node_rows) if strict else node_rows[0]["bytes_read"]
        crossed = sum(r["from_other_nodes"] for r in node_rows)
        assert crossed == model_bytes - local, (node, crossed, local, model_bytes)
    if scenario == "node 1 sees none":
        assert all(r["bytes_read"] == 0 for r in by_node[1])
        assert "cannot see the files" in rows[0]["reason"]
    else:  # both nodes read their share from their own copy
        assert all(r["bytes_read"] > 0 for r in rows)
    for rank in range(4):
        got = _weights(out, scenario, rank)
        for k, v in big.items():
            assert torch.equal(got[k], v), (rank, k)


def test_fsdp_shards_and_flat_onto_two_nodes(two_nodes):
    results, out, _, _ = two_nodes
    ref = reference_weights()
    rows = _rows(results, "own copies, fsdp shards")
    # Each node reads its own copy through its page cache: every rank the whole model, and
    # nothing crosses.
    assert all(r["bytes_read"] == r["bytes_out"] and r["from_other_nodes"] == 0 for r in rows), rows
    for rank in range(4):
        assert_matches_reference(_weights(out, "own copies, fsdp shards", rank), ref)
    for scenario in ("own copies, flat", "node 1 sees none, flat"):
        rows = _rows(results, scenario)
        # Flat shards are disjoint: the bytes read are the bytes held, once.
        assert sum(r["bytes_read"] for r in rows) <= sum(r["bytes_out"] for r in rows)
        shards = [_weights(out, scenario, rank) for rank in range(4)]
        assert {k for s in shards for k in s} == set(shards[0])
    blind = _rows(results, "node 1 sees none, flat")
    assert [r["bytes_read"] for r, res in zip(blind, results) if res["node"] == 1] == [0, 0]


@pytest.mark.parametrize("scenario,folder,rel,strategy,blind", [
    ("own copies", None, "big/synth.pt", "auto", ()),
    ("own copies, strict", None, "big/synth.pt", "parallel", ()),
    ("own copies, strict, no shared memory", None, "big/synth.pt", "parallel", ()),
    ("own copies, fsdp shards", None, "fsdp_dp3/checkpoint_2-model_part-0-shard0.pt", "auto", ()),
    ("node 1 sees none", "node0", "big/synth.pt", "auto", (1,)),
])
def test_the_plan_is_the_load_on_two_nodes(two_nodes, monkeypatch, scenario, folder, rel, strategy, blind):
    """What each rank's group executed is, value for value, what ``plan_load`` states for two
    nodes of two ranks (each with its own copy, or node 1 with none), as the coordinator (rank
    0, whose paths the plan names) sees the files."""
    from metaseq_oneload._loadplan import plan_load
    from metaseq_oneload._planner import from_wire

    results, out, _, _ = two_nodes
    rows = _rows(results, scenario)
    monkeypatch.setenv("METASEQ_ONELOAD_SHM", "0" if "no shared memory" in scenario else "1")
    seen = out.parent / (folder or f"node{results[0]['node']}") / rel
    plan = plan_load(seen, world=4, ranks_per_node=2, blind_nodes=blind, strategy=strategy)
    for rank, row in enumerate(rows):
        assert from_wire(row["plan"].encode()) == plan.part(0), (scenario, rank)
        assert row["bytes_read"] == plan.ranks[rank].bytes_read, (scenario, rank)
