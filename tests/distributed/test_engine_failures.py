"""Failure never hangs and never lies: whatever goes wrong on one rank, every rank raises
a clear error within a bounded time (the harness fails a test as a hang after its timeout)."""

from __future__ import annotations

import os
import re

import pytest
import torch
import torch.distributed as dist

from tests.conftest import needs_fixtures
from tests.distributed.harness import run_ranks
from tests.distributed.workers import expect_failure

pytestmark = needs_fixtures


@pytest.mark.parametrize("scenario,world,needle", [
    ("different_files", 2, r"the ranks see different checkpoint files \(rank 0: .*fsdp_dp3/checkpoint_2 1x3; rank 1: .*mp2_dp2/checkpoint_2 2x2\)"),
    ("truncate_while_reading", 3, r"reading failed on 1 rank\(s\) \(1\).*rank 1: CheckpointLayoutError: .*truncated: needed bytes"),
    ("reader_dies_mid_broadcast", 3, r"reading failed on 1 rank\(s\) \(0\).*rank 0: CheckpointLayoutError: .*truncated: needed bytes"),
    ("reader_dies_mid_scatter", 3, r"reading failed on 1 rank\(s\) \(0\).*rank 0: CheckpointLayoutError: .*truncated: needed bytes"),
    ("same_group_twice", 2, r"rank \d: the data-parallel group \[0, 1\] and the model-parallel group \[0, 1\] share ranks \[0, 1\]"),
    ("options_differ", 2, r"ranks of one data-parallel group called with different options: rank 0 \['auto', False, 256, 64, True"),
    ("bucket_cannot_be_allocated", 2, r"reading failed on 2 rank\(s\) \(0, 1\)"),
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

    assert run_ranks(2, blind_empty_folder, str(tmp_path), tmp_path=tmp_path, timeout=60) == ["broadcast", "broadcast"]


# --------------------------------------------------------------------------- arrival, lost ranks, big messages
#
# Workers live here (module level, so spawned ranks import them). One 4-rank process group
# runs every arrival case in turn; each lost-rank case needs its own (a killed rank breaks it).


def _sha256(folder) -> dict:
    import hashlib
    from pathlib import Path

    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(Path(folder).iterdir()) if p.is_file()}


def arrival_cases(rank: int, world: int) -> dict:
    """On 4 ranks: (a) rank 3 fails before the load and goes on; (b) the same in a 2x2 grid;
    (c) rank 3 arrives late but within the timeout; (d) every rank fails with a 30 MB message.
    Returns, per case, what this rank saw and how long it took."""
    import time

    import torch.distributed as dist

    import metaseq_oneload as mo
    import metaseq_oneload._loading as engine
    from tests.conftest import FIXTURES, assert_matches_reference, reference_part, reference_weights
    from tests.tiny_metaseq import TinyMetaseqLM

    out: dict = {}
    big = f"rank {rank}: missing " + ", ".join(f"shard{i}.pt" for i in range(3_000_000))
    world_group = dist.group.WORLD
    mp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]

    def attempt(case, fn):
        t0 = time.perf_counter()
        try:
            fn()
            out[case] = {"ok": True, "seconds": time.perf_counter() - t0}
        except mo.DistributedLoadError as e:
            out[case] = {"ok": False, "seconds": time.perf_counter() - t0, "message": str(e)[:20000],
                         "length": len(str(e)), "failures": {str(k): v for k, v in e.failures.items()}}
        dist.barrier()  # the next case starts together

    # (a) A rank whose caller caught an error before the load: the others give up after
    # arrival_timeout, naming it, with their module untouched.
    import torch.distributed.tensor  # noqa: F401  (load_into imports it on first use: not the cost measured)

    torch.manual_seed(rank)
    model = TinyMetaseqLM()
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def absent():
        if rank == 3:
            try:
                raise OSError("this rank's data loader failed before the load")
            except OSError:
                return  # caught by its caller: this rank goes on without loading
        mo.load_into(model, FIXTURES / "singleton", process_group=world_group, arrival_timeout=1.5)

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
    attempt("baseline", lambda: mo.load_state_dict(FIXTURES / "singleton", process_group=world_group))

    def huge():
        def discover(path, **kw):
            raise mo.CheckpointLayoutError(big)

        saved, engine.discover = engine.discover, discover
        try:
            mo.load_state_dict(FIXTURES / "singleton", process_group=world_group)
        finally:
            engine.discover = saved

    attempt("huge", huge)
    return out


@pytest.fixture(scope="module")
def arrivals(tmp_path_factory):
    return run_ranks(4, arrival_cases, tmp_path=tmp_path_factory.mktemp("arrivals"), timeout=60)


