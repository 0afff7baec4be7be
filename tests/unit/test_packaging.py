"""What the package declares is true: the Python versions (the pure-Python parts run on the
oldest and the newest declared), the version, the type-checker view of the lazy namespace,
help() showing plain annotations, and a command line whose parser never imports torch."""

import ast
import configparser
import importlib
import inspect
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

import metaseq_oneload
from tests.conftest import REPO

PACKAGE = REPO / "metaseq_oneload"


def _setup_cfg() -> configparser.ConfigParser:
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    return cfg


def _declared_minors() -> list:
    classifiers = _setup_cfg()["metadata"]["classifiers"].split("\n")
    prefix = "Programming Language :: Python :: 3."
    return sorted(int(c.strip()[len(prefix):]) for c in classifiers if c.strip().startswith(prefix))


# --------------------------------------------------------------------------- versions


def test_python_requires_matches_the_classifiers():
    requires = _setup_cfg()["options"]["python_requires"].strip()
    assert requires == ">=3.10"  # os.path.realpath(strict=True), PEP 604 unions at run time
    minors = _declared_minors()
    assert minors[0] == 10 and minors == list(range(10, minors[-1] + 1))
    assert sys.version_info[:2] >= (3, minors[0])


def test_every_module_parses_as_the_oldest_declared_python():
    oldest = (3, _declared_minors()[0])
    files = sorted(PACKAGE.rglob("*.py")) + sorted((REPO / "hydra_plugins").rglob("*.py"))
    for path in files:
        ast.parse(path.read_text(), filename=str(path), feature_version=oldest)


def _pyenv_python(minor: int):
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    for version in sorted(root.glob(f"3.{minor}.*"), reverse=True) if root.is_dir() else ():
        if (version / "bin" / "python").exists():
            return version / "bin" / "python"
    return shutil.which(f"python3.{minor}")


# The pure-Python parts, which must not need torch: the package's namespace, the command
# line's parser, the Hydra plugin and config group, the schema's checks, argv handling.
PURE = r"""
import contextlib, io, json, sys
import metaseq_oneload
import metaseq_oneload.hydra as oneload_hydra
from metaseq_oneload import cli, _hydra
import hydra_plugins.oneload_searchpath.oneload_searchpath as plugin
from hydra.core.plugins import Plugins
from hydra.plugins.search_path_plugin import SearchPathPlugin

out = {}
for argv in (["--version"], ["--help"], ["convert", "--help"], ["export-hf", "--help"]):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        try:
            cli.main(argv)
        except SystemExit as e:
            assert e.code == 0, (argv, e.code)
    out[" ".join(argv)] = buf.getvalue()
out["plugins"] = [p.__name__ for p in Plugins.instance().discover(SearchPathPlugin)]
out["composed"] = repr(oneload_hydra.compose_oneload(["+oneload=broadcast", "oneload.bucket_mb=64"]))
try:
    oneload_hydra.compose_oneload(["+oneload=auto", "oneload.strategy=bogus"])
except Exception as e:
    out["refused"] = str(e)
out["argv"] = _hydra.split_argv(["--lr", "1", "+oneload=auto", "oneload.verify=true"])
out["heavy"] = sorted(m for m in ("torch", "numpy", "transformers") if m in sys.modules)
print(json.dumps(out))
"""


def _pure_python_path(tmp_path: Path) -> Path:
    """A folder of links to the pure-Python dependencies (hydra, omegaconf and theirs), so
    another interpreter imports them without this venv's compiled packages (torch)."""
    deps = tmp_path / "deps"
    deps.mkdir()
    for name in ("hydra", "omegaconf", "antlr4", "yaml", "packaging"):
        module = importlib.import_module(name)
        (deps / name).symlink_to(Path(module.__file__).parent)
    return deps


