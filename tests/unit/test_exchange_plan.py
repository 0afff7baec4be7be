"""The parallel strategy's plan (who reads which bytes, who sends what to whom), as a pure
function of every rank's wants: each wanted byte read once, balanced by bytes, a node's
share crossing between nodes once, and every rank ending with exactly its wants."""

from __future__ import annotations

import pytest

from metaseq_oneload._exchange import overlap, plan_exchange


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