def test_a_rank_that_never_arrives_is_named_within_the_arrival_timeout(arrivals):
    for rank in (0, 1, 2):
        a = arrivals[rank]["absent"]
        assert not a["ok"]
        assert re.search(r"loading .*singleton: rank 3 of the data-parallel group \[0, 1, 2, 3\] did not arrive "
                         r"within arrival_timeout=1\.5s", a["message"]), a["message"]
        assert a["failures"] == {"3": "never arrived"}
        assert a["seconds"] < 5, a["seconds"]  # not the process group's timeout
        assert a["unchanged"], "the module was written although the load failed"
    assert max(arrivals[r]["absent"]["seconds"] for r in (0, 1, 2)) >= 1.4  # it did wait the timeout
    assert arrivals[3]["absent"]["ok"]  # it never called the load


def test_a_missing_rank_of_a_grid_stops_its_neighbours_of_both_groups(arrivals):
    for rank in (0, 1, 2):
        a = arrivals[rank]["absent_in_grid"]
        assert not a["ok"], rank
        assert re.search(r"rank 3 of the (data|model)-parallel group \[(1, 3|2, 3)\] did not arrive", a["message"]), a
        assert a["failures"] == {"3": "never arrived"}
        assert a["seconds"] < 6, (rank, a["seconds"])  # two check-ins at most


def test_a_late_rank_within_the_timeout_loads(arrivals):
    assert [r["late"]["ok"] for r in arrivals] == [True] * 4, arrivals


def test_huge_messages_are_clipped_and_as_fast_as_a_load(arrivals):
    for rank in range(4):
        h = arrivals[rank]["huge"]
        assert not h["ok"]
        assert "agreeing on the checkpoint failed on 4 rank(s) (0, 1, 2, 3)" in h["message"], h["message"][:500]
        assert re.search(r"rank 0: CheckpointLayoutError: rank 0: missing shard0\.pt, .* \(\d+ more characters\)",
                         h["message"])
        assert h["length"] < 20_000, h["length"]
        assert arrivals[rank]["baseline"]["ok"]
        assert h["seconds"] < arrivals[rank]["baseline"]["seconds"] + 1.5, (h["seconds"], arrivals[rank]["baseline"])


def killed_mid_load(rank: int, world: int, scenario: str, victim: int, tmp: str) -> dict:
    """``victim`` is killed (SIGKILL) part-way through a load; the others report what they saw."""
    import signal
    import time

    import metaseq_oneload as mo
    from tests.conftest import FIXTURES

    calls = {"n": 0}

    def die_at(n):
        def progress(nbytes):
            calls["n"] += 1
            if calls["n"] == n:
                with open(os.path.join(tmp, "killed_at"), "w") as f:
                    f.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
        return progress

    kw = {
        "reader_mid_broadcast": dict(strategy="broadcast", bucket_mb=0.001),
        "receiver_mid_scatter": dict(strategy="broadcast", bucket_mb=0.001, flat=True),
        "rank_mid_reshard": dict(strategy="reshard", flat=True),
    }[scenario]
    try:
        mo.load_state_dict(FIXTURES / "fsdp_dp3", process_group=dist.group.WORLD,
                           progress=die_at(3) if rank == victim else None, **kw)
    except mo.DistributedLoadError as e:
        return {"t": time.time(), "message": str(e), "failures": {str(k): v for k, v in e.failures.items()},
                "cause": type(e.__cause__).__name__}
    raise AssertionError(f"rank {rank}: the load went on without rank {victim}")


@pytest.mark.parametrize("scenario,victim,step", [
    ("reader_mid_broadcast", 0, r"reading \(broadcast, bucket \d+ of \d+\)"),
    ("receiver_mid_scatter", 2, r"reading \(scatter, bucket \d+ of \d+\)"),
    ("rank_mid_reshard", 1, r"reading"),
])
def test_a_rank_killed_mid_load_is_named_on_every_other_rank(tmp_path, scenario, victim, step):
    from tests.conftest import FIXTURES

    before = _sha256(FIXTURES / "fsdp_dp3")
    results = run_ranks(3, killed_mid_load, scenario, victim, str(tmp_path), tmp_path=tmp_path, timeout=60,
                        may_die=(victim,))
    killed_at = float((tmp_path / "killed_at").read_text())
    assert results[victim] is None
    for rank, r in enumerate(results):
        if rank == victim:
            continue
        assert re.search(rf"loading .*fsdp_dp3: {step}: rank {victim} of the data-parallel group \[0, 1, 2\] is "
                         r"gone \(its process ended\)\. Rank \d stops here", r["message"]), r["message"]
        assert "Backend error: RuntimeError" in r["message"]
        assert r["cause"] == "RuntimeError" and r["failures"] == {str(victim): r["failures"][str(victim)]}
        assert r["t"] - killed_at < 5, (rank, r["t"] - killed_at)
    assert _sha256(FIXTURES / "fsdp_dp3") == before
