"""Run real fairseq 0.12.2 command lines (``fairseq-train``, ``-validate``, ``-eval-lm``) on
N gloo ranks of this machine, as a user would, with this checkout's metaseq-oneload.

Every rank runs ``tests/integration_shims/fairseq_run.py``, which imports the CPU shim
(fairscale's FSDP and Megatron on a CPU-only torch, gloo) and then fairseq's own
``cli_main``; several ranks are started by ``torchrun``. fairseq is not installable on
Python 3.11 as it is on PyPI, and needs ``numpy<2``: ``tests/integration/build_fairseq.py``
(which ``make test`` runs first) builds it from the sdist into a venv of its own, and every
fairseq process here runs in that venv's Python (:data:`PYTHON`, see :func:`fairseq_python`),
with this checkout on its ``PYTHONPATH``. Tests using this module skip with
:func:`skip_reason` where there is no such Python (the build's reason when it failed).

The data is the fixtures' own: the README's 200/40/40 lines of random words, binarized
with the committed ``dict.txt``, so a fixture's validation loss is the one fairseq logged
when it was written (``fsdp``: 5.712).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import os
import random
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Dict, Optional, Sequence

from tests.conftest import REPO
from tests.integration import build_fairseq

FAIRSEQ_FIXTURES = REPO / "tests" / "fixtures" / "fairseq"
RUNNER = REPO / "tests" / "integration_shims" / "fairseq_run.py"
SHIMS = RUNNER.parent

# The fixtures' model (tests/fixtures/fairseq/README.md, $MODEL).
MODEL = ("--task language_modeling --arch transformer_lm --decoder-layers 2 --decoder-embed-dim 32 "
         "--decoder-ffn-embed-dim 64 --decoder-attention-heads 2 --tokens-per-sample 16 --max-tokens 256 "
         "--optimizer adam --lr 1e-3 --cpu --no-epoch-checkpoints").split()


def fairseq_python() -> "tuple[Optional[str], str]":
    """The Python that runs real fairseq here, and why there is none (``(None, reason)``):

    1. ``$METASEQ_ONELOAD_FAIRSEQ_PYTHON``, a Python of your own with fairseq installed;
    2. this Python, when it imports fairseq itself (pytest run with such a Python);
    3. the venv ``tests/integration/build_fairseq.py`` built (its stamp written).
    """
    given = os.environ.get("METASEQ_ONELOAD_FAIRSEQ_PYTHON")
    if given:
        return (given, "") if Path(given).exists() else (None, f"METASEQ_ONELOAD_FAIRSEQ_PYTHON={given}: no such file")
    if all(importlib.util.find_spec(name) is not None for name in ("fairseq", "fairscale", "omegaconf", "hydra")):
        return sys.executable, ""
    if build_fairseq.built():
        return str(build_fairseq.python()), ""
    return None, (build_fairseq.failure() or
                  f"real fairseq {build_fairseq.FAIRSEQ} is not built: run `python tests/integration/build_fairseq.py` "
                  "(make test does), or set METASEQ_ONELOAD_FAIRSEQ_PYTHON")


PYTHON, _WHY_NOT = fairseq_python()


def skip_reason() -> str:
    """Why real fairseq runs cannot happen here ("" when they can)."""
    return _WHY_NOT


@functools.lru_cache(maxsize=None)
def megatron_reason() -> str:
    """Why fairseq's model parallel (its Megatron submodule, not on PyPI) cannot run here."""
    probe = ("import importlib.util as u, os, sys; d = u.find_spec('fairseq').submodule_search_locations[0]; "
             "sys.exit(0 if os.path.isdir(os.path.join(d, 'model_parallel', 'megatron', 'mpu')) else 3)")
    p = subprocess.run([PYTHON, "-c", probe], capture_output=True, text=True, env=_env(None))
    if p.returncode == 0:
        return ""
    return (f"fairseq's Megatron submodule (fairseq/model_parallel/megatron, not on PyPI) is missing in {PYTHON}"
            if p.returncode == 3 else f"{PYTHON} cannot import fairseq.model_parallel: {p.stderr[-500:]}")


