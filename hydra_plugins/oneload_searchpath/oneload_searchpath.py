"""Makes the ``oneload`` config group visible to every Hydra app once metaseq-oneload is
installed.

Hydra imports every module under ``hydra_plugins`` when an app starts, so this module
imports only Hydra: the YAML it points at is package data of ``metaseq_oneload`` and is
read only when a config from the group is composed.
"""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

# A package path, not a file path: it works the same from a wheel, an editable install
# and a zip import. Not a top-level "hydra_configs" package: another project owns that name.
SEARCH_PATH = "pkg://metaseq_oneload.hydra_configs"


class OneloadSearchPathPlugin(SearchPathPlugin):
    """Appends ``pkg://metaseq_oneload.hydra_configs`` (the ``oneload`` group)."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        search_path.append(provider="metaseq-oneload", path=SEARCH_PATH)
