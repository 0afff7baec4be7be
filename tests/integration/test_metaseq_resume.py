"""The resume matrix with the real ``metaseq-train``: checkpoints saved by metaseq itself
(FSDP data parallel 4, model parallel 2 x data parallel 3, model parallel 4 and 2 with
``pytorch_ddp``) resumed on other world sizes with ``+oneload=auto`` and no loading flag;
only the new run's ``--model-parallel-size`` where it changes. Each resumed run must log the
losses of the uninterrupted run that saved the checkpoint (updates 3 and 4: update 3's loss
checks the weights, update 4's the optimizer state too).

``--reset-optimizer`` shows that the optimizer state is what carries over: metaseq then
also restarts its update count, so that run trains two updates of its own from the same
weights; with a constant learning rate the only difference to the uninterrupted updates 3
and 4 is the fresh Adam state, and the second loss differs.

The source checkpoints are trained here, under ``tmp_path``, by metaseq alone (the plugin
off) with the flags its users give: a tiny model with 4 heads, so that model parallel 4
divides it. 47 processes in all: two to three minutes on two idle CPU cores.

Runs where metaseq is importable and metaseq_oneload.pth is installed next to it; skips
otherwise (metaseq is not on PyPI).
"""

import re

import pytest

from tests.integration.metaseq_run import COMMON, skip_reason, start

pytestmark = pytest.mark.skipif(bool(skip_reason()), reason=skip_reason() or "ready")

# Heads, embedding (8 per part at model parallel 4), ffn and the padded vocabulary (64) all
# divide by 4.
ARGS = tuple(COMMON + "--decoder-embed-dim 32 --decoder-ffn-embed-dim 64 --decoder-attention-heads 4".split()
             # a constant learning rate: --reset-optimizer then changes nothing but the Adam state
             + "--lr-scheduler polynomial_decay --warmup-updates 0 --end-learning-rate 0.001 --total-num-update 100"
             .split() + ["--disable-validation"])
FSDP = ["--ddp-backend", "fully_sharded", "--use-sharded-state"]
# metaseq's model-parallel transformer asserts --use-sharded-state under any backend.
DDP = ["--ddp-backend", "pytorch_ddp", "--use-sharded-state"]

# name: (world size, model-parallel size, the flags metaseq needs to train and save it)
SOURCES = {
    "fsdp_dp4": (4, 1, FSDP),
    "mp2_dp3": (6, 2, FSDP + ["--model-parallel-size", "2"]),
    "mp4_ddp": (4, 4, DDP + ["--model-parallel-size", "4"]),
    "mp2_ddp": (2, 2, DDP + ["--model-parallel-size", "2"]),
}
# source: [(world size, the new run's model-parallel size if it changes), ...]; the
# last one is also resumed with --reset-optimizer.
TARGETS = {
    "fsdp_dp4": [(4, None), (3, None), (2, None)],
    "mp2_dp3": [(4, None), (2, None)],
    "mp4_ddp": [(4, None), (2, 2)],
    "mp2_ddp": [(2, None), (1, 1)],
}
# Another model-parallel size adds up the same numbers in another order.
MP_CHANGE_TOL = 2e-3


def _saved(mp: int, dp: int, flat: bool) -> list:
    parts = [f"-model_part-{m}" for m in range(mp)]
    shards = [f"-shard{d}" for d in range(dp)] if flat else [""]
    return sorted(f"checkpoint_4{p}{s}.pt" for p in parts for s in shards)


@pytest.mark.parametrize("source", list(SOURCES))
def test_resume_continues_the_uninterrupted_run(source, tmp_path):
    world, mp, flags = SOURCES[source]
    saved = tmp_path / source
    whole = start(world, tmp_path, saved, ARGS, extra=flags, oneload=()).wait().check()
    assert sorted(whole.losses) == [1, 2, 3, 4], whole.log[-3000:]
    restore = saved / "checkpoint_2.pt"  # the un-suffixed name: no world size's suffix
    flat = "fully_sharded" in flags

    launches = {}
    for new_world, new_mp in TARGETS[source]:
        extra = ["--model-parallel-size", str(new_mp)] if new_mp is not None else []
        launches[(new_world, new_mp, False)] = start(new_world, tmp_path, tmp_path / f"w{new_world}", ARGS,
                                                     restore=restore, extra=extra)
    new_world, new_mp = TARGETS[source][-1]
    extra = (["--model-parallel-size", str(new_mp)] if new_mp is not None else []) + [
        "--reset-optimizer", "--max-update", "2"]
    launches[(new_world, new_mp, True)] = start(new_world, tmp_path, tmp_path / f"w{new_world}reset", ARGS,
                                                restore=restore, extra=extra)
    runs = {key: launch.wait() for key, launch in launches.items()}

    rows = [f"{source} uninterrupted on {world}: {whole.losses[3]:.3f} {whole.losses[4]:.3f}"]
    for (new_world, new_mp, reset), run in runs.items():
        run.check()
        target_mp = new_mp or mp
        got = [run.losses.get(u, float("nan")) for u in ((1, 2) if reset else (3, 4))]
        rows.append(f"{source} -> MP{target_mp} x DP{new_world // target_mp}{' --reset-optimizer' if reset else ''}:"
                    f" {got[0]:.3f} {got[1]:.3f}")
        assert sorted(run.losses) == ([1, 2] if reset else [3, 4]), (rows, run.log[-3000:])
        assert "Traceback" not in run.log and "but the files hold" not in run.log, run.log[-3000:]
        tol = 0.0 if new_mp is None else MP_CHANGE_TOL
        assert abs(got[0] - whole.losses[3]) <= tol, (rows, run.log[-3000:])  # the weights carried over
        if reset:
            assert abs(got[1] - whole.losses[4]) > 10 * MP_CHANGE_TOL, rows  # the optimizer state did not
            continue
        assert abs(got[1] - whole.losses[4]) <= tol, (rows, run.log[-3000:])
        same = new_mp is None and new_world == world
        assert re.search(rf"oneload: \S+checkpoint_2: strategy={'own_shard' if same else 'reshard'} \(", run.log)
        if new_mp is not None:
            assert f"model-parallel {mp}->{new_mp}" in run.log  # in the one strategy line
            assert f"common.model_parallel_size={new_mp} as this run asks (the files hold {mp})" in run.log
        # The run saves as it chose: its own model-parallel size and data-parallel shards.
        assert sorted(p.name for p in (tmp_path / f"w{new_world}").glob("checkpoint_4-*")) == _saved(
            target_mp, new_world // target_mp, flat)
    print("\n" + "\n".join(rows))