@functools.lru_cache(maxsize=None)
def _hook() -> None:
    """Put into the built venv the package's start-up hook (``metaseq_oneload.pth``, which
    ``+oneload=auto`` and ``METASEQ_ONELOAD`` go through), as the package's install would;
    the package itself comes from this checkout through ``PYTHONPATH`` (:func:`_env`)."""
    if PYTHON != str(build_fairseq.python()):
        return  # a Python of your own: install the package there (pip install -e .)
    purelib = subprocess.run([PYTHON, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    pth, ours = Path(purelib) / "metaseq_oneload.pth", (REPO / "metaseq_oneload.pth").read_text()
    if not pth.is_file() or pth.read_text() != ours:
        pth.write_text(ours)


def python() -> str:
    """fairseq's Python, with the start-up hook in place (for the tests' subprocesses)."""
    assert PYTHON is not None, _WHY_NOT
    _hook()
    return PYTHON


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(oneload_env: Optional[str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "METASEQ_ONELOAD"}
    # This checkout first (not whatever copy is installed); one thread per rank on 2 cores.
    env.update(PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               OMP_NUM_THREADS="1")
    if oneload_env is not None:
        env["METASEQ_ONELOAD"] = oneload_env
    return env


def make_data(root: Path) -> Path:
    """(local) The fixtures' corpus binarized with their dictionary, in ``root/DATA``."""
    rng = random.Random(0)
    for name, lines in (("train", 200), ("valid", 40), ("test", 40)):
        with open(root / f"{name}.txt", "w") as f:
            for _ in range(lines):
                f.write(" ".join(f"w{rng.randrange(50)}" for _ in range(rng.randint(5, 15))) + "\n")
    data = root / "DATA"
    subprocess.run([python(), "-m", "fairseq_cli.preprocess", "--only-source", "--srcdict",
                    str(FAIRSEQ_FIXTURES / "dict.txt"), "--trainpref", str(root / "train.txt"),
                    "--validpref", str(root / "valid.txt"), "--testpref", str(root / "test.txt"),
                    "--destdir", str(data), "--workers", "1"], check=True, capture_output=True, env=_env(None))
    return data


@dataclasses.dataclass(frozen=True)
class Result:
    returncode: int
    output: str

    def check(self) -> "Result":
        assert self.returncode == 0, self.output[-5000:]
        return self

    @property
    def valid_loss(self) -> float:
        """fairseq-validate's (or -train's last) ``valid on 'valid' subset | loss X``."""
        found = re.findall(r"valid on 'valid' subset \| loss ([0-9.]+)", self.output)
        assert found, self.output[-3000:]
        return float(found[-1])

    @property
    def perplexity(self) -> float:
        """fairseq-eval-lm's ``Perplexity: X``."""
        found = re.findall(r"Loss \(base 2\): [0-9.]+, Perplexity: ([0-9.]+)", self.output)
        assert found, self.output[-3000:]
        return float(found[-1])

    @property
    def losses(self) -> Dict[int, float]:
        """fairseq-train's train_inner losses by update (``--log-format json``)."""
        out = {}
        for line in self.output.splitlines():
            if "| train_inner | " in line:
                stats = json.loads(line.split("| train_inner | ", 1)[1])
                out[int(stats["num_updates"])] = float(stats["loss"])
        return out


def run(command: str, world: int, args: Sequence[str], *, cwd: Path, oneload_env: Optional[str] = None,
        timeout: float = 300) -> Result:
    """fairseq's ``command`` (train, validate, eval_lm) on ``world`` ranks, under torchrun
    (with ``--distributed-world-size`` and gloo) for several ranks and for training: fairseq's
    FSDP wrapper broadcasts through torch.distributed even on one rank.
    ``oneload_env``: METASEQ_ONELOAD."""
    args = list(args)
    if world == 1 and command != "train":
        cmd = [python(), str(RUNNER), command, *args]
    else:
        cmd = [python(), "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_addr",
               "127.0.0.1", "--master_port", str(_free_port()), str(RUNNER), command, *args,
               "--distributed-world-size", str(world), "--distributed-backend", "gloo"]
    p = subprocess.run(cmd, capture_output=True, text=True, env=_env(oneload_env), cwd=str(cwd), timeout=timeout)
    return Result(p.returncode, p.stdout + p.stderr)
