"""Failure never hangs and never lies: whatever goes wrong on one rank, every rank raises
a clear error within a bounded time (the harness fails a test as a hang after its timeout)."""

from __future__ import annotations

import os
import re
from typing import Optional

import pytest
import torch
import torch.distributed as dist

from tests.conftest import FIXTURES, needs_fixtures
from tests.distributed.harness import run_ranks
from tests.distributed.workers import expect_failure

pytestmark = needs_fixtures


@pytest.mark.parametrize("scenario,world,needle", [
    ("different_files", 2, r"the ranks see different checkpoint files \(rank 0: .*fsdp_dp3/checkpoint_2 1x3; rank 1: .*mp2_dp2/checkpoint_2 2x2\)"),
    ("truncate_while_reading", 3, r"reading failed on 1 rank\(s\) \(1\).*rank 1: CheckpointLayoutError: .*truncated(: needed bytes| or corrupted)"),
    ("reader_dies_mid_broadcast", 3, r"reading failed on 1 rank\(s\) \(0\).*rank 0: CheckpointLayoutError: .*truncated: needed bytes"),
    ("reader_dies_mid_scatter", 3, r"reading failed on 1 rank\(s\) \(0\).*rank 0: CheckpointLayoutError: .*truncated: needed bytes"),
    ("same_group_twice", 2, r"rank \d: the data-parallel group \[0, 1\] and the model-parallel group \[0, 1\] share ranks \[0, 1\]"),
    ("options_differ", 2, r"ranks of one data-parallel group called with different options: rank 0 \['auto', False, 256, 64, True"),
    # (No "bucket cannot be allocated" case: a bucket is sized by what the checkpoint needs,
    # not by bucket_mb alone, so bucket_mb=1e12 loads; test_first_hour_cli pins that.)
    ("reader_fails_while_verifying", 2, r"verifying failed on 1 rank\(s\) \(0\).*rank 0: CheckpointLayoutError: .*truncated"),
    ("wrong_shape_on_one_rank", 2, r"matching the target failed on 1 rank\(s\) \(1\).*decoder\.layers\.0\.fc1\.weight: checkpoint \(64, 34\) vs module \(48, 34\)"),
])
def test_every_rank_raises(tmp_path, scenario, world, needle):
    messages = run_ranks(world, expect_failure, scenario, str(tmp_path), tmp_path=tmp_path, timeout=60)
    assert len(messages) == world
    for m in messages:
        assert re.search(needle, m, re.S), m


def test_tied_name_wanted_by_an_untied_module_arrives_by_every_strategy(tmp_path):
    from tests.distributed.workers import untied_module_broadcast

    for strategy in ("broadcast", "auto"):
        diffs = run_ranks(2, untied_module_broadcast, strategy, tmp_path=tmp_path / strategy, timeout=60)
        assert max(diffs) == 0.0, (strategy, diffs)


def test_an_empty_folder_is_a_rank_that_cannot_see_the_files(tmp_path):
    from tests.distributed.workers import blind_empty_folder

    assert run_ranks(2, blind_empty_folder, str(tmp_path), tmp_path=tmp_path, timeout=60) == ["parallel", "parallel"]


# --------------------------------------------------------------------------- arrival, lost ranks, big messages
#
# One run of 6 real gloo ranks covers every case (spawning ranks is what costs here): first
# the arrival and message cases on ranks 0-3, then four ranks killed one after another,
# each in its own 3-rank group (a killed rank breaks only the groups it is in), while ranks
# 1 and 2 survive all four and report.

FOUR = [0, 1, 2, 3]
PG_TIMEOUT = 60  # the process group's timeout (run_ranks' timeout): what a rank left waiting would meet


def _soon(baseline: float, waits: float = 0.0, floor: float = 3.5) -> float:
    """A bound on "at once, not the process group's timeout": the arrival timeouts a rank
    waits, plus the time of 10 successful loads on the same ranks (``baseline``: a loaded
    machine slows both alike) and never less than ``floor``; at most half the process
    group's timeout, which is what it tells apart."""
    return min(PG_TIMEOUT / 2, waits + max(floor, 10 * baseline))
KILLS = [  # scenario, group, victim, the step the survivors must name
    ("reader_mid_broadcast", [0, 1, 2], 0, r"reading \(broadcast, bucket \d+ of \d+\)"),
    ("receiver_mid_scatter", [1, 2, 3], 3, r"reading \(scatter, bucket \d+ of \d+\)"),
    ("rank_mid_reshard", [1, 2, 4], 4, r"reading"),
    ("rank_mid_parallel", [1, 2, 5], 5, r"reading \(parallel read, round \d+ of \d+\)"),
]


