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


def train(world: int, tmp: Path) -> list:
    site = tmp / "site"
    site.mkdir(exist_ok=True)
    if SHIM.exists():  # metaseq on a CPU-only torch; the shim's fairscale fix is taken back
        (site / "sitecustomize.py").write_text(
            f"import sys\nsys.path.insert(0, {str(SHIM.parent)!r})\nimport metaseq_cpu_shim as s\n"
            "s._F2.load_local_state_dict = s._orig_lsd\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    save = tmp / f"run{world}"
    procs = []
    for r in range(world):
        env = {k: v for k, v in os.environ.items() if k != "METASEQ_ONELOAD"}
        env.update(PYTHONPATH=str(site), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
                   RANK=str(r), LOCAL_RANK=str(r), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(
            [str(TRAIN), *ARGS, "--save-dir", str(save), "--restore-file", str(FIXTURES / "fsdp_dp3" / "checkpoint_last.pt"),
             "+oneload=auto"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env))
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs[0][-3000:]
    losses = [json.loads(line.split("| train_inner | ", 1)[1])["loss"] for line in outs[0].splitlines()
              if "| train_inner | " in line]
    assert "metaseq-oneload: distributed_training.use_sharded_state=True (was False)" in outs[0]
    assert sorted(p.name for p in save.glob("checkpoint_4-*")) == [
        f"checkpoint_4-model_part-0-shard{d}.pt" for d in range(world)]
    return losses


def test_resume_three_shards_on_two_ranks_as_on_three(tmp_path):
    on_three = train(3, tmp_path)
    on_two = train(2, tmp_path)
    assert len(on_three) == 2 and on_two == on_three  # same data each step: same losses iff same state
