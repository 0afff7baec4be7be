"""`metaseq-oneload plan`: the table, --json, and clear errors; the load itself is held to the
plan in tests/distributed/test_load_plan.py."""

import json

import pytest

from metaseq_oneload.cli import main
from tests.conftest import FIXTURES, needs_fixtures

pytestmark = needs_fixtures


def test_table_says_strategy_reads_and_ranks(capsys):
    assert main(["plan", str(FIXTURES / "fsdp_dp3"), "--world", "2", "--flat"]) == 0
    out = capsys.readouterr().out
    assert "target      world 2 = 1 model-parallel x 2 data-parallel, flat" in out
    assert "strategy    reshard: saved 3 shard(s) per part != 2 data-parallel rank(s)" in out
    assert "network     0 B between ranks" in out
    assert out.count("\n0     0     0   ") == 1 and "\n1     0     1   " in out


def test_json_per_rank(capsys):
    assert main(["plan", str(FIXTURES / "singleton"), "-w", "3", "--strategy", "broadcast", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["strategy"] == "broadcast" and [r["rank"] for r in d["ranks"]] == [0, 1, 2]
    reader, *receivers = d["ranks"]
    assert reader["bytes_read"] > 0 and reader["files"] and all(r["bytes_read"] == 0 for r in receivers)
    assert all(r["bytes_received"] >= r["bytes_out"] for r in receivers)  # whole buckets, padding included
    assert d["network_bytes"] == sum(r["bytes_received"] for r in receivers) == reader["bytes_sent"]


@pytest.mark.parametrize("bucket_mb", [None, 1.5, 1e12])  # 1e12: sized by the checkpoint, not the option
def test_broadcast_peak_is_the_bucket_the_engine_allocates(capsys, monkeypatch, bucket_mb):
    """The plan's extra memory for a broadcast is what the engine's broadcast loop really
    allocates beyond the outputs (its staging bucket), at the default size and another:
    measured on the engine, not restated from the formula."""
    import torch

    import metaseq_oneload as mo

    flag = [] if bucket_mb is None else ["--bucket-mb", str(bucket_mb)]
    assert main(["plan", str(FIXTURES / "singleton"), "-w", "3", "--strategy", "broadcast", "--json"] + flag) == 0
    d = json.loads(capsys.readouterr().out)
    # The same load on one process runs the same broadcast loop (every rank allocates the same).
    staged, real = [], torch.empty

    def recording(*args, **kw):
        t = real(*args, **kw)
        if t.dtype == torch.uint8:  # the engine's staging bytes; outputs have the tensors' dtypes
            staged.append(t.numel())
        return t

    monkeypatch.setattr(torch, "empty", recording)
    kw = {} if bucket_mb is None else {"bucket_mb": bucket_mb}
    mo.load_state_dict(FIXTURES / "singleton", strategy="broadcast", progress=False, **kw)
    monkeypatch.undo()
    assert staged, "the broadcast loop allocated no bucket"
    assert sum(staged) <= d["model_bytes"] + 4096, staged
    assert [r["peak_extra_bytes"] for r in d["ranks"]] == [sum(staged)] * 3, (staged, d["ranks"])


def test_full_weights_on_one_node_read_through_its_page_cache(capsys):
    from metaseq_oneload._nodes import page_cache_view

    assert main(["plan", str(FIXTURES / "singleton"), "-w", "3", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    one = d["ranks"][0]["bytes_read"]
    assert [r["bytes_read"] for r in d["ranks"]] == [one] * 3 and d["network_bytes"] == 0
    if page_cache_view([str(FIXTURES / "singleton" / "checkpoint_2_consolidated.pt")])["shared"]:
        # each rank reads its own copy; the storage serves the bytes once
        assert d["storage_bytes"] == one and "page cache" in d["reason"] and d["strategy"] == "reshard"
    else:  # no page cache to count on: read once among the ranks and exchanged
        assert d["strategy"] == "parallel"
    assert main(["plan", str(FIXTURES / "singleton"), "-w", "3", "--strategy", "parallel", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["bytes_read"] == d["storage_bytes"] == one and d["network_bytes"] == 2 * one


def test_own_shard_reads_each_rank_its_file(capsys):
    assert main(["plan", str(FIXTURES / "shard_only"), "-w", "2", "--flat", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["strategy"] == "own_shard" and d["network_bytes"] == 0
    assert [r["files"][0].endswith(f"shard{r['rank']}.pt") for r in d["ranks"]] == [True, True]


@pytest.mark.parametrize("argv,message", [
    (["-w", "3", "-m", "2"], "the world must be a positive multiple of the model-parallel size"),
    (["-w", "2", "--strategy", "own_shard"], "--strategy own_shard needs the saved layout to match the world"),
])
def test_errors(capsys, argv, message):
    assert main(["plan", str(FIXTURES / "fsdp_dp3")] + argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("metaseq-oneload plan: error: ") and message in err


def test_a_closed_pipe_stops_quietly():
    """`metaseq-oneload plan ... --json | head`: a 512-rank plan is longer than a pipe holds."""
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-m", "metaseq_oneload", "plan", str(FIXTURES / "fsdp_dp3"), "-w", "512",
                          "--flat", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout.read(10)
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141 and "Traceback" not in err and "Error" not in err, err


def _plan_json(capsys, *flags) -> dict:
    assert main(["plan", str(FIXTURES / "singleton"), "-w", "4", "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)


def test_nodes_and_their_storage_are_described(capsys):
    """The topology is described, not joined: two nodes on one shared storage read each byte
    once for the cluster and each node receives the rest once; nodes with their own copies
    read them there and send nothing; a node that sees nothing receives every byte once."""
    shared = _plan_json(capsys, "--nodes", "2", "--storage", "shared")
    model = shared["model_bytes"]
    assert shared["strategy"] == "parallel" and shared["storage_bytes"] == model
    assert [r["node"] for r in shared["ranks"]] == [0, 0, 1, 1]
    assert sum(r["bytes_from_other_nodes"] for r in shared["ranks"]) == model
    own = _plan_json(capsys, "--ranks-per-node", "2", "--storage", "private")
    assert own["network_bytes"] == 0 and own["storage_bytes"] == 2 * model
    assert "every node has a copy on a disk of its own" in own["reason"], own["reason"]
    blind = _plan_json(capsys, "--nodes", "2", "--storage", "private", "--blind-node", "1")
    assert blind["strategy"] == "parallel" and "ranks 2, 3 cannot see the files" in blind["reason"]
    assert [r["bytes_read"] for r in blind["ranks"]][2:] == [0, 0]
    assert sum(r["bytes_from_other_nodes"] for r in blind["ranks"]) == model  # crosses once, to a relay


def test_a_topology_that_does_not_divide_is_refused(capsys):
    assert main(["plan", str(FIXTURES / "singleton"), "-w", "4", "--nodes", "3"]) == 2
    assert "--world 4, --nodes 3: every node runs as many ranks" in capsys.readouterr().err


@pytest.mark.parametrize("fixture, argv", [("singleton", ["-w", "2"]), ("fsdp_dp3", ["-w", "2", "--flat"]),
                                           ("mp2_ddp", ["-w", "2", "-m", "2"])])
def test_each_rank_s_reads_name_the_file_byte_range_and_destination(capsys, fixture, argv):
    """The plan's reads are (file, byte range, target piece): their bytes add up to what the
    rank reads, lie inside the file, and, where one read takes a piece whole, are the
    stored values torch.load finds for that piece (read back from the file here)."""
    import os

    import torch

    from tests.conftest import raw_load

    assert main(["plan", str(FIXTURES / fixture), *argv, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    checked = 0
    for r in d["ranks"]:
        reads = r["file_reads"]
        assert sum(f["nbytes"] for f in reads) == r["bytes_read"] and sum(f["reads"] for f in reads) == r["reads"]
        for f in reads:
            assert 0 <= f["first"] < f["end"] <= os.path.getsize(f["path"]), f
            assert f["end"] - f["first"] >= f["nbytes"] and f["stop"] > f["start"]
            stored = dict(raw_load(f["path"])["model"])
            t = stored.get(f["name"])
            if t is None or f["reads"] != 1 or f["end"] - f["first"] != (f["stop"] - f["start"]) * t.element_size():
                continue  # renamed, split or stored flat: the value check needs a piece stored as it is loaded
            with open(f["path"], "rb") as fh:
                fh.seek(f["first"])
                got = torch.frombuffer(bytearray(fh.read(f["end"] - f["first"])), dtype=t.dtype)
            assert torch.equal(got, t.reshape(-1)[f["start"]: f["stop"]]), f
            checked += 1
    assert checked > 0