def _sha256(folder) -> dict:
    import hashlib
    from pathlib import Path

    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(Path(folder).iterdir()) if p.is_file()}


def _arrival_cases(rank: int, four) -> dict:
    """On ranks 0-3: (a) rank 3 fails before the load and goes on; (b) the same in a 2x2
    grid; (c) rank 3 arrives late but within the timeout; (d) every rank fails with a 30 MB
    message, against (baseline) a load that succeeds. Per case: what this rank saw, how long."""
    import time

    import torch.distributed.tensor  # noqa: F401  (load_into imports it on first use: not the cost measured)

    import metaseq_oneload as mo
    import metaseq_oneload._engine as engine
    from tests.conftest import FIXTURES, assert_matches_reference, reference_part, reference_weights
    from tests.tiny_metaseq import TinyMetaseqLM

    out: dict = {}
    big = f"rank {rank}: missing shard0.pt, " + "shard.pt, " * 3_000_000
    mp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    dist.barrier(group=four)

    def attempt(case, fn):
        t0 = time.perf_counter()
        try:
            fn()
            out[case] = {"ok": True, "seconds": time.perf_counter() - t0}
        except mo.DistributedLoadError as e:
            out[case] = {"ok": False, "seconds": time.perf_counter() - t0, "message": str(e)[:20000],
                         "length": len(str(e)), "failures": {str(k): v for k, v in e.failures.items()}}
        dist.barrier(group=four)  # the next case starts together

    # (a) A rank whose caller caught an error before the load: the others give up after
    # arrival_timeout, naming it, with their module untouched.
    torch.manual_seed(rank)
    model = TinyMetaseqLM()
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def absent():
        if rank == 3:
            try:
                raise OSError("this rank's data loader failed before the load")
            except OSError:
                return  # caught by its caller: this rank goes on without loading
        mo.load_into(model, FIXTURES / "singleton", process_group=four, arrival_timeout=1.5)

    attempt("absent", absent)
    out["absent"]["unchanged"] = all(torch.equal(v, before[k]) for k, v in model.state_dict().items())

    # (b) The same in a 2x2 grid: rank 3's data-parallel partner (1) and model-parallel
    # partner (2) time out; rank 0 learns of it through rank 1's model-parallel check-in.
    def absent_in_grid():
        if rank != 3:
            mo.load_state_dict(FIXTURES / "mp2_dp2", process_group=dp_groups[rank % 2],
                               model_parallel_group=mp_groups[rank // 2], arrival_timeout=1.5)

    attempt("absent_in_grid", absent_in_grid)

    # (c) Late but within the timeout: an ordinary load; the skipped check-ins above do
    # not leave rank 3 one load behind.
    def late():
        if rank == 3:
            time.sleep(1.0)
        sd = mo.load_state_dict(FIXTURES / "mp2_dp2", process_group=dp_groups[rank % 2],
                                model_parallel_group=mp_groups[rank // 2], arrival_timeout=20)
        assert_matches_reference(sd, reference_part(reference_weights(), rank % 2, 2))

    attempt("late", late)

    # (d) Every rank fails with a 30 MB message (a discovery that lists everything): the
    # error arrives as fast as a success does, with a message of a few kilobytes.
    attempt("baseline", lambda: mo.load_state_dict(FIXTURES / "singleton", process_group=four))

    def huge():
        def discover(path, **kw):
            raise mo.CheckpointLayoutError(big)

        saved, engine.discover = engine.discover, discover
        try:
            mo.load_state_dict(FIXTURES / "singleton", process_group=four)
        finally:
            engine.discover = saved

    attempt("huge", huge)
    return out


def _killed_mid_load(rank: int, scenario: str, group, victim: int, tmp: str) -> Optional[dict]:
    """``victim`` kills itself (SIGKILL) part-way through a load on ``group``; the others
    return what they saw and when."""
    import signal
    import time

    import metaseq_oneload as mo
    from tests.conftest import FIXTURES

    calls = {"n": 0}

    def die(done, total):
        calls["n"] += 1
        if calls["n"] == 3:
            with open(os.path.join(tmp, f"{scenario}.killed_at"), "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)

    kw = {
        "reader_mid_broadcast": dict(strategy="broadcast", bucket_mb=0.001),
        "receiver_mid_scatter": dict(strategy="broadcast", bucket_mb=0.001, flat=True),
        "rank_mid_reshard": dict(strategy="reshard", flat=True),
        "rank_mid_parallel": dict(strategy="parallel", bucket_mb=0.001),  # full weights: read once, exchanged
    }[scenario]
    try:
        mo.load_state_dict(FIXTURES / "fsdp_dp3", process_group=group, progress=die if rank == victim else None, **kw)
    except mo.DistributedLoadError as e:
        return {"t": time.time(), "message": str(e), "failures": {str(k): v for k, v in e.failures.items()},
                "cause": type(e.__cause__).__name__}
    raise AssertionError(f"rank {rank}: the load went on without rank {victim}")


def five_ranks(rank: int, world: int, tmp: str) -> dict:
    import datetime
    import json

    four = dist.new_group(FOUR)
    groups = [dist.new_group(g) for _, g, _, _ in KILLS]
    if rank in FOUR:
        with open(os.path.join(tmp, f"arrivals{rank}.json"), "w") as f:
            json.dump(_arrival_cases(rank, four), f)  # kept even if this rank is killed below
    dist.barrier()  # the last collective of the world group: ranks die from here on
    store = dist.distributed_c10d._get_default_store()
    out = {}
    for (scenario, members, victim, _), group in zip(KILLS, groups):
        if rank not in members:
            continue
        out[scenario] = _killed_mid_load(rank, scenario, group, victim, tmp)
        store.set(f"test/{scenario}/done/{rank}", "1")
    for scenario, members, victim, _ in KILLS:  # stay until the others are done (a rank's exit resets its links)
        store.wait([f"test/{scenario}/done/{r}" for r in members if r != victim], datetime.timedelta(seconds=120))
    return out


@pytest.fixture(scope="module")
def five(tmp_path_factory):
    import json

    tmp = tmp_path_factory.mktemp("five")
    before = _sha256(FIXTURES / "fsdp_dp3")
    results = run_ranks(6, five_ranks, str(tmp), tmp_path=tmp, timeout=PG_TIMEOUT,
                        may_die=tuple(v for _, _, v, _ in KILLS))
    arrivals = [json.loads((tmp / f"arrivals{r}.json").read_text()) for r in FOUR]
    killed_at = {scenario: float((tmp / f"{scenario}.killed_at").read_text()) for scenario, _, _, _ in KILLS}
    return {"arrivals": arrivals, "results": results, "killed_at": killed_at,
            "unchanged": _sha256(FIXTURES / "fsdp_dp3") == before}


def test_a_rank_that_never_arrives_is_named_within_the_arrival_timeout(five):
    arrivals = five["arrivals"]
    for rank in (0, 1, 2):
        a = arrivals[rank]["absent"]
        assert not a["ok"]
        assert re.search(r"loading .*singleton: rank 3 of the data-parallel group \[0, 1, 2, 3\] did not arrive "
                         r"within arrival_timeout=1\.5s", a["message"]), a["message"]
        assert a["failures"] == {"3": "never arrived"}
        bound = _soon(arrivals[rank]["baseline"]["seconds"], waits=1.5)
        assert a["seconds"] < bound, (a["seconds"], bound)  # the arrival timeout, not the process group's
        assert a["unchanged"], "the module was written although the load failed"
    assert max(arrivals[r]["absent"]["seconds"] for r in (0, 1, 2)) >= 1.4  # it did wait the timeout
    assert arrivals[3]["absent"]["ok"]  # it never called the load


def test_a_missing_rank_of_a_grid_stops_its_neighbours_of_both_groups(five):
    for rank in (0, 1, 2):
        a = five["arrivals"][rank]["absent_in_grid"]
        assert not a["ok"], rank
        bound = _soon(five["arrivals"][rank]["baseline"]["seconds"], waits=2 * 1.5, floor=3.0)
        assert a["seconds"] < bound, (rank, a["seconds"], bound)  # two check-ins' timeouts, not the group's
        if rank == 0 and a["failures"] == {"1": "never arrived"}:
            # Rank 0 meets rank 1 only after rank 1 has waited out rank 3: on a loaded machine
            # rank 0's own wait may end first, and then it names rank 1, truly late.
            assert re.search(r"rank 1 of the model-parallel group \[0, 1\] did not arrive", a["message"]), a
            continue
        assert re.search(r"rank 3 of the (data|model)-parallel group \[(1, 3|2, 3)\] did not arrive", a["message"]), a
        assert a["failures"] == {"3": "never arrived"}


def test_a_late_rank_within_the_timeout_loads(five):
    assert [r["late"]["ok"] for r in five["arrivals"]] == [True] * 4, [r["late"].get("message") for r in five["arrivals"]]


def test_huge_messages_are_clipped_and_as_fast_as_a_load(five):
    for rank, r in enumerate(five["arrivals"]):
        h = r["huge"]
        assert not h["ok"]
        assert "agreeing on the checkpoint failed on 4 rank(s) (0, 1, 2, 3)" in h["message"], h["message"][:500]
        assert re.search(r"rank 0: CheckpointLayoutError: rank 0: missing shard0\.pt, shard\.pt, .* \(\d+ more characters\)",
                         h["message"])
        assert h["length"] < 20_000, h["length"]
        assert r["baseline"]["ok"]
        # as fast as a load: twice a successful load's time on these ranks, measured just
        # before (a loaded machine slows both alike), plus 1.5 s
        assert h["seconds"] < 2 * r["baseline"]["seconds"] + 1.5, (h["seconds"], r["baseline"])


@pytest.mark.parametrize("scenario,members,victim,step", KILLS, ids=[k[0] for k in KILLS])
def test_a_rank_killed_mid_load_is_named_on_every_other_rank(five, scenario, members, victim, step):
    for rank in members:
        if rank == victim:
            assert five["results"][rank] is None  # it died
            continue
        r = five["results"][rank][scenario]
        where = re.escape(f"[{', '.join(map(str, members))}]")
        assert re.search(rf"loading .*fsdp_dp3: {step}: rank {victim} of the data-parallel group {where} is "
                         r"gone \(its process ended\)\. Rank \d stops here", r["message"]), r["message"]
        assert "Backend error: RuntimeError" in r["message"]
        assert r["cause"] == "RuntimeError" and list(r["failures"]) == [str(victim)]
        took = r["t"] - five["killed_at"][scenario]
        bound = _soon(max(a["baseline"]["seconds"] for a in five["arrivals"]), floor=5)
        assert took < bound, (rank, took, bound)  # its death is noticed, not waited out
    assert five["unchanged"]  # the files read are as they were


def test_arrival_timeout_comes_from_the_keyword_the_environment_or_the_default(monkeypatch):
    import metaseq_oneload as mo
    from metaseq_oneload._dist import ARRIVAL_TIMEOUT_ENV, DEFAULT_ARRIVAL_TIMEOUT, arrival_timeout

    monkeypatch.delenv(ARRIVAL_TIMEOUT_ENV, raising=False)
    assert arrival_timeout() == DEFAULT_ARRIVAL_TIMEOUT == 300
    monkeypatch.setenv(ARRIVAL_TIMEOUT_ENV, "12.5")
    assert arrival_timeout() == 12.5 and arrival_timeout(3) == 3.0  # the keyword wins
    monkeypatch.setenv(ARRIVAL_TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match=r"METASEQ_ONELOAD_ARRIVAL_TIMEOUT='soon': expected a number of seconds"):
        arrival_timeout()
    with pytest.raises(ValueError, match=r"arrival_timeout=0: expected a positive number of seconds"):
        mo.load_state_dict(FIXTURES / "singleton", arrival_timeout=0)


# --------------------------------------------------------------------------- the check-in's interleavings, one process
#
# The arrival protocol (_dist.arrive -> Group.check_in) talks only through the store, so
# the ranks of a 2x2 grid can be threads around one in-memory store, each step of the
# interleaving forced by events rather than left to the machine's timing.


def _grid_threads(store):
    """Per rank of a 2x2 grid (data-parallel groups [0, 2], [1, 3]; model-parallel [0, 1],
    [2, 3]), its (data-parallel, model-parallel) Group over ``store``; a Group's ``gate``,
    when set, is waited for before its check-in, and ``entered`` is set on the way in."""
    import threading

    from metaseq_oneload._dist import Group

    class StoreGroup(Group):
        def __init__(self, members, me, role):  # no process group: the store is the whole protocol
            self.group, self.role, self.step, self._arrival = None, role, "loading", None
            self.active, self.rank, self.size, self.global_rank = True, members.index(me), len(members), me
            self.device = torch.device("cpu")
            self._members = tuple(members)
            self.gate, self.entered = None, threading.Event()

        def members(self):
            return self._members

        def _store(self):
            return store

        def check_in(self, *args, **kw):
            self.entered.set()
            if self.gate is not None:
                assert self.gate.wait(30)
            return super().check_in(*args, **kw)

    dp, mp = [[0, 2], [1, 3]], [[0, 1], [2, 3]]
    return [(StoreGroup(dp[r % 2], r, "data-parallel"), StoreGroup(mp[r // 2], r, "model-parallel")) for r in FOUR]


def _arrive_on_threads(grid, ranks, timeouts, before=None, done=None) -> dict:
    """Each of ``ranks`` calls arrive on its own thread (``before[rank]``, if given, first:
    an event to wait for, or seconds to sleep; ``done[rank]``, if given, an event set when
    it returns); per rank, what it raised (None if nothing) and how long arrive took."""
    import threading
    import time

    from metaseq_oneload._dist import arrive

    out: dict = {}

    def one(rank):
        wait = (before or {}).get(rank)
        if isinstance(wait, float):
            time.sleep(wait)
        elif wait is not None:
            assert wait.wait(30)
        t0 = time.perf_counter()
        try:
            arrive(grid[rank], timeouts[rank], "loading x")
            out[rank] = (None, time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001  (what each rank saw is the result)
            out[rank] = (e, time.perf_counter() - t0)
        finally:
            if (done or {}).get(rank) is not None:
                done[rank].set()

    threads = {r: threading.Thread(target=one, args=(r,), daemon=True) for r in ranks}
    for t in threads.values():
        t.start()
    for t in threads.values():
        t.join(60)
    assert sorted(out) == sorted(ranks), out  # no rank left waiting
    return out


@pytest.mark.parametrize("rank_3_absent", [True, False], ids=["rank_1_failing", "rank_1_slow"])
def test_a_check_in_given_up_while_a_rank_waits_in_its_other_group_stays_with_that_load(rank_3_absent):
    """The interleaving behind case (b) then (c) of five_ranks, forced: rank 1 is held in its
    data-parallel check-in (waiting out an absent rank 3, or merely slow) until rank 0 has
    given up on it in their model-parallel check-in. Rank 1 then learns at once that it
    came too late (or stops with rank 3's absence) and leaves nothing for the next load: a
    load of all four ranks right after works on every rank. (Before, rank 1 settled the
    model-parallel check-in after the one rank 0 left with its data-parallel failure, and
    rank 0 raised that failure, a load late, at its next load.)"""
    import threading

    import torch.distributed as d

    grid = _grid_threads(d.HashStore())
    rank_0_done = threading.Event()
    grid[1][1].gate = rank_0_done  # rank 1's model-parallel check-in waits for rank 0 to give up on it
    ranks = [0, 1, 2] if rank_3_absent else FOUR
    timeouts = {0: 0.5, 1: 0.5, 2: 2.0, 3: 2.0}
    # rank 0 starts once rank 1 is inside its load (its data-parallel check-in)
    first = _arrive_on_threads(grid, ranks, timeouts, before={0: grid[1][0].entered}, done={0: rank_0_done})

    said = {r: str(e) if e is not None else None for r, (e, _) in first.items()}
    assert re.search(r"rank 1 of the model-parallel group \[0, 1\] did not arrive within arrival_timeout=0\.5s",
                     said[0] or ""), said
    if rank_3_absent:
        assert re.search(r"rank 3 of the data-parallel group \[1, 3\] did not arrive", said[1] or ""), said
        assert re.search(r"rank 3 of the model-parallel group \[2, 3\] did not arrive", said[2] or ""), said
    else:
        assert re.search(r"rank 1 arrived after the other ranks of the model-parallel group \[0, 1\] had stopped "
                         r"waiting for it \(arrival_timeout=0\.5s\)", said[1] or ""), said
        assert first[1][1] < 0.5 + 1.0, first[1]  # told at once, not after a wait of its own
        assert said[2] is None and said[3] is None, said

    # The next load of all four, rank 3 a little late: every rank arrives.
    for g in grid:
        for group in g:
            group.gate = None
    second = _arrive_on_threads(grid, FOUR, {r: 10.0 for r in FOUR}, before={3: 0.2})
    assert {r: str(e) if e else None for r, (e, _) in second.items()} == {r: None for r in FOUR}, second
    assert max(s for _, s in second.values()) < 5.0, second
