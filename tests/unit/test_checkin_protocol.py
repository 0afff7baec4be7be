"""The check-in protocol's interleavings (``_dist.arrive`` / ``tell_failed`` -> ``Group.check_in``),
forced one store operation at a time.

The protocol talks only through the store, so the ranks of a grid can be threads around one
in-memory ``HashStore`` (``Group.over_store``). Each rank's store is traced: a test holds one
rank before a chosen operation until the trace shows another rank has reached (or done) one,
so an interleaving that a loaded machine produces one run in a hundred happens every run.
Each test names the verdict every rank must reach; none waits out an arrival timeout.
"""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch.distributed as dist

import metaseq_oneload._begun as b
import metaseq_oneload._dist as d
from metaseq_oneload._errors import DistributedLoadError, OptionError

FOUR = (0, 1, 2, 3)
DP, MP = "data-parallel", "model-parallel"


class Trace:
    """What every rank's store did, in order: (rank, op, key, "at" | "done")."""

    def __init__(self):
        self.cond = threading.Condition()
        self.log: list = []

    def note(self, *entry) -> None:
        with self.cond:
            self.log.append(entry)
            self.cond.notify_all()

    def wait_until(self, pred, timeout: float = 10.0) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: pred(self), timeout), f"interleaving not reached: {self.log[-20:]}"

    def seen(self, rank: int, op: str, role: str, tail: str, phase: str = "done", times: int = 1) -> bool:
        return sum(1 for r, o, k, p in self.log
                   if r == rank and o == op and f"/{role}/" in k and k.endswith(tail) and p == phase) >= times


class TracedStore:
    """One rank's view of the shared store: every operation noted; ``hold`` stops this rank
    before its next ``op`` on a key of ``role`` ending in ``tail`` until ``until(trace)``."""

    def __init__(self, store, rank: int, trace: Trace):
        self._s, self.rank, self.trace, self.holds = store, rank, trace, []

    def hold(self, op: str, role: str, tail: str, until) -> None:
        self.holds.append((op, role, tail, until))

    def _do(self, op: str, key: str, fn):
        self.trace.note(self.rank, op, key, "at")
        for h in list(self.holds):
            if h[0] == op and f"/{h[1]}/" in key and key.endswith(h[2]):
                self.holds.remove(h)  # once
                self.trace.wait_until(h[3])
        try:
            return fn()
        finally:
            self.trace.note(self.rank, op, key, "done")

    def add(self, key, n):
        return self._do("add", key, lambda: self._s.add(key, n))

    def set(self, key, value):
        return self._do("set", key, lambda: self._s.set(key, value))

    def get(self, key):
        return self._do("get", key, lambda: self._s.get(key))

    def check(self, keys):
        return self._do("check", keys[0], lambda: self._s.check(keys))

    def wait(self, keys, timeout):
        return self._do("wait", keys[0], lambda: self._s.wait(keys, timeout))

    def compare_set(self, key, expected, desired):
        return self._do("compare_set", key, lambda: self._s.compare_set(key, expected, desired))

    def delete_key(self, key):
        return self._do("delete_key", key, lambda: self._s.delete_key(key))

    @property
    def timeout(self):
        return self._s.timeout

    def set_timeout(self, t):
        self._s.set_timeout(t)