@pytest.mark.parametrize("minor", [10, 12], ids=["3.10", "3.12"])
def test_pure_python_parts_on_other_versions(tmp_path, minor):
    python = _pyenv_python(minor)
    if python is None:
        pytest.skip(f"no Python 3.{minor} on this machine (pyenv install 3.{minor} to run this)")
    deps = _pure_python_path(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONHOME", "VIRTUAL_ENV")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(deps)])
    r = subprocess.run([str(python), "-S", "-c", PURE], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["--version"].strip() == f"metaseq-oneload {metaseq_oneload.__version__}"
    assert "usage: metaseq-oneload" in out["--help"] and "--model-parallel" in out["convert --help"]
    assert "--no-progress" in out["export-hf --help"]
    assert "OneloadSearchPathPlugin" in out["plugins"]
    assert "strategy='broadcast'" in out["composed"] and "bucket_mb=64" in out["composed"]
    assert "Invalid value 'bogus', expected one of [auto, own_shard, reshard, broadcast, parallel, off]" in out["refused"]
    assert out["argv"] == [["--lr", "1"], ["+oneload=auto", "oneload.verify=true"]]
    assert out["heavy"] == []


def test_version_is_one_literal_read_by_setup_cfg():
    assert _setup_cfg()["metadata"]["version"].strip() == "attr: metaseq_oneload.__version__"
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    literal = [n.value.value for n in tree.body if isinstance(n, ast.Assign)
               and [getattr(t, "id", None) for t in n.targets] == ["__version__"]]
    assert literal == [metaseq_oneload.__version__]


@pytest.mark.parametrize("how", ["console script", "python -m"])
def test_version_flag(how):
    if how == "console script":
        script = Path(sys.executable).parent / "metaseq-oneload"
        if not script.exists():
            pytest.skip("metaseq-oneload is not installed in this environment (make test installs it)")
        cmd = [str(script)]
    else:
        cmd = [sys.executable, "-m", "metaseq_oneload"]
    r = subprocess.run(cmd + ["--version"], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0 and r.stdout.strip() == f"metaseq-oneload {metaseq_oneload.__version__}"


def test_every_package_is_listed_in_setup_cfg():
    """setup.cfg lists packages by name (hydra_configs is mapped into metaseq_oneload): a new
    subpackage left out would be missing from the wheel."""
    listed = set(_setup_cfg()["options"]["packages"].split())
    found = {".".join(p.parent.relative_to(REPO).parts) for p in PACKAGE.rglob("__init__.py")}
    found |= {"metaseq_oneload.hydra_configs", "hydra_plugins.oneload_searchpath"}
    assert found == listed


def test_numpy_is_a_dependency():
    requires = [r.strip().split(">")[0].split("<")[0].split("=")[0] for r in
                _setup_cfg()["options"]["install_requires"].strip().splitlines() if r.strip()]
    assert "numpy" in requires and "torch" in requires


# --------------------------------------------------------------------------- typing, help()


def _type_checking_imports() -> dict:
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "typing.TYPE_CHECKING")
    names = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom), ast.unparse(node)
        for alias in node.names:
            names[alias.asname or alias.name] = ("." * node.level + (node.module or ""), alias.name)
    return names


def test_type_checkers_see_every_lazy_name():
    assert _type_checking_imports() == metaseq_oneload._LAZY
    assert (PACKAGE / "py.typed").is_file()


def test_every_public_name_resolves():
    for name in metaseq_oneload.__all__:
        assert getattr(metaseq_oneload, name) is not None, name
    for module in (metaseq_oneload.hydra, metaseq_oneload.hf):
        for name in module.__all__:
            assert getattr(module, name) is not None, f"{module.__name__}.{name}"


# The top level: the verbs, their results and the errors. Hydra plumbing and the Hugging
# Face model helpers live in their own public submodules, each name in exactly one place.
TOP_LEVEL = {
    "inspect", "CheckpointLayout", "load_state_dict", "load_checkpoint", "load_into", "LoadedCheckpoint",
    "LoadReport", "plan_load", "LoadPlan", "convert", "consolidate", "ConvertReport", "verify", "VerifyReport",
    "TensorDiff", "export_hf", "HFExport", "from_pretrained", "install", "uninstall", "installed",
    "digest", "DigestReport",
}
SUBMODULES = {
    "hydra": {"register_resolver", "register_configs", "extend_schema", "compose_oneload", "fill_settings",
              "checkpoint_settings", "OneloadConfig", "CheckpointSettingsError", "activate"},
    "hf": {"empty_model", "fully_shard_blocks", "fsdp1_param_init_fn"},
}


def test_the_public_surface_is_the_verbs_and_their_results():
    errors = {n for n in metaseq_oneload.__all__ if n.endswith("Error")}
    assert set(metaseq_oneload.__all__) == TOP_LEVEL | errors
    assert all(issubclass(getattr(metaseq_oneload, n), metaseq_oneload.OneloadError) for n in errors)
    for sub, names in SUBMODULES.items():
        module = importlib.import_module(f"metaseq_oneload.{sub}")
        assert set(module.__all__) == names, sub
        assert not names & set(metaseq_oneload.__all__), sub  # one place per name, no aliases
        assert not any(hasattr(metaseq_oneload, n) for n in names), sub


def test_the_hydra_submodule_imports_no_torch():
    """Hydra imports the package when it discovers the plugin; the Hydra names must not cost torch."""
    code = ("import sys, metaseq_oneload.hydra as h; h.OneloadConfig(); "
            "print(sorted(m for m in ('torch', 'numpy', 'hydra', 'omegaconf') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


# Each verb's leading arguments: the source is ``path``, an output ``dst``, a second source ``other``.
LEADING = {
    "inspect": ["path"], "load_state_dict": ["path"], "load_checkpoint": ["path"], "load_into": ["module", "path"],
    "plan_load": ["path"], "from_pretrained": ["model_cls", "path"], "convert": ["path", "dst"],
    "consolidate": ["path", "dst"], "verify": ["path", "other"], "export_hf": ["path", "dst"],
}


def test_one_name_per_concept_across_the_verbs():
    """docs/api.md's conventions: the same argument means the same in every verb."""
    for name, leading in LEADING.items():
        params = inspect.signature(getattr(metaseq_oneload, name)).parameters
        assert list(params)[:len(leading)] == leading, name
        for arg, default in (("chunk_mb", 64), ("bucket_mb", 256)):
            if arg in params:
                assert params[arg].default == default, (name, arg)
        for arg in ("src", "dst_prefix", "name_or_path", "a", "b"):
            assert arg not in params, (name, arg)
        if "model_parallel" in params:  # a size; a group is model_parallel_group
            assert params["model_parallel"].default in (None, 1), name
    empty = inspect.signature(metaseq_oneload.hf.empty_model).parameters
    assert list(empty)[:2] == ["model_cls", "path"] and empty["path"].default is None


def _api_sections() -> dict:
    """docs/api.md's sections by heading, each with the names its tables' first cells list."""
    sections = {}
    for block in (REPO / "docs" / "api.md").read_text().split("\n## ")[1:]:
        heading, _, body = block.partition("\n")
        cells = re.findall(r"^\| ([^|]+) \|", body, re.M)
        sections[heading] = {n for c in cells for n in re.findall(r"`(\w+)[(`]", c)}, body
    return sections


def test_the_api_page_lists_the_public_surface():
    sections = _api_sections()
    top_names, top_text = next(v for k, v in sections.items() if k.startswith("`metaseq_oneload`"))
    assert top_names >= TOP_LEVEL - {"CheckpointLayout", "LoadedCheckpoint", "LoadReport", "LoadPlan",
                                     "ConvertReport", "VerifyReport", "TensorDiff", "HFExport", "DigestReport"}
    for name in metaseq_oneload.__all__:  # the result types and errors named in the text
        assert f"`{name}" in top_text, name
    for sub, names in SUBMODULES.items():
        listed, _ = next(v for k, v in sections.items() if k.startswith(f"`metaseq_oneload.{sub}`"))
        assert listed == names, sub


def _documented_python() -> list:
    """(file, code) of every Python block in the docs, the README and the examples' READMEs."""
    files = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), *sorted((REPO / "examples").rglob("*.md"))]
    return [(f, code) for f in files for code in re.findall(r"```python\n(.*?)```", f.read_text(), re.S)]


