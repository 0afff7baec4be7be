"""Launch the real ``metaseq-train`` on N gloo ranks of this machine, as a user would:
one process per rank (metaseq's env:// path; its own spawn wants GPUs), the installed
``metaseq_oneload.pth`` start-up hook, ``+oneload=auto`` on the command line.

Needs metaseq installed from its repository (it is not on PyPI) with ``metaseq-train``
next to this Python, and this package installed there (the ``.pth`` hook); the tests that
use this module skip with the reason :func:`skip_reason` gives otherwise. On a CPU-only
torch every rank imports ``tests/integration_shims/metaseq_cpu_shim.py`` first.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import List, Optional, Sequence

from tests.conftest import REPO
from tests.unit.test_metaseq_patch import SHIM, _why_not

TRAIN = Path(sys.executable).with_name("metaseq-train")
PTH = Path(sysconfig.get_paths()["purelib"]) / "metaseq_oneload.pth"

# The fixtures' model and task (tests/fixtures/metaseq/README.md), trained to update 4 and
# saved at 2 and 4. dummy_lm feeds every rank the same sequences, so the losses do not depend
# on the data-parallel size: a resumed run must log the losses of an uninterrupted one.
COMMON = ("--task dummy_lm --dict-size 60 --tokens-per-sample 16 --dataset-size 64 --batch-size 2 "
          "--arch transformer_lm_gpt2_tiny --decoder-layers 2 --decoder-learned-pos "
          "--share-decoder-input-output-embed --no-scale-embedding --activation-fn relu --dropout 0 "
          "--attention-dropout 0 --min-params-to-wrap 0 --criterion vocab_parallel_cross_entropy --optimizer adam "
          "--lr 0.001 --max-update 4 --save-interval-updates 2 "
          "--cpu --distributed-backend gloo --log-format json --log-interval 1 --num-workers 0 --seed 1").split()
INVERSE_SQRT = "--lr-scheduler inverse_sqrt --warmup-updates 1".split()
FIXTURE_MODEL = "--decoder-embed-dim 34 --decoder-ffn-embed-dim 64 --decoder-attention-heads 2".split()
ARGS = tuple(COMMON + INVERSE_SQRT + FIXTURE_MODEL)


def skip_reason() -> str:
    """Why real ``metaseq-train`` runs cannot happen here ("" when they can)."""
    return _why_not() or ("" if TRAIN.exists() else f"no {TRAIN} next to this Python") or (
        "" if PTH.exists() else f"the start-up hook is not installed ({PTH}); pip install this package")


@dataclasses.dataclass(frozen=True)
class Run:
    """One launch: rank 0's train_inner losses by update, every rank's exit code and output."""

    losses: dict  # num_updates -> loss, as rank 0 logs it
    returncodes: tuple
    outputs: tuple

    @property
    def log(self) -> str:
        return self.outputs[0]

    def check(self) -> "Run":
        assert all(rc == 0 for rc in self.returncodes), self.log[-4000:]
        return self


def _site(tmp: Path) -> Path:
    """A sitecustomize that imports the CPU shim before metaseq, in every rank. The shim's
    own fixes for fairscale's load_local_state_dict is taken back: install() provides it."""
    site = tmp / "site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(
        f"import sys\nsys.path.insert(0, {str(SHIM.parent)!r})\nimport metaseq_cpu_shim as s\n"
        "s._F2.load_local_state_dict = s._orig_lsd\n")
    return site


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Launch:
    """``metaseq-train`` started on ``world`` ranks; :meth:`wait` collects it."""

    def __init__(self, world: int, tmp: Path, save_dir: Path, args: Sequence[str], *,
                 oneload: Sequence[str] = ("+oneload=auto",)):
        site = _site(tmp)
        port = _free_port()
        self.procs = []
        self.logs = [save_dir.parent / f"{save_dir.name}.rank{r}.log" for r in range(world)]
        for r in range(world):
            env = {k: v for k, v in os.environ.items() if k != "METASEQ_ONELOAD"}
            # The checkout under test first (not whatever copy is installed), then the shim.
            env.update(PYTHONPATH=os.pathsep.join([str(site), str(REPO)]), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(r), LOCAL_RANK=str(r),
                       OMP_NUM_THREADS="1")
            self.procs.append(subprocess.Popen(
                [str(TRAIN), *args, "--save-dir", str(save_dir), *oneload],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=str(tmp)))

    def wait(self, timeout: float = 600) -> Run:
        outs = []
        for p in self.procs:
            try:
                outs.append(p.communicate(timeout=timeout)[0])
            except subprocess.TimeoutExpired:
                for q in self.procs:
                    q.kill()
                raise
        for path, out in zip(self.logs, outs):  # kept for a look after a failure
            path.write_text(out)
        losses = {}
        for line in outs[0].splitlines():
            if "| train_inner | " in line:
                stats = json.loads(line.split("| train_inner | ", 1)[1])
                losses[int(stats["num_updates"])] = float(stats["loss"])
        return Run(losses, tuple(p.returncode for p in self.procs), tuple(outs))


def train(world: int, tmp: Path, save_dir: Path, args: Sequence[str] = ARGS, *, restore: Optional[Path] = None,
          extra: Sequence[str] = (), oneload: Sequence[str] = ("+oneload=auto",)) -> Run:
    """``metaseq-train`` on ``world`` ranks to update 4 (resumed from ``restore``), checked
    to have exited 0 on every rank."""
    return start(world, tmp, save_dir, args, restore=restore, extra=extra, oneload=oneload).wait().check()


def start(world: int, tmp: Path, save_dir: Path, args: Sequence[str] = ARGS, *, restore: Optional[Path] = None,
          extra: Sequence[str] = (), oneload: Sequence[str] = ("+oneload=auto",)) -> Launch:
    """Like :func:`train`, not waiting: launches on separate ports run side by side."""
    full: List[str] = [*args, *extra]
    if restore is not None:
        full += ["--restore-file", str(restore)]
    return Launch(world, tmp, save_dir, full, oneload=oneload)
