"""The parallel strategy's plan (who reads which bytes, who sends what to whom), as a pure
function of every rank's wants: each wanted byte read once, balanced by bytes, a node's
share crossing between nodes once, and every rank ending with exactly its wants."""

from __future__ import annotations

import os
import tempfile

import pytest

from metaseq_oneload._exchange import cached_nodes, overlap, plan_exchange, private_nodes
from metaseq_oneload._nodes import page_cache_view


def _ranges(per_rank):
    """per_rank: [{name: [(start, stop), ...]}] -> the engine's gathered form."""
    return [{n: [[n, a, b, "float32", k] for k, (a, b) in enumerate(iv)] for n, iv in rr.items()} for rr in per_rank]


SIZES = {"a": 4, "b": 4, "c": 2}
NUMEL = {"a": 1000, "b": 300, "c": 5000}


def _simulate(plan, ranges, world):
    """Run the plan on paper: what each rank holds of each target afterwards."""
    holds = [{n: set() for n in NUMEL} for _ in range(world)]
    read = [{n: set() for n in NUMEL} for _ in range(world)]
    for rnd in plan.rounds:
        spans = {}
        for c in rnd:
            read[c.owner][c.name].update(range(c.lo, c.hi))
            spans[(c.name, c.lo, c.owner)] = set(range(c.lo, c.hi))
            have = {c.owner: set(range(c.lo, c.hi))}
            for r in c.self_read:  # read again out of the node's page cache: no storage read
                a, b = c.span_of(r)
                have[r] = set(range(a, b))
            for phase in (1, 2):
                for m in c.messages:
                    if m.phase != phase:
                        continue
                    part = set(range(m.lo, m.hi))
                    assert part <= have[m.src], (c, m)  # a rank sends only what it holds
                    have.setdefault(m.dst, set()).update(part)
            for r, got in have.items():
                holds[r][c.name].update(got)
    return holds, read


def _check(plan, ranges, world):
    holds, read = _simulate(plan, ranges, world)
    for r, rr in enumerate(ranges):
        for n, items in rr.items():
            for _, a, b, _, _ in items:
                assert set(range(a, b)) <= holds[r][n], (r, n, a, b)
    # every wanted element read exactly once, by one rank
    for n in NUMEL:
        wanted = set().union(*[set(range(a, b)) for rr in ranges for _, a, b, _, _ in rr.get(n, ())])
        counts = {}
        for r in range(world):
            for e in read[r][n]:
                counts[e] = counts.get(e, 0) + 1
        assert set(counts) == wanted and set(counts.values()) <= {1}, n
    return holds, read


def test_everyone_wants_everything_one_node():
    world = 4
    ranges = _ranges([{n: [(0, NUMEL[n])] for n in NUMEL} for _ in range(world)])
    plan = plan_exchange(list(NUMEL), SIZES, ranges, list(range(world)), ["h"] * world, chunk_bytes=1000)
    _check(plan, ranges, world)
    total = sum(NUMEL[n] * SIZES[n] for n in NUMEL)
    assert sum(plan.read_bytes) == total
    assert max(plan.read_bytes) - min(plan.read_bytes) <= 1000  # balanced to within one chunk
    assert plan.remote_bytes == (0,)
    wanted, union = overlap(ranges, SIZES)
    assert (wanted, union) == (world * total, total)


def test_two_nodes_each_byte_crosses_once_per_node():
    world, nodes = 4, ["n0", "n0", "n1", "n1"]
    ranges = _ranges([{n: [(0, NUMEL[n])] for n in NUMEL} for _ in range(world)])
    plan = plan_exchange(list(NUMEL), SIZES, ranges, list(range(world)), nodes, chunk_bytes=512)
    _check(plan, ranges, world)
    total = sum(NUMEL[n] * SIZES[n] for n in NUMEL)
    node_read = [plan.read_bytes[0] + plan.read_bytes[1], plan.read_bytes[2] + plan.read_bytes[3]]
    assert list(plan.remote_bytes) == [total - node_read[0], total - node_read[1]]
    for rnd in plan.rounds:
        for c in rnd:
            into = {}
            for m in c.messages:
                if nodes[m.src] != nodes[m.dst]:
                    into[nodes[m.dst]] = into.get(nodes[m.dst], 0) + 1
            assert all(v == 1 for v in into.values()), c  # one crossing per node per chunk


