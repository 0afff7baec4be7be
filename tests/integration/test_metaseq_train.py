"""``metaseq-train +oneload=auto`` end to end, with the real metaseq and the installed
start-up hook: the padded 3-shard checkpoint resumes on 2 ranks (weights and optimizer state
resharded) exactly as on the 3 ranks that saved it.

Runs where metaseq is importable and metaseq_oneload.pth is installed next to it; skips
otherwise (metaseq is not on PyPI).
"""

import json
import os
import socket
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.conftest import FIXTURES, needs_fixtures
from tests.unit.test_metaseq_patch import SHIM, _why_not

TRAIN = Path(sys.executable).with_name("metaseq-train")
PTH = Path(sysconfig.get_paths()["purelib"]) / "metaseq_oneload.pth"


def _skip_reason() -> str:
    return _why_not() or ("" if TRAIN.exists() else f"no {TRAIN}") or (
        "" if PTH.exists() else f"the start-up hook is not installed ({PTH}); pip install the package")


pytestmark = [needs_fixtures, pytest.mark.skipif(bool(_skip_reason()), reason=_skip_reason() or "ready")]

# The fixtures' model and task (../shared/fixtures/metaseq/README.md); two more updates.
ARGS = ("--task dummy_lm --dict-size 60 --tokens-per-sample 16 --dataset-size 64 --batch-size 2 "
        "--arch transformer_lm_gpt2_tiny --decoder-layers 2 --decoder-embed-dim 34 --decoder-ffn-embed-dim 64 "
        "--decoder-attention-heads 2 --decoder-learned-pos --share-decoder-input-output-embed --no-scale-embedding "
        "--activation-fn relu --dropout 0 --attention-dropout 0 --min-params-to-wrap 0 "
        "--criterion vocab_parallel_cross_entropy --optimizer adam --lr 0.001 --lr-scheduler inverse_sqrt "
        "--warmup-updates 1 --max-update 4 --save-interval-updates 2 --cpu --distributed-backend gloo "
        "--log-format json --log-interval 1 --num-workers 0 --seed 1").split()


def train(world: int, tmp: Path, *, restore: Path = FIXTURES / "fsdp_dp3" / "checkpoint_last.pt", extra=(),
          overrides=(), name: str = "") -> tuple:
    """Two more updates with metaseq-train on ``world`` ranks, resumed from ``restore``:
    (the losses rank 0 logs, its whole output)."""
    site = tmp / "site"
    site.mkdir(parents=True, exist_ok=True)
    if SHIM.exists():  # metaseq on a CPU-only torch; the shim's fairscale fix is taken back
        (site / "sitecustomize.py").write_text(
            f"import sys\nsys.path.insert(0, {str(SHIM.parent)!r})\nimport metaseq_cpu_shim as s\n"
            "s._F2.load_local_state_dict = s._orig_lsd\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    save = tmp / f"run{world}{name}"
    procs = []
    for r in range(world):
        env = {k: v for k, v in os.environ.items() if k != "METASEQ_ONELOAD"}
        env.update(PYTHONPATH=str(site), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
                   RANK=str(r), LOCAL_RANK=str(r), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(
            [str(TRAIN), *ARGS, *extra, "--save-dir", str(save), "--restore-file", str(restore), "+oneload=auto",
             *overrides], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env))
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs[0][-3000:]
    losses = [json.loads(line.split("| train_inner | ", 1)[1])["loss"] for line in outs[0].splitlines()
              if "| train_inner | " in line]
    return losses, outs[0]


def test_resume_three_shards_on_two_ranks_as_on_three(tmp_path):
    on_three, out3 = train(3, tmp_path)
    on_two, out2 = train(2, tmp_path)
    for world, out in ((3, out3), (2, out2)):
        assert "metaseq-oneload: distributed_training.use_sharded_state=True (was False)" in out
        assert sorted(p.name for p in (tmp_path / f"run{world}").glob("checkpoint_4-*")) == [
            f"checkpoint_4-model_part-0-shard{d}.pt" for d in range(world)]
    assert len(on_three) == 2 and on_two == on_three  # same data each step: same losses iff same state


def test_resume_onto_another_model_parallel_size(tmp_path):
    """Model parallel 1 (fsdp_dp3) resumed with model parallel 2: the weights and the Adam
    state are split the Megatron way (no longer refused), so the run continues as one
    resumed from mp2_dp2, the same training saved at model parallel 2 (same data, states
    equal to ~1e-7)."""
    mp2 = ["--model-parallel-size", "2"]
    split, out = train(2, tmp_path, extra=mp2, overrides=["oneload.strategy=reshard"], name="split")
    assert "optimizer state resharded from 1x3 to 2x1" in out
    native, _ = train(2, tmp_path, restore=FIXTURES / "mp2_dp2" / "checkpoint_last.pt", extra=mp2, name="native")
    assert len(split) == len(native) == 2
    assert max(abs(float(a) - float(b)) for a, b in zip(split, native)) < 1e-3, (split, native)


def test_flat_optimizer_state_resumes_an_unflattened_model(tmp_path):
    """FSDP flat shards resumed by pytorch_ddp (one rank): the trainer's model gives the
    parameter order the flat shards do not record, so the Adam state follows too; the run
    continues as the FSDP one does."""
    ddp, out = train(1, tmp_path, extra=["--ddp-backend", "pytorch_ddp", "--use-sharded-state"],
                     overrides=["oneload.strategy=reshard"], name="ddp")
    assert "optimizer state resharded from 1x3 to 1x1 like the weights" in out
    fsdp, _ = train(1, tmp_path, name="fsdp")
    assert len(ddp) == len(fsdp) == 2
    assert max(abs(float(a) - float(b)) for a, b in zip(ddp, fsdp)) < 1e-3, (ddp, fsdp)