def test_documented_python_names_the_public_api():
    """Every ``oneload.X`` / ``metaseq_oneload.X[.Y]`` a documented snippet uses resolves, and
    none reaches into a private module."""
    checked = 0
    for f, code in _documented_python():
        aliases = ["metaseq_oneload"] + (["oneload"] if "import metaseq_oneload as oneload" in code else [])
        for alias in aliases:
            for chain in re.findall(rf"(?<![\w.]){alias}((?:\.\w+)+)", code):
                obj = metaseq_oneload
                for part in chain.lstrip(".").split("."):
                    assert not part.startswith("_"), f"{f.name}: {alias}{chain} is private"
                    if isinstance(obj, types.ModuleType) or part in ("hydra", "hf"):
                        obj = getattr(obj, part, None)
                        assert obj is not None, f"{f.name}: {alias}{chain}"
                        checked += 1
                    else:
                        break  # an attribute of a result (report.files): not the API's names
        for module, names in re.findall(r"^from (metaseq_oneload[\w.]*) import ([\w, ]+)$", code, re.M):
            assert not any(p.startswith("_") for p in module.split(".")), f"{f.name}: from {module}"
            imported = importlib.import_module(module)
            for name in names.split(","):
                assert hasattr(imported, name.strip()), f"{f.name}: from {module} import {name.strip()}"
                checked += 1
    assert checked > 20