def test_only_the_ranks_that_see_the_files_read():
    world = 4
    ranges = _ranges([{n: [(0, NUMEL[n])] for n in NUMEL} for _ in range(world)])
    plan = plan_exchange(list(NUMEL), SIZES, ranges, [0, 2], ["n0", "n0", "n1", "n1"], chunk_bytes=700)
    _check(plan, ranges, world)
    assert plan.read_bytes[1] == plan.read_bytes[3] == 0 and plan.read_bytes[0] > 0 and plan.read_bytes[2] > 0


def test_disjoint_wants_are_read_by_their_owners_and_nothing_moves():
    world = 3
    per = [{"a": [(0, 400)], "c": [(0, 2000)]}, {"a": [(400, 800)], "c": [(2000, 4000)]},
           {"a": [(800, 1000)], "c": [(4000, 5000)]}]
    ranges = _ranges(per)
    plan = plan_exchange(list(NUMEL), SIZES, ranges, list(range(world)), ["h"] * world, chunk_bytes=256)
    _check(plan, ranges, world)
    assert all(not c.messages for rnd in plan.rounds for c in rnd)
    assert all(c.owner in {r for r, rr in enumerate(per) if any(a <= c.lo and c.hi <= b for a, b in rr[c.name])}
               for rnd in plan.rounds for c in rnd)


def test_replicated_beside_sharded_and_gaps():
    world = 3
    per = [{"a": [(0, 500)], "b": [(0, 300)]}, {"a": [(500, 1000)], "b": [(0, 300)]},
           {"a": [(100, 200), (700, 900)], "b": [(100, 150)]}]
    ranges = _ranges(per)
    plan = plan_exchange(list(NUMEL), SIZES, ranges, list(range(world)), ["x", "y", "z"], chunk_bytes=300)
    _check(plan, ranges, world)
    wanted, union = overlap(ranges, SIZES)
    assert union == (1000 + 300) * 4 and wanted > union


def test_rounds_take_one_batch_per_reader():
    world = 2
    ranges = _ranges([{n: [(0, NUMEL[n])] for n in NUMEL} for _ in range(world)])
    plan = plan_exchange(list(NUMEL), SIZES, ranges, [0, 1], ["h", "h"], chunk_bytes=2000)
    for rnd in plan.rounds:
        for r in (0, 1):
            assert sum((c.hi - c.lo) * SIZES[c.name] for c in rnd if c.owner == r) <= 2000


def test_no_reader_is_refused():
    with pytest.raises(ValueError):
        plan_exchange(["a"], SIZES, _ranges([{"a": [(0, 10)]}]), [], ["h"], 100)


# ---------------------------------------------------------------- nodes sharing a page cache


def _everything(world):
    return _ranges([{n: [(0, NUMEL[n])] for n in NUMEL}] * world)


def test_one_node_with_a_page_cache_moves_nothing():
    ranges = _everything(3)
    plan = plan_exchange(list(NUMEL), SIZES, ranges, [0, 1, 2], ["n"] * 3, 1000, frozenset({"n"}))
    assert not plan.moves  # each rank reads its own wants; the engine then reads plainly
    holds, _ = _simulate(plan, ranges, 3)
    assert all(holds[r][n] == set(range(NUMEL[n])) for r in range(3) for n in NUMEL)
    total = sum(NUMEL[n] * SIZES[n] for n in NUMEL)
    assert plan.storage_bytes == (total,) and plan.read_bytes == (total,) * 3


