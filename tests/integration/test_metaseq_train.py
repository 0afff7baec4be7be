"""``metaseq-train +oneload=auto`` end to end, with the real metaseq and the installed
start-up hook, on the committed fixtures: the padded 3-shard checkpoint resumes on 2 ranks
(weights and optimizer state resharded) exactly as on the 3 ranks that saved it; a run's own
model-parallel size and backend are honoured; a setting that cannot be loaded onto stops
every rank with its message. The resume matrix on other world sizes is in
test_metaseq_resume.py.

Runs where metaseq is importable and metaseq_oneload.pth is installed next to it; skips
otherwise (metaseq is not on PyPI).
"""

import pytest

from tests.conftest import FIXTURES, needs_fixtures
from tests.integration.metaseq_run import train, start, skip_reason

pytestmark = [needs_fixtures, pytest.mark.skipif(bool(skip_reason()), reason=skip_reason() or "ready")]

LAST = FIXTURES / "fsdp_dp3" / "checkpoint_last.pt"


def test_resume_three_shards_on_two_ranks_as_on_three(tmp_path):
    on_three = train(3, tmp_path, tmp_path / "run3", restore=LAST)
    on_two = train(2, tmp_path, tmp_path / "run2", restore=LAST)
    for world, run in ((3, on_three), (2, on_two)):
        assert "metaseq-oneload: distributed_training.use_sharded_state=True (was False)" in run.log
        assert sorted(p.name for p in (tmp_path / f"run{world}").glob("checkpoint_4-*")) == [
            f"checkpoint_4-model_part-0-shard{d}.pt" for d in range(world)]
    assert sorted(on_three.losses) == [3, 4] and on_two.losses == on_three.losses  # same data: same state


def test_resume_onto_another_model_parallel_size(tmp_path):
    """Model parallel 1 (fsdp_dp3) resumed with the run's own --model-parallel-size 2 under
    auto (no strategy, no other flag): the weights and the Adam state are split the Megatron
    way, so the run continues as one resumed from mp2_dp2, the same training saved at model
    parallel 2 (same data, states equal to ~1e-7)."""
    mp2 = ["--model-parallel-size", "2"]
    split = train(2, tmp_path, tmp_path / "split", restore=LAST, extra=mp2)
    assert "common.model_parallel_size=2 as this run asks (the files hold 1)" in split.log
    assert "optimizer state resharded from 1x3 to 2x1" in split.log
    assert "model-parallel 1->2" in split.log  # the one strategy line
    native = train(2, tmp_path, tmp_path / "native", restore=FIXTURES / "mp2_dp2" / "checkpoint_last.pt", extra=mp2)
    assert sorted(split.losses) == sorted(native.losses) == [3, 4]
    assert max(abs(split.losses[u] - native.losses[u]) for u in (3, 4)) < 1e-3, (split.losses, native.losses)


def test_flat_optimizer_state_resumes_an_unflattened_model(tmp_path):
    """FSDP flat shards resumed by the run's own pytorch_ddp (one rank): the trainer's model
    gives the parameter order the flat shards do not record, so the Adam state follows too;
    the run continues as the FSDP one does."""
    ddp = train(1, tmp_path, tmp_path / "ddp", restore=LAST, extra=["--ddp-backend", "pytorch_ddp"])
    assert "distributed_training.ddp_backend=pytorch_ddp as this run asks (the files hold fully_sharded)" in ddp.log
    assert "optimizer state resharded from 1x3 to 1x1 like the weights" in ddp.log
    fsdp = train(1, tmp_path, tmp_path / "fsdp", restore=LAST)
    assert sorted(ddp.losses) == sorted(fsdp.losses) == [3, 4]
    assert max(abs(ddp.losses[u] - fsdp.losses[u]) for u in (3, 4)) < 1e-3, (ddp.losses, fsdp.losses)


def test_a_setting_that_cannot_be_loaded_onto_stops_every_rank_with_its_message(tmp_path):
    run = start(2, tmp_path, tmp_path / "own", restore=FIXTURES / "mp2_ddp" / "checkpoint_last.pt",
                extra=["--model-parallel-size", "1"], oneload=["+oneload=auto", "oneload.strategy=own_shard"]).wait()
    assert run.returncodes == (2, 2)
    for out in run.outputs:
        assert "Traceback" not in out, out[-3000:]
        assert ("metaseq-oneload: --model-parallel-size 1 (common.model_parallel_size): oneload.strategy=own_shard "
                "reads the files as they are, and ") in out
        assert "hold model_parallel_size=2 (2 model-parallel part(s)). Drop --model-parallel-size" in out
