"""The package as a user gets it: a wheel built from this tree, installed into a fresh venv.

No editable install, no source tree on ``sys.path``: the console script, ``python -m``,
``inspect --json`` on a real checkpoint, Hydra finding the ``oneload`` group from a folder
outside the repository, and no top-level ``hydra_configs`` package.

Kept to well under a minute: the wheel is built without build isolation (this venv's
setuptools), and the fresh venv gets no pip and no downloads. Its dependencies (the pinned
CPU torch, numpy, omegaconf, hydra-core, tqdm, safetensors and what they need) are the ones
this test runs under, made visible through a ``.pth`` file of links to exactly those
distributions, so pip finds them installed and installs the wheel alone, offline.
"""

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import FIXTURES, REPO, fixtures_available

pytestmark = pytest.mark.wheel

# What a wheel is built from (setup.cfg's packages and package data, setup.py's start-up hook).
SOURCES = ("setup.cfg", "setup.py", "pyproject.toml", "MANIFEST.in", "README.md", "LICENSE", "CHANGELOG.md",
           "metaseq_oneload.pth", "metaseq_oneload", "hydra_configs", "hydra_plugins",
           # and what the sdist carries besides
           "docs", "examples", "Makefile", "requirements-dev.txt")


class _Metadata(importlib.metadata.Distribution):
    """A distribution read from a METADATA text (the wheel's)."""

    def __init__(self, text: str):
        self._text = text

    def read_text(self, filename):
        return self._text if filename == "METADATA" else None

    def locate_file(self, path):
        return Path(path)


def _requirement_names(dist: importlib.metadata.Distribution) -> list:
    names = []
    for req in dist.requires or ():
        if ";" in req and "extra" in req.split(";", 1)[1]:
            continue  # extras are not installed
        marker = req.split(";", 1)[1] if ";" in req else None
        if marker is not None:
            try:
                from packaging.markers import Marker

                if not Marker(marker).evaluate():
                    continue
            except Exception:
                pass
        names.append(re.split(r"[\s<>=!~\[;(]", req.strip(), maxsplit=1)[0])
    return names


def _closure(requirements) -> dict:
    """Distribution name -> Distribution, for ``requirements`` and everything they require."""
    seen: dict = {}
    todo = list(requirements)
    while todo:
        name = todo.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in seen:
            continue
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # an optional or platform-only requirement this environment lacks
        seen[key] = dist
        todo += _requirement_names(dist)
    return seen


def _link_distributions(dists: dict, into: Path) -> None:
    """Links to each distribution's top-level files and folders (and its .dist-info)."""
    into.mkdir()
    for dist in dists.values():
        base = Path(dist.locate_file(""))
        tops = {Path(f).parts[0] for f in dist.files or () if not Path(f).parts[0].startswith("..")}
        for top in tops:
            src = base / top
            if src.exists() and not (into / top).exists() and top != "__pycache__" and not top.endswith(".pth"):
                (into / top).symlink_to(src)


@pytest.fixture(scope="module")
def wheel_env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=ignore)
        else:
            shutil.copy2(path, src / name)
    dist_dir = tmp / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(dist_dir), str(src)], check=True, capture_output=True, text=True)
    (wheel,) = dist_dir.glob("metaseq_oneload-*.whl")

    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    with zipfile.ZipFile(wheel) as z:  # the wheel's own requirements, not the editable install's
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        requires = _requirement_names(_Metadata(z.read(meta).decode()))
    deps = tmp / "deps"
    _link_distributions(_closure(requires), deps)
    (site / "_oneload_test_deps.pth").write_text(f"{deps}\n")
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-index",
                        str(wheel)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    outside = tmp / "elsewhere"  # a working directory outside the repository
    outside.mkdir()
    return {"wheel": wheel, "venv": venv, "python": python, "site": site, "env": env, "cwd": outside, "src": src}


def _run(env, *cmd):
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, cwd=env["cwd"], env=env["env"])
    assert r.returncode == 0, f"{cmd}: {r.stdout}\n{r.stderr}"
    return r


def test_installed_from_the_wheel_not_the_source_tree(wheel_env):
    out = _run(wheel_env, wheel_env["python"], "-c", "import metaseq_oneload, hydra_plugins.oneload_searchpath as p; "
               "print(metaseq_oneload.__file__); print(p.__file__)").stdout.split()
    assert all(Path(f).is_relative_to(wheel_env["site"]) for f in out), out