def test_two_cached_nodes_split_the_storage_and_cross_once():
    ranges = _everything(4)
    nodes = ["a", "a", "b", "b"]
    plan = plan_exchange(list(NUMEL), SIZES, ranges, [0, 1, 2, 3], nodes, 1000, frozenset({"a", "b"}))
    holds, read = _check(plan, ranges, 4)
    total = sum(NUMEL[n] * SIZES[n] for n in NUMEL)
    # each node pulls about half from storage; the other half crosses into it once
    assert sum(plan.storage_bytes) == total and max(plan.storage_bytes) <= 0.6 * total
    assert plan.remote_bytes == (total - plan.storage_bytes[0], total - plan.storage_bytes[1])
    for c in (c for rnd in plan.rounds for c in rnd):
        home = nodes[c.owner]
        # the owner's neighbour reads its own copy out of the cache; no message stays in a node
        # but a relay's hand-on of what crossed
        assert [r for r in c.self_read] == [r for r in (0, 1, 2, 3) if nodes[r] == home and r != c.owner]
        assert all(m.phase == 2 or nodes[m.dst] != home for m in c.messages), c
    # readers take contiguous runs, in node order (no interleaving for read-ahead to waste)
    owners = [c.owner for name in NUMEL for c in sorted((c for rnd in plan.rounds for c in rnd if c.name == name),
                                                          key=lambda c: c.lo)]
    assert owners == sorted(owners), owners


def test_a_blind_rank_on_a_cached_node_still_receives():
    ranges = _everything(3)
    plan = plan_exchange(list(NUMEL), SIZES, ranges, [0, 1], ["n"] * 3, 1000, frozenset({"n"}))
    assert plan.moves
    holds, _ = _simulate(plan, ranges, 3)
    assert all(holds[2][n] == set(range(NUMEL[n])) for n in NUMEL)
    assert all(m.dst == 2 for rnd in plan.rounds for c in rnd for m in c.messages)


def _view(shared=True, avail=1 << 40, why="", private=False, fs="nfs4"):
    return {"shared": shared, "why": why, "avail": avail, "private": private, "fs": fs}


def test_cached_nodes_needs_every_reader_cached_and_room_for_the_pages():
    ranges = _everything(4)
    nodes = ["a", "a", "b", "b"]
    total = sum(NUMEL[n] * SIZES[n] for n in NUMEL)
    ok, notes = cached_nodes([_view()] * 4, nodes, [0, 1, 2, 3], ranges, SIZES)
    assert ok == {"a", "b"} and not notes
    # node b: one rank reads around the page cache
    ok, notes = cached_nodes([_view(), _view(), _view(), _view(False, why="reads bypass the page cache (O_DIRECT)")],
                             nodes, [0, 1, 2, 3], ranges, SIZES)
    assert ok == {"a"} and "node b: reads bypass the page cache" in notes[0]
    # node a: its outputs (2 x total) and one cached copy (total) do not fit
    ok, notes = cached_nodes([_view(avail=3 * total - 1)] * 2 + [_view()] * 2, nodes, [0, 1, 2, 3], ranges, SIZES)
    assert ok == {"b"} and notes[0].startswith("node a: ")
    # a node with one reader has nothing to share (its blind rank receives)
    ok, _ = cached_nodes([_view()] * 4, nodes, [0, 1, 2], ranges, SIZES)
    assert ok == {"a"}


def test_page_cache_view(tmp_path):
    # /dev/shm is tmpfs wherever it exists: cached; /proc is not a filesystem of files on a disk
    if os.path.isdir("/dev/shm"):
        f = tempfile.NamedTemporaryFile(dir="/dev/shm", prefix="oneload-test-")
        view = page_cache_view([f.name])
        assert view["shared"] is True and view["avail"] > 0, view
        assert page_cache_view([f.name], direct=True)["why"] == "reads bypass the page cache (O_DIRECT)"
        f.close()
    proc = page_cache_view(["/proc/self/status"])
    assert proc["shared"] is False and "proc" in proc["why"], proc
    remote = page_cache_view(["s3://bucket/x.pt"])
    assert remote["shared"] is False and "object storage" in remote["why"]


