"""Build real fairseq 0.12.2 for the fairseq integration tests, into a cached folder outside
this repository's package and outside git, and say so in one line.

    python tests/integration/build_fairseq.py        # what `make test` runs first

fairseq 0.12.2 (its last release) is on PyPI only as an sdist for Python 3.6-3.8. This script,
run with the test environment's Python (3.11, the pinned CPU torch):

1. makes a separate venv in the cache folder (fairseq needs ``numpy<2``, which the test
   environment does not have), with the test environment's exact torch version first (so pip
   takes the same CPU wheel and never a CUDA build), then fairseq's runtime dependencies at
   versions that import on Python 3.11 (fairseq's own pins, hydra-core<1.1 and
   omegaconf<2.1, do not);
2. downloads the sdist with pip (``--no-build-isolation``: else pip builds setuptools and
   Cython from source just to read the metadata) and unpacks it in the cache folder;
3. applies four fixes there (:func:`patch`): the three C++ extensions whose sources the
   sdist lacks are left out, and the nested config fields Python 3.11 rejects as instance
   defaults become ``default_factory`` ones (and ``hydra_init`` reads those);
4. installs that copy editable into the venv (about 1.5 minutes on 2 cores: ``libbleu``,
   ``data_utils_fast``, ``token_block_utils_fast``).

Nothing of fairseq is committed here. The folder is keyed by the fairseq, Python and torch
versions and this script's fixes (:data:`RECIPE`); a stamp written last marks a finished
build, which later runs reuse (a half build is redone from scratch). When the build fails (no
package registry, a compile error), the reason goes to ``skip_reason.txt`` in the folder and
the fairseq tests skip with it. Megatron (fairseq's model-parallel submodule) is not on PyPI
and is not built: tests that need it skip.

The folder: ``$METASEQ_ONELOAD_FAIRSEQ_HOME`` if set, else
``${XDG_CACHE_HOME:-~/.cache}/metaseq_oneload/fairseq-0.12.2-py3.11-torch<version>-r<RECIPE>``.
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Optional

FAIRSEQ = "0.12.2"
# Bump when the fixes or the dependency set below change: a new folder is built.
RECIPE = 2
DEPENDENCIES = ["setuptools", "wheel", "cython", "numpy<2", "regex", "sacrebleu", "bitarray", "tqdm", "cffi",
                "omegaconf==2.3.1", "hydra-core==1.3.8", "fairscale==0.4.13",
                # metaseq-oneload's own dependency (setup.cfg), imported where fairseq runs it.
                "blake3>=0.4,<2",
                # fairscale's testing module imports pytest; fairseq uses it for FSDP at world size 1.
                "pytest"]
STAMP = "built.json"
REASON = "skip_reason.txt"
LOG = "build.log"


def torch_version() -> Optional[str]:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def home() -> Path:
    """The cache folder for this Python and torch."""
    if os.environ.get("METASEQ_ONELOAD_FAIRSEQ_HOME"):
        return Path(os.environ["METASEQ_ONELOAD_FAIRSEQ_HOME"]).expanduser()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    py = "%d.%d" % sys.version_info[:2]
    torch = str(torch_version()).replace("+", "_")
    return cache / "metaseq_oneload" / f"fairseq-{FAIRSEQ}-py{py}-torch{torch}-r{RECIPE}"


def python(root: Optional[Path] = None) -> Path:
    return (root or home()) / "venv" / "bin" / "python"


def built(root: Optional[Path] = None) -> bool:
    root = root or home()
    return (root / STAMP).is_file() and python(root).exists()


def failure(root: Optional[Path] = None) -> str:
    """Why the last build in the folder failed ("" if it did not, or none ran)."""
    path = (root or home()) / REASON
    return path.read_text().strip() if path.is_file() else ""


# ---------------------------------------------------------------------------------------------
# The four fixes (tests/integration/README.md; each keeps fairseq's behaviour otherwise).

_CONFIG_FIELDS = ("common", "common_eval", "distributed_training", "dataset", "optimization", "checkpoint",
                  "bmuf", "generation", "eval_lm", "interactive", "ema")


def _sub(path: Path, pattern: str, repl, count: int) -> None:
    text = path.read_text()
    new, n = re.subn(pattern, repl, text, flags=re.M)
    if n != count:
        raise RuntimeError(f"fix of {path.name}: {pattern!r} matched {n} times, expected {count}")
    path.write_text(new)


def patch(src: Path) -> None:
    # 1. setup.py: keep only the extensions whose source files are all in the sdist (it lacks
    #    fairseq/clib/libbase, fairseq/clib/libnat and examples/operators).
    _sub(src / "setup.py", r"^(if \"READTHEDOCS\" in os\.environ:)",
         "extensions = [e for e in extensions if all(os.path.exists(s) for s in e.sources)]\n\n\\1", 1)
    # 2. FairseqConfig: 11 nested configs as instance defaults -> default_factory.
    names = "|".join(_CONFIG_FIELDS)
    _sub(src / "fairseq" / "dataclass" / "configs.py", rf"^(    (?:{names}): (\w+)) = \2\(\)$",
         r"\1 = field(default_factory=\2)", len(_CONFIG_FIELDS))
    # 3. TransformerConfig: encoder, decoder, quant_noise.
    tc = src / "fairseq" / "models" / "transformer" / "transformer_config.py"
    _sub(tc, r"^(    (?:encoder|decoder): (\w+)) = \2\(\)$", r"\1 = field(default_factory=\2)", 2)
    _sub(tc, r"^(    quant_noise: (\w+)) = field\(default=\2\(\)\)$", r"\1 = field(default_factory=\2)", 1)
    # 4. hydra_init reads each field's .default: call default_factory where that is set.
    _sub(src / "fairseq" / "dataclass" / "initialize.py",
         r"^(        )v = FairseqConfig\.__dataclass_fields__\[k\]\.default$",
         "\\1f = FairseqConfig.__dataclass_fields__[k]\n"
         "\\1v = f.default_factory() if callable(f.default_factory) else f.default", 1)


# ---------------------------------------------------------------------------------------------


class BuildError(RuntimeError):
    pass


def _run(cmd, log, **kw) -> None:
    log.write(f"$ {' '.join(map(str, cmd))}\n")
    log.flush()
    p = subprocess.run([str(c) for c in cmd], stdout=log, stderr=subprocess.STDOUT, **kw)
    if p.returncode:
        raise BuildError(f"{' '.join(map(str, cmd[:4]))} ... exited with {p.returncode}")


def _last_error(log_path: Path) -> str:
    """The first error line of the last command in the log."""
    lines = [ln.strip() for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()]
    starts = [i for i, ln in enumerate(lines) if ln.startswith("$ ")]
    last = lines[starts[-1] + 1:] if starts else lines
    errors = [ln for ln in last if re.search(r"^error|error:|could not|no matching|failed", ln, re.I)]
    return (errors or last or [""])[0][:300]


def build(root: Path) -> None:
    torch = torch_version()
    if torch is None:
        raise BuildError(f"torch is not installed in {sys.executable}")
    if root.exists():
        shutil.rmtree(root)  # a half build (no stamp): start again
    root.mkdir(parents=True)
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
    env.pop("PYTHONPATH", None)
    pip = [python(root), "-m", "pip", "install", "-q", "--retries", "1", "--timeout", "30"]
    with open(root / LOG, "w") as log:
        _run([sys.executable, "-m", "venv", root / "venv"], log, env=env)
        # The test environment's torch first (the CPU wheel on this machine's disk), then the
        # rest constrained to it, so that no dependency drags in another (CUDA) build.
        (root / "constraints.txt").write_text(f"torch=={torch}\n")
        _run([*pip, f"torch=={torch}"], log, env=env)
        _run([*pip, "-c", root / "constraints.txt", *DEPENDENCIES], log, env=env)
        dl = root / "sdist"
        dl.mkdir()
        _run([python(root), "-m", "pip", "download", "-q", "--retries", "1", "--timeout", "30", "--no-deps",
              "--no-binary", ":all:", "--no-build-isolation", "-d", dl, f"fairseq=={FAIRSEQ}"], log, env=env)
        archive = next(dl.glob(f"fairseq-{FAIRSEQ}.tar.gz"), None)
        if archive is None:
            raise BuildError(f"pip download left no fairseq-{FAIRSEQ}.tar.gz")
        with tarfile.open(archive) as tar:
            try:
                tar.extractall(root, filter="data")
            except TypeError:  # Python without extraction filters (< 3.10.12)
                tar.extractall(root)
        src = root / f"fairseq-{FAIRSEQ}"
        log.write("applying the four Python 3.11 fixes\n")
        patch(src)
        _run([*pip, "-c", root / "constraints.txt", "--no-deps", "--no-build-isolation", "-e", src], log,
             env=dict(env, MAX_JOBS="2"), cwd=root)
        _run([python(root), "-c", "import fairseq, fairscale, omegaconf, hydra, numpy, torch; "
              "from fairseq import checkpoint_utils; from fairseq.data import data_utils_fast; "
              f"assert fairseq.__version__ == {FAIRSEQ!r}, fairseq.__version__; "
              f"assert torch.__version__ == {torch!r}, torch.__version__"], log, env=env, cwd=root)


def main() -> int:
    root = home()
    if built(root):
        print(f"fairseq {FAIRSEQ}: cached in {root}")
        return 0
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
        lock = open(root.parent / (root.name + ".lock"), "w")
    except OSError as e:
        print(f"building fairseq {FAIRSEQ} failed: {e}")
        return 1
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another build of the same folder (a second make test) finishes first
        if built(root):
            print(f"fairseq {FAIRSEQ}: cached in {root}")
            return 0
        return _build_and_stamp(root)


def _build_and_stamp(root: Path) -> int:
    start = time.monotonic()
    try:
        build(root)
    except Exception as e:  # noqa: BLE001  (every failure becomes the tests' skip reason)
        log = root / LOG
        detail = _last_error(log) if log.is_file() else ""
        reason = (f"building fairseq {FAIRSEQ} failed ({e}{'; ' + detail if detail else ''}); "
                  f"see {log}" if log.is_file() else f"building fairseq {FAIRSEQ} failed: {e}")
        try:
            root.mkdir(parents=True, exist_ok=True)
            (root / REASON).write_text(reason + "\n")
        except OSError:
            pass
        print(reason)
        return 1
    (root / REASON).unlink(missing_ok=True)
    stamp = {"fairseq": FAIRSEQ, "python": sys.version.split()[0], "torch": torch_version(), "recipe": RECIPE,
             "seconds": round(time.monotonic() - start)}
    tmp = root / (STAMP + ".tmp")
    tmp.write_text(json.dumps(stamp) + "\n")
    tmp.replace(root / STAMP)  # last: a build without it is redone
    print(f"fairseq {FAIRSEQ}: built in {stamp['seconds']} s into {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