def grid():
    """A 2x2 grid over one store: data-parallel groups [0, 2], [1, 3], model-parallel [0, 1],
    [2, 3]. Returns (trace, per rank its TracedStore, per rank its (dp, mp) groups)."""
    store, trace = dist.HashStore(), Trace()
    stores = [TracedStore(store, r, trace) for r in FOUR]
    dp, mp = [[0, 2], [1, 3]], [[0, 1], [2, 3]]
    groups = [(d.Group.over_store(stores[r], dp[r % 2], r, DP), d.Group.over_store(stores[r], mp[r // 2], r, MP))
              for r in FOUR]
    return trace, stores, groups


def on_threads(calls: dict) -> dict:
    """Run each rank's call on its own thread; per rank (what it raised or None, seconds)."""
    out: dict = {}

    def one(rank, fn):
        t0 = time.perf_counter()
        try:
            fn()
            out[rank] = (None, time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001  (what each rank saw is the result)
            out[rank] = (e, time.perf_counter() - t0)

    threads = [threading.Thread(target=one, args=(r, fn), daemon=True) for r, fn in calls.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(out) == sorted(calls), f"ranks left waiting: {sorted(set(calls) - set(out))}"
    return out


@pytest.fixture(autouse=True)
def short_grace(monkeypatch):
    # The others wait this long for a failed rank's next check-in (a call it made alone):
    # short, so a test that waits it out costs little.
    monkeypatch.setattr(d, "_RETURN_GRACE", 0.3)


BAD = OptionError("bucket_mb=0: expected a positive number of megabytes")
FAILED_3 = r"rank 3 failed before the load began \(OptionError: bucket_mb=0"


def test_a_failing_rank_is_never_counted_so_its_partner_never_settles_ok_without_it():
    """The hang caught live in test_trust_ranks' grid case: rank 3 fails before the load
    and tells its groups (tell_failed) while rank 1 checks in to their data-parallel group.
    Forced: rank 1 comes in after rank 3 reached its check-in, and rank 3 claims the verdict
    only once rank 1 has decided or waits. Counted as arrived, rank 3 completed rank 1's count,
    rank 1 settled the check-in "ok", went on with rank 0 (model-parallel "ok" too) and
    waited in the load's first collective for a rank that had gone. Every rank must stop."""
    trace, stores, g = grid()
    stores[3].hold("compare_set", DP, "/claim",
                   lambda t: t.seen(1, "compare_set", DP, "/claim") or t.seen(1, "wait", DP, "/state", "at"))
    stores[1].hold("add", DP, "/n", lambda t: t.seen(3, "compare_set", DP, "/claim", "at"))
    said = on_threads({0: lambda: d.arrive(g[0], 10.0, "loading x"),
                       1: lambda: d.arrive(g[1], 10.0, "loading x"),
                       2: lambda: d.arrive(g[2], 10.0, "loading x"),
                       3: lambda: d.tell_failed(g[3], BAD, 10.0)})
    assert said[3][0] is None  # tell_failed never raises
    for r in (0, 1, 2):
        e, seconds = said[r]
        assert isinstance(e, DistributedLoadError) and re.search(FAILED_3, str(e)), (r, e)
        assert e.failures == {3: "OptionError: bucket_mb=0: expected a positive number of megabytes"}, (r, e)
        assert seconds < 5.0, said


def test_a_failing_rank_is_not_taken_for_arrived_when_a_partners_wait_ends():
    """The same race through the other way a check-in is settled: rank 1's wait for rank 3
    ends (arrival_timeout) just as rank 3, failing before the load, has come in but not yet
    claimed the verdict. Rank 3 must not count as arrived there either: rank 1 settling
    "everyone is here" would send it into the load alone. It stops, naming rank 3."""
    trace, stores, g = grid()
    stores[3].hold("compare_set", DP, "/claim",
                   lambda t: t.seen(1, "compare_set", DP, "/claim") or t.seen(1, "wait", DP, "/state", "at", 2))
    # rank 1's wait begins once rank 3 is at its claim (and has marked what it marks first)
    stores[1].hold("wait", DP, "/state", lambda t: t.seen(3, "compare_set", DP, "/claim", "at"))
    said = on_threads({1: lambda: d.arrive(g[1][:1], 0.3, "loading x"),
                       3: lambda: d.tell_failed(g[3][:1], BAD, 0.3)})
    e, seconds = said[1]
    assert isinstance(e, DistributedLoadError), said
    assert list(e.failures) == [3], (e, e.failures)
    assert re.search(rf"{FAILED_3}|rank 3 of the data-parallel group \[1, 3\] did not arrive", str(e)), e
    assert seconds < 5.0, said


def test_a_call_made_alone_is_withdrawn_in_every_group_at_the_next_load_whatever_order_the_others_come_in():
    """Rank 3 makes a bad call alone (tell_failed settles its data- and model-parallel
    check-ins as failed), then all four ranks load together, rank 1 the last to come. Rank 2
    meets rank 3's failure in their model-parallel group and waits _RETURN_GRACE for rank 3's
    next load to withdraw it; rank 3 must withdraw it when its load begins, not only once its
    data-parallel check-in (which waits for rank 1) is done: else rank 2 raises a failure
    that was not its load's while ranks 0, 1 and 3 go on into the load without it."""
    trace, stores, g = grid()
    d.tell_failed(g[3], ValueError("a call rank 3 made alone"), 10.0)
    # rank 2 looks for rank 3's withdrawal only once rank 3 waits in its data-parallel
    # check-in, and rank 1 begins its load only once rank 2 has decided
    stores[2].hold("check", MP, "/fate", lambda t: t.seen(3, "wait", DP, "/state", "at"))
    stores[1].hold("add", DP, "/gen", lambda t: t.seen(2, "compare_set", MP, "/fate"))
    said = on_threads({r: (lambda r=r: d.arrive(g[r], 3.0, "loading x")) for r in FOUR})
    assert {r: str(e) if e else None for r, (e, _) in said.items()} == {r: None for r in FOUR}, said
    # and the next load of all four works too (nothing left in the store out of step)
    again = on_threads({r: (lambda r=r: d.arrive(g[r], 10.0, "loading x")) for r in FOUR})
    assert {r: str(e) if e else None for r, (e, _) in again.items()} == {r: None for r in FOUR}, again


# --------------------------------------------------------------------------- a call that began before the others gave up
#
# A rank's call to a load begins (d.begin: an entry point's start, or an integration's
# discovery of the set, which may take minutes) before its check-in. When the others give
# up waiting for it meanwhile (arrival_timeout), what it does next belongs to that abandoned
# check-in, not to their next load: it fails (tell_failed) or arrives (arrive) "too late".


def pair():
    """Ranks 0 and 1 of one data-parallel group over one store."""
    store, trace = dist.HashStore(), Trace()
    stores = [TracedStore(store, r, trace) for r in (0, 1)]
    return trace, stores, [[d.Group.over_store(stores[r], [0, 1], r, DP)] for r in (0, 1)]


def given_up_on(g, ranks, late: int, timeout: float = 0.2) -> None:
    """Every rank of ``ranks`` but ``late`` checks in and gives up waiting for ``late``."""
    said = on_threads({r: (lambda r=r: d.arrive(g[r], timeout, "loading x")) for r in ranks if r != late})
    for r, (e, _) in said.items():
        assert isinstance(e, DistributedLoadError), said
        assert "did not arrive" in str(e) or "rank 3" in str(e), said


def waiting(trace: Trace, rank: int, role: str, gen: int) -> None:
    """Until ``rank`` waits for the verdict of its check-in number ``gen`` of ``role``."""
    trace.wait_until(lambda t: t.seen(rank, "wait", role, f"/{gen}/state", "at"))


def test_a_failure_after_the_others_gave_up_is_not_handed_to_their_next_load():
    """Rank 1's call begins, the others give up waiting for it (arrival_timeout), then its
    call fails before the check-in (a slow discovery that ends in an error). That failure
    was the abandoned load's: the next load, rank 1 coming well after rank 0 (longer than
    the others wait for a failed rank's next check-in), works on both. Before, rank 1's
    failure settled the next check-in: rank 0 raised it (a load late, a good load failed)
    and rank 1 then waited for rank 0 at the one after."""
    trace, stores, g = pair()
    b.begin(g[1])
    given_up_on(g, (0, 1), late=1)
    d.tell_failed(g[1], ValueError("rank 1's discovery failed, after the others gave up"), 0.2)

    def late_rank():
        waiting(trace, 0, DP, 1)
        time.sleep(4 * d._RETURN_GRACE)  # rank 0 would have raised a failure settled there by now
        b.begin(g[1])
        d.arrive(g[1], 10.0, "loading y")

    said = on_threads({0: lambda: d.arrive(g[0], 10.0, "loading y"), 1: late_rank})
    assert {r: str(e) if e else None for r, (e, _) in said.items()} == {0: None, 1: None}, said


def test_a_rank_that_arrives_after_the_others_gave_up_is_told_at_once():
    """Rank 1's call began before the others gave up on it; it arrives afterwards. It is
    told at once that it came too late (naming the timeout to raise), instead of waiting
    a whole arrival_timeout of its own at the check-in after, where no one comes (the
    others' next load then met a check-in out of step). The next load of both works."""
    trace, stores, g = pair()
    b.begin(g[1])
    given_up_on(g, (0, 1), late=1)
    b.begin(g[1])  # the engine's entry point, after the integration's discovery: the same call
    said = on_threads({1: lambda: d.arrive(g[1], 10.0, "loading x")})
    e, seconds = said[1]
    assert isinstance(e, DistributedLoadError), said
    assert re.search(r"loading x: rank 1 arrived after the other ranks of the data-parallel group \[0, 1\] had "
                     r"stopped waiting for it \(arrival_timeout=0\.2s\).*raise arrival_timeout=", str(e)), e
    assert e.failures == {1: "never arrived"}, e.failures
    assert seconds < 2.0, said
    again = on_threads({r: (lambda r=r: (b.begin(g[r]), d.arrive(g[r], 10.0, "loading y"))) for r in (0, 1)})
    assert {r: str(e) if e else None for r, (e, _) in again.items()} == {0: None, 1: None}, again


def test_a_late_failure_in_a_grid_is_not_handed_to_the_next_load_of_either_group():
    """The same in a 2x2 grid: rank 3's call begins, ranks 1 and 2 give up on it in its
    data- and model-parallel groups (rank 0 stops with them), then rank 3's call fails.
    The next load of all four, rank 3 the last by far, works on every rank."""
    trace, stores, g = grid()
    for r in FOUR:
        b.begin(g[r])
    given_up_on(g, FOUR, late=3)
    d.tell_failed(g[3], ValueError("rank 3's discovery failed, after the others gave up"), 0.2)

    def late_rank():
        waiting(trace, 1, DP, 1)
        waiting(trace, 2, MP, 1)
        time.sleep(4 * d._RETURN_GRACE)
        d.arrive(g[3], 10.0, "loading y")

    calls = {r: (lambda r=r: d.arrive(g[r], 10.0, "loading y")) for r in (0, 1, 2)}
    said = on_threads({**calls, 3: late_rank})
    assert {r: str(e) if e else None for r, (e, _) in said.items()} == {r: None for r in FOUR}, said


def test_a_call_that_began_and_ended_without_a_check_in_leaves_nothing_for_the_next():
    """A call that began and then ended on every rank without loading (an integration's
    "no checkpoint yet"; b.forget_begun) leaves no start behind: the next load of both,
    which begins and checks in as usual, works."""
    trace, stores, g = pair()
    for r in (0, 1):
        b.begin(g[r])
        b.forget_begun(g[r])
    # the others give up on rank 1 at a load it never began (it skipped it): its next load
    # meets them at their next one, as before
    given_up_on(g, (0, 1), late=1)
    said = on_threads({r: (lambda r=r: (b.begin(g[r]), d.arrive(g[r], 10.0, "loading y"))) for r in (0, 1)})
    assert {r: str(e) if e else None for r, (e, _) in said.items()} == {0: None, 1: None}, said


def test_a_call_that_raised_before_its_check_in_leaves_no_start_for_the_retry():
    """Rank 1's call begins inside an entry point (b.load_call) and raises before its
    check-in, on a path that tells no one (the others then give up on it at their
    arrival_timeout). The user retries on both ranks, on time: the retry works on both.
    Without the call's end forgetting where it began, rank 1's retry took the earlier
    call's start as its own and raised "arrived after the other ranks ... had stopped
    waiting" at once, and rank 0 waited its whole timeout for it."""
    trace, stores, g = pair()

    def failing_call():
        with b.load_call():
            b.begin(g[1])
            raise ValueError("a device that does not exist, before the check-in")

    with pytest.raises(ValueError):
        failing_call()
    given_up_on(g, (0, 1), late=1)

    def retry(r):
        with b.load_call():
            b.begin(g[r])
            d.arrive(g[r], 10.0, "loading y")

    said = on_threads({r: (lambda r=r: retry(r)) for r in (0, 1)})
    assert {r: str(e) if e else None for r, (e, _) in said.items()} == {0: None, 1: None}, said
    assert all(s < 5.0 for _, s in said.values()), said
    assert not b.BEGUN.get(0) and not b.BEGUN.get(1)