def _documented_commands() -> list:
    """(file, argv) of every ``metaseq-oneload ...`` line in a code block of the docs and the README."""
    files = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), *sorted((REPO / "examples").rglob("*.md"))]
    found = []
    for f in files:
        for block in re.findall(r"```[a-z]*\n(.*?)```", f.read_text(), re.S):
            for line in block.splitlines():
                line = re.sub(r"^\$ ", "", line.strip())
                if not line.startswith("metaseq-oneload ") or ": error:" in line:
                    continue
                line = re.sub(r"\s+#.*$", "", line)  # a comment
                line = re.sub(r"\[(--[^\]]*)\]", r"\1", line)  # [--json]: an option, shown taken
                line = re.sub(r"(?<= )[A-Z](?= |$)", "2", line)  # --shards N: a number
                found.append((f.name, shlex.split(line)[1:]))
    return found


def test_documented_commands_parse():
    """Every command line the docs show is one the parser takes, flags and arguments alike."""
    from metaseq_oneload.cli import build_parser

    commands = _documented_commands()
    assert len(commands) > 15
    for name, argv in commands:
        if argv == ["--version"]:
            continue
        try:
            build_parser().parse_args(argv)
        except SystemExit:
            pytest.fail(f"{name}: metaseq-oneload {' '.join(argv)} does not parse")


def _annotations(obj) -> list:
    target = obj.__dict__.get("__init__") if isinstance(obj, type) else obj
    if not isinstance(target, types.FunctionType):
        return []
    sig = inspect.signature(obj)
    return [p.annotation for p in sig.parameters.values()] + [sig.return_annotation]


def test_help_shows_plain_annotations():
    checked = 0
    public = [getattr(metaseq_oneload, n) for n in sorted(metaseq_oneload._LAZY)]
    public += [getattr(metaseq_oneload.hf, n) for n in metaseq_oneload.hf.__all__]
    for obj in public:
        name = obj.__name__
        for ann in _annotations(obj):
            if ann is inspect.Parameter.empty:
                continue
            text = inspect.formatannotation(ann)
            assert "'" not in text and '"' not in text, f"{name}: {text}"
            checked += 1
    assert checked > 50
    shown = inspect.signature(metaseq_oneload.load_state_dict)
    assert "path: str | os.PathLike, *, process_group: Optional[dist.ProcessGroup] = None" in str(shown)


# --------------------------------------------------------------------------- the command line

NO_TORCH = r"""
import contextlib, io, sys
from metaseq_oneload.cli import main, _COMMANDS
for argv in [["--help"], ["--version"]] + [[name, "--help"] for name in _COMMANDS]:
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            main(argv)
        except SystemExit as e:
            assert e.code == 0, (argv, e.code)
print(sorted(m for m in ("torch", "numpy", "safetensors", "transformers", "hydra") if m in sys.modules))
"""


def test_help_and_version_import_no_torch():
    r = subprocess.run([sys.executable, "-c", NO_TORCH], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_importtime_of_help_has_no_torch():
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "metaseq_oneload", "--help"],
                       capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0 and "usage: metaseq-oneload" in r.stdout
    imported = {line.split("|")[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    assert "metaseq_oneload.cli" in imported and "torch" not in imported


# --------------------------------------------------------------------------- README, sdist

REPO_URL = "https://github.com/metaseq-oneload/metaseq-oneload"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_readme_links_work_off_github():
    """PyPI renders README.md without the repository around it: every link is absolute, and
    each one into the repository names a file (and heading) that exists."""
    text = (REPO / "README.md").read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links
    for link in links:
        assert link.startswith("https://"), link
        if not link.startswith(REPO_URL + "/blob/main/"):
            continue
        path, _, anchor = link[len(REPO_URL + "/blob/main/"):].partition("#")
        assert (REPO / path).is_file(), link
        if anchor:
            headings = [line.lstrip("#").strip() for line in (REPO / path).read_text().splitlines()
                        if line.startswith("#")]
            assert anchor in {_slug(h) for h in headings}, link


def test_project_urls_use_the_same_repository():
    meta = _setup_cfg()["metadata"]
    assert meta["url"].strip() == REPO_URL
    urls = [line.split("=", 1)[1].strip() for line in meta["project_urls"].strip().splitlines()]
    assert urls and all(u.startswith(REPO_URL) for u in urls)
    assert "MIT" in meta["license"] and "Permission is hereby granted" in (REPO / "LICENSE").read_text()
    assert (REPO / "CHANGELOG.md").read_text().startswith("# Changelog")
