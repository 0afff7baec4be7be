"""Hydra's two plugin tests (the plugin is discovered; the ``oneload`` group is installed and
lists its options), plus what the plugin must not do: import anything heavy."""

from __future__ import annotations

import subprocess
import sys

from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.plugins import Plugins
from hydra.plugins.search_path_plugin import SearchPathPlugin

from hydra_plugins.oneload_searchpath.oneload_searchpath import SEARCH_PATH, OneloadSearchPathPlugin
from tests.conftest import REPO

OPTIONS = ["auto", "broadcast", "off", "own_shard", "parallel", "reshard"]


def test_discovery():
    assert OneloadSearchPathPlugin.__name__ in [p.__name__ for p in Plugins.instance().discover(SearchPathPlugin)]


def test_config_installed(tmp_path):
    with initialize_config_dir(config_dir=str(tmp_path), version_base=None):
        loader = GlobalHydra.instance().config_loader()
        assert loader.get_group_options("oneload") == OPTIONS
        ours = [s for s in loader.get_sources() if s.provider == "metaseq-oneload"]
        assert [s.full_path() for s in ours] == [SEARCH_PATH]


def test_yaml_is_package_data_of_metaseq_oneload():
    # Never a top-level package called hydra_configs: another project owns that name.
    assert SEARCH_PATH == "pkg://metaseq_oneload.hydra_configs"
    assert sorted(p.stem for p in (REPO / "hydra_configs" / "oneload").glob("*.yaml")) == OPTIONS


def test_namespace_package_has_no_init():
    assert not (REPO / "hydra_plugins" / "__init__.py").exists()


def test_plugin_imports_nothing_heavy():
    # Hydra imports every hydra_plugins module whenever any Hydra app starts.
    code = ("import sys, hydra_plugins.oneload_searchpath.oneload_searchpath; "
            "print(sorted(m for m in ('torch', 'metaseq_oneload', 'metaseq') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "[]"


def test_discovery_from_another_working_directory(tmp_path):
    """Installed (make's strict editable install, or a wheel), the plugin is found from any
    folder, not only the repository root: Hydra <= 1.3 lists hydra_plugins/ on sys.path,
    which pip's default editable finder hides (hydra#2359)."""
    import importlib.metadata
    import json
    import os

    try:
        importlib.metadata.distribution("metaseq-oneload")
    except importlib.metadata.PackageNotFoundError:
        import pytest

        pytest.skip("metaseq-oneload is not installed in this environment (make test installs it)")
    code = (
        "import json\n"
        "from hydra import initialize_config_dir\n"
        "from hydra.core.global_hydra import GlobalHydra\n"
        "from hydra.core.plugins import Plugins\n"
        "from hydra.plugins.search_path_plugin import SearchPathPlugin\n"
        "names = [p.__name__ for p in Plugins.instance().discover(SearchPathPlugin)]\n"
        f"with initialize_config_dir(config_dir={str(tmp_path)!r}, version_base=None):\n"
        "    options = GlobalHydra.instance().config_loader().get_group_options('oneload')\n"
        "print(json.dumps({'plugins': names, 'options': options}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout)
    assert OneloadSearchPathPlugin.__name__ in found["plugins"]
    assert found["options"] == OPTIONS
