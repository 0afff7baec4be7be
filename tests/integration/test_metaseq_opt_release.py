"""The OPT release layout through the real ``metaseq-train +oneload=auto``, on world sizes
other than the saved one, with no loading flag.

``opt_release_mp2`` (tests/fixtures/metaseq) is what metaseq's ``reshard_fsdp`` writes with
its defaults (``--unflatten-weights True``), run per model part of ``mp2_dp2``:
``reshard-model_part-{0,1}.pt``, unflattened weights beside the FSDP ``shard_metadata`` of
the run they came from, no optimizer state; its weights are mp2_dp2's, bit for bit. A user
starts training from it the two ways metaseq offers (``checkpoint_utils.load_checkpoint``):
``--finetune-from-model`` (optimizer, scheduler, meters and data reset) and
``--restore-file``. Here, from its un-suffixed name:

- model parallel 1 on 1 rank, both ways, the run's default backend (pytorch_ddp);
- model parallel 1 x data parallel 3 on 3 ranks, ``--finetune-from-model``, FSDP: 3 ranks
  cannot run the files' model parallel 2, so the run keeps its own 1 (taking the files' 2
  made Megatron assert "3 is not divisible by 2"; on 1 rank Megatron clamped it silently,
  and the run saved a cfg naming model parallel 2 beside one whole part);
- model parallel 2 x data parallel 2 on 4 ranks, ``--finetune-from-model``, FSDP
  (metaseq's pytorch_ddp cannot wrap a CPU model for data parallel > 1: torch's
  DistributedDataParallel refuses ``device_ids`` for a CPU module).

What must hold: the first update's loss (computed on the loaded weights, before any step)
is the loss that the uninterrupted training which made mp2_dp2 logs at update 3, i.e. on
the same weights and the same batch (dummy_lm feeds every update the same sequences). That
run, model parallel 2 x data parallel 2 under FSDP from scratch, plugin off, is measured
here; its update-1 loss (the random initial weights) shows what a run that did not start
from the checkpoint logs. metaseq logs losses to 3 decimals; another model-parallel size
adds the same numbers in another order, well inside that.

Runs where metaseq is importable and metaseq_oneload.pth is installed next to it; skips
otherwise (metaseq is not on PyPI). 13 processes at once: about a minute and a half on two cores.
"""

import pytest

from tests import corpus
from tests.conftest import FIXTURES
from tests.integration.metaseq_run import ARGS, skip_reason, start

pytestmark = pytest.mark.skipif(bool(skip_reason()), reason=skip_reason() or "ready")

OPT = FIXTURES / "opt_release_mp2" / "reshard.pt"
FSDP = ["--ddp-backend", "fully_sharded"]
# Two updates: the first is computed on the loaded weights; metaseq's inverse_sqrt warm-up
# starts at learning rate 0, so the second one too.
TWO = ["--max-update", "2"]


def test_opt_release_trains_on_other_world_sizes(tmp_path):
    launches = {
        # mp2_dp2's own training, one update further: its update-3 loss is that of mp2_dp2's weights.
        "uninterrupted": start(4, tmp_path, tmp_path / "uninterrupted", ARGS, oneload=(),
                               extra=FSDP + ["--use-sharded-state", "--model-parallel-size", "2", "--max-update", "3"]),
        "finetune MP1 x DP1": start(1, tmp_path, tmp_path / "ft1", ARGS, extra=["--finetune-from-model", str(OPT)] + TWO),
        "restore MP1 x DP1": start(1, tmp_path, tmp_path / "rs1", ARGS, restore=OPT, extra=TWO),
        "finetune MP1 x DP3": start(3, tmp_path, tmp_path / "ft3", ARGS,
                                    extra=["--finetune-from-model", str(OPT)] + TWO + FSDP),
        "finetune MP2 x DP2": start(4, tmp_path, tmp_path / "ft4", ARGS,
                                    extra=["--finetune-from-model", str(OPT)] + TWO + FSDP),
    }
    runs = {name: launch.wait() for name, launch in launches.items()}
    whole = runs.pop("uninterrupted").check()
    assert sorted(whole.losses) == [1, 2, 3], whole.log[-3000:]
    rows = [f"uninterrupted MP2 x DP2 from scratch: {whole.losses}"]
    for name, run in runs.items():
        rows.append(f"{name} from opt_release_mp2: {run.losses}")
        run.check()
        assert "Traceback" not in run.log, run.log[-3000:]
        assert sorted(run.losses) == [1, 2], (rows, run.log[-3000:])
        assert run.losses[1] == whole.losses[3], rows  # started from the release's weights
        assert abs(run.losses[1] - whole.losses[1]) > 0.1, rows  # which a fresh start does not give
        # the release's stale FSDP metadata is seen as such, not believed
        assert "keeps the shard_metadata of the FSDP run it came from" in run.log, run.log[-3000:]
    for name, world in (("finetune MP1 x DP1", 1), ("restore MP1 x DP1", 1), ("finetune MP1 x DP3", 3)):
        log = runs[name].log
        assert "opt_release_mp2/reshard: strategy=reshard (" in log and "model-parallel 2->1" in log, log[-3000:]
        assert (f"common.model_parallel_size=1 kept: the files hold 2, which {world} rank(s) cannot run; "
                "loaded onto 1") in log, log[-3000:]
        assert "common.model_parallel_size=2" not in log, log[-3000:]
    assert "common.model_parallel_size=2 (was 1): from " in runs["finetune MP2 x DP2"].log
    # The runs save as they ran: one unflattened part on 1 rank (its cfg saying so), 3 flat
    # shards on 3, 2 parts x 2 flat shards on 4.
    assert sorted(p.name for p in (tmp_path / "ft1").glob("checkpoint_2-*")) == ["checkpoint_2-model_part-0.pt"]
    assert corpus.raw(tmp_path / "ft1" / "checkpoint_2-model_part-0.pt")["cfg"]["common"]["model_parallel_size"] == 1
    assert sorted(p.name for p in (tmp_path / "ft3").glob("checkpoint_2-*")) == [
        f"checkpoint_2-model_part-0-shard{d}.pt" for d in range(3)]
    assert sorted(p.name for p in (tmp_path / "ft4").glob("checkpoint_2-*")) == [
        f"checkpoint_2-model_part-{m}-shard{d}.pt" for m in (0, 1) for d in (0, 1)]
    print("\n" + "\n".join(rows))