def test_the_plan_stays_where_blind_ranks_are_even_if_nothing_moves():

    # readers 0 and 1 want disjoint halves, blind rank 2 wants nothing: no message, but the
    # readers still verify for the blind rank through the exchange's path
    ranges = _ranges([{"a": [(0, 500)]}, {"a": [(500, 1000)]}, {}])
    views = [_view()] * 3
    strategy, _, plan = _exchange_choice("parallel", "auto", "", ranges, SIZES, ["a"], [0, 1], ["n"] * 3, views,
                                         1 << 20)
    assert strategy == "parallel" and plan is not None and not plan.moves
    # with every rank a reader the same wants need no plan at all
    ranges = _ranges([{"a": [(0, 500)]}, {"a": [(500, 1000)]}])
    assert _exchange_choice("reshard", "auto", "", ranges, SIZES, ["a"], [0, 1], ["n"] * 2, views[:2],
                            1 << 20)[2] is None


def test_an_unknown_memory_report_does_not_hide_a_known_shortfall():
    ranges = _everything(2)
    total = sum(NUMEL[n] * SIZES[n] for n in NUMEL)
    ok, notes = cached_nodes([_view(avail=-1), _view(avail=total)], ["n", "n"], [0, 1], ranges, SIZES)
    assert ok == frozenset() and notes
    ok, _ = cached_nodes([_view(avail=-1), _view(avail=-1)], ["n", "n"], [0, 1], ranges, SIZES)
    assert ok == {"n"}


# ---------------------------------------------------------------- nodes with copies of their own


def test_nodes_with_their_own_copies_read_there_and_nothing_crosses():
    ranges = _everything(4)
    nodes = ["a", "a", "b", "b"]
    total = sum(NUMEL[n] * SIZES[n] for n in NUMEL)
    plan = plan_exchange(list(NUMEL), SIZES, ranges, [0, 1, 2, 3], nodes, 1000, frozenset({"a", "b"}),
                         frozenset({"a", "b"}))
    assert not plan.moves and plan.remote_bytes == (0, 0)
    assert plan.storage_bytes == (total, total)  # each node's own storage, once
    holds, _ = _simulate(plan, ranges, 4)
    assert all(holds[r][n] == set(range(NUMEL[n])) for r in range(4) for n in NUMEL)
    # without a page cache (O_DIRECT) a node's ranks share through messages inside the node only
    plan = plan_exchange(list(NUMEL), SIZES, ranges, [0, 1, 2, 3], nodes, 1000, frozenset(), frozenset({"a", "b"}))
    assert plan.remote_bytes == (0, 0) and plan.storage_bytes == (total, total)
    assert all(nodes[m.src] == nodes[m.dst] for rnd in plan.rounds for c in rnd for m in c.messages)
    _simulate(plan, ranges, 4)
    for nd in ("a", "b"):  # every element read once per node
        mine = [r for r in range(4) if nodes[r] == nd]
        sub = plan_exchange(list(NUMEL), SIZES, [ranges[r] for r in mine], [0, 1], ["x", "x"], 1000)
        assert sum(plan.read_bytes[r] for r in mine) == sum(sub.read_bytes) == total


def test_a_private_node_serves_a_blind_node_and_a_shared_node_reads_apart():
    ranges = _everything(4)
    total = sum(NUMEL[n] * SIZES[n] for n in NUMEL)
    # node b sees nothing: node a (its own copy) reads once and node b receives once
    plan = plan_exchange(list(NUMEL), SIZES, ranges, [0, 1], ["a", "a", "b", "b"], 1000, frozenset({"a"}),
                         frozenset({"a"}))
    _check(plan, ranges, 4)
    assert plan.storage_bytes == (total, 0) and plan.remote_bytes == (0, total)
    # nodes a and b on shared storage, node c with its own copy: a and b split one read of
    # the shared storage, c reads its copy, nothing crosses into c
    ranges = _everything(6)
    nodes = ["a", "a", "b", "b", "c", "c"]
    plan = plan_exchange(list(NUMEL), SIZES, ranges, list(range(6)), nodes, 1000, frozenset(), frozenset({"c"}))
    holds, _ = _simulate(plan, ranges, 6)
    assert all(holds[r][n] == set(range(NUMEL[n])) for r in range(6) for n in NUMEL)
    assert plan.storage_bytes[2] == total and plan.storage_bytes[0] + plan.storage_bytes[1] == total
    assert plan.remote_bytes[2] == 0 and plan.remote_bytes[0] + plan.remote_bytes[1] == total
    assert max(plan.storage_bytes[:2]) <= 0.6 * total