def test_version(wheel_env):
    from metaseq_oneload import __version__

    want = f"metaseq-oneload {__version__}"
    assert _run(wheel_env, wheel_env["venv"] / "bin" / "metaseq-oneload", "--version").stdout.strip() == want
    assert _run(wheel_env, wheel_env["python"], "-m", "metaseq_oneload", "--version").stdout.strip() == want
    meta = _run(wheel_env, wheel_env["python"], "-c",
                "import importlib.metadata as m; print(m.version('metaseq-oneload'))").stdout.strip()
    assert meta == __version__


@pytest.mark.skipif(not fixtures_available(), reason=f"metaseq fixtures not found at {FIXTURES}")
def test_inspect_json(wheel_env):
    r = _run(wheel_env, wheel_env["venv"] / "bin" / "metaseq-oneload", "inspect", FIXTURES / "mp2_dp2", "--json")
    d = json.loads(r.stdout)
    assert (d["kind"], d["model_parallel_size"], d["shards_per_part"], d["num_params"]) == ("fsdp_sharded", 2, 2, 21548)
    assert "NumPy" not in r.stderr, r.stderr  # numpy is a dependency: torch has nothing to warn about


def test_hydra_finds_the_group_from_outside_the_repository(wheel_env):
    code = (
        "import json\n"
        "from hydra import compose, initialize_config_dir\n"
        "from hydra.core.global_hydra import GlobalHydra\n"
        "from hydra.core.plugins import Plugins\n"
        "from hydra.plugins.search_path_plugin import SearchPathPlugin\n"
        "names = [p.__name__ for p in Plugins.instance().discover(SearchPathPlugin)]\n"
        "open('config.yaml', 'w').write('lr: 0.1\\n')\n"
        "with initialize_config_dir(config_dir=__import__('os').getcwd(), version_base=None):\n"
        "    options = GlobalHydra.instance().config_loader().get_group_options('oneload')\n"
        "    cfg = compose('config', overrides=['+oneload=broadcast'])\n"
        "print(json.dumps({'plugins': names, 'options': options, 'strategy': cfg.oneload.strategy}))\n"
    )
    found = json.loads(_run(wheel_env, wheel_env["python"], "-c", code).stdout)
    assert "OneloadSearchPathPlugin" in found["plugins"]
    assert found["options"] == ["auto", "broadcast", "off", "own_shard", "parallel", "reshard"]
    assert found["strategy"] == "broadcast"


def test_no_top_level_hydra_configs_package(wheel_env):
    with zipfile.ZipFile(wheel_env["wheel"]) as z:
        names = z.namelist()
        top_level = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
        assert "hydra_configs" not in z.read(top_level).decode().split()
    assert not [n for n in names if n.startswith("hydra_configs/")]
    assert "metaseq_oneload/hydra_configs/oneload/auto.yaml" in names and "metaseq_oneload/py.typed" in names
    assert "metaseq_oneload/hydra.py" in names and "metaseq_oneload/hf.py" in names  # the public submodules
    assert not (wheel_env["site"] / "hydra_configs").exists()
    r = _run(wheel_env, wheel_env["python"], "-c", "import importlib.util; print(importlib.util.find_spec('hydra_configs'))")
    assert r.stdout.strip() == "None"


def test_sdist_carries_docs_examples_license_and_changelog(wheel_env, tmp_path):
    code = ("import sys; from setuptools import build_meta; "
            "print(build_meta.build_sdist(sys.argv[1]))")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                       cwd=wheel_env["src"])
    assert r.returncode == 0, r.stderr
    import tarfile

    with tarfile.open(tmp_path / r.stdout.strip().splitlines()[-1]) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    for path in ("LICENSE", "CHANGELOG.md", "README.md", "docs/hydra.md", "docs/metaseq/README.md",
                 "examples/fsdp_t5/README.md", "examples/fsdp_t5/T5_training.py", "examples/demo.py",
                 "hydra_configs/oneload/auto.yaml", "metaseq_oneload/py.typed", "metaseq_oneload.pth"):
        assert path in names, path
    assert not [n for n in names if "__pycache__" in n]