def test_private_nodes_and_what_auto_says():

    nodes = ["a", "a", "b", "b"]
    local = _view(private=True, fs="ext4")
    assert private_nodes([local] * 4, nodes, [0, 1, 2, 3]) == {"a", "b"}
    assert private_nodes([local] * 4, ["a"] * 4, [0, 1, 2, 3]) == frozenset()  # one node: nothing to choose
    assert private_nodes([local, _view(), local, local], nodes, [0, 1, 2, 3]) == {"b"}
    assert private_nodes([local] * 4, nodes, [0, 1]) == {"a"}  # b sees nothing
    ranges = _everything(4)
    # own copies on local disks: each node reads its own, nothing travels, the strategy stays
    strategy, reason, plan = _exchange_choice("own_shard", "auto", "r", ranges, SIZES, list(NUMEL), [0, 1, 2, 3],
                                              nodes, [local] * 4, 1 << 20)
    assert (strategy, plan) == ("own_shard", None)
    assert "every node has a copy on a disk of its own (ext4) and reads it there" in reason, reason
    # shared storage (nfs4): read once for the cluster, exchanged
    strategy, reason, plan = _exchange_choice("own_shard", "auto", "r", ranges, SIZES, list(NUMEL), [0, 1, 2, 3],
                                              nodes, [_view()] * 4, 1 << 20)
    assert strategy == "parallel" and plan.moves and sum(plan.storage_bytes) == sum(NUMEL[n] * SIZES[n] for n in NUMEL)
    # asked for by name, parallel reads once in all across own copies too
    strategy, reason, plan = _exchange_choice("parallel", "parallel", "r", ranges, SIZES, list(NUMEL), [0, 1, 2, 3],
                                              nodes, [local] * 4, 1 << 20)
    assert strategy == "parallel" and plan.remote_bytes[0] > 0 and plan.remote_bytes[1] > 0


def test_page_cache_view_says_whose_storage_it_is(tmp_path):
    if os.path.isdir("/dev/shm"):
        with tempfile.NamedTemporaryFile(dir="/dev/shm", prefix="oneload-test-") as f:
            view = page_cache_view([f.name])
            assert view["private"] is True and view["fs"] == "tmpfs", view
            # O_DIRECT changes the page cache, not whose disk it is
            assert page_cache_view([f.name], direct=True)["private"] is True
    remote = page_cache_view(["s3://bucket/x.pt"])
    assert remote["private"] is False and remote["fs"] == "object storage"
    assert page_cache_view(["/proc/self/status"])["private"] is False


def test_ranks_of_a_node_reading_different_copies_share_no_cache(tmp_path):
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    a.write_bytes(b"x" * 100)
    b.write_bytes(b"x" * 100)
    (tmp_path / "link.pt").symlink_to(a)
    va = page_cache_view([str(a)])
    assert va["files"] == page_cache_view([str(tmp_path / "link.pt")])["files"]  # the same inode
    vb = page_cache_view([str(b)])
    assert va["files"] != vb["files"]
    ranges = _everything(2)
    ok, notes = cached_nodes([dict(_view(), files=va["files"]), dict(_view(), files=vb["files"])], ["n", "n"],
                             [0, 1], ranges, SIZES)
    assert ok == frozenset() and "read different copies of the files (ranks 0, 1)" in notes[0], notes
    ok, _ = cached_nodes([dict(_view(), files=va["files"])] * 2, ["n", "n"], [0, 1], ranges, SIZES)
    assert ok == {"n"}


def _exchange_choice(strategy, asked, reason, ranges, sizes, order, readers, nodes, views, bucket_bytes):
    """The planner's choice, on a topology of these ranks' nodes and views."""
    from metaseq_oneload._planner import Topology, exchange_choice

    topo = Topology(1, tuple(range(len(nodes))), tuple(nodes), tuple(readers), tuple(views))
    return exchange_choice(strategy, asked, reason, ranges, sizes, order, topo, bucket_bytes)
