"""Makes the ``oneload`` config group visible to every Hydra app once metaseq-oneload is
installed.

Hydra imports every module under ``hydra_plugins`` when an app starts, so this module
imports only Hydra: the YAML it points at is package data of ``metaseq_oneload`` and is
read only when a config from the group is composed. When an app starts, the plugin also
stores the group's schema and words Hydra's refusal of ``+oneload=...`` on a structured
primary config so that it says what to do.
"""

import functools
import re

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

# A package path, not a file path: it works the same from a wheel, an editable install
# and a zip import. Not a top-level "hydra_configs" package: another project owns that name.
SEARCH_PATH = "pkg://metaseq_oneload.hydra_configs"

# Hydra's own words when +oneload=... meets a struct-mode structured primary config.
_REFUSAL = re.compile(r"Key 'oneload' not in '(\w+)'")
HINT = (
    "\n\nmetaseq-oneload: the primary config {name!r} is a structured config ({cls}) without an "
    "'oneload' field, and Hydra adds no keys to a structured config. Store it with the field once, "
    "before Hydra composes (e.g. next to your ConfigStore.store call):\n"
    "    import metaseq_oneload.hydra\n"
    "    metaseq_oneload.hydra.register_configs({cls}, {name!r})\n"
    "(the same as ConfigStore.instance().store(name={name!r}, node=metaseq_oneload.hydra.extend_schema({cls}))).\n"
    "See docs/hydra.md, \"Key 'oneload' not in ...: structured primary configs\"."
)


class OneloadSearchPathPlugin(SearchPathPlugin):
    """Appends ``pkg://metaseq_oneload.hydra_configs`` (the ``oneload`` group)."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        search_path.append(provider="metaseq-oneload", path=SEARCH_PATH)
        register_schema()
        explain_structured_refusal()


def register_schema() -> None:
    """Store the group's schema (``oneload_schema``), which every option's defaults list
    names first, so that composed values are type-checked. Imported here, when an app
    starts, not with this module: cheap (no torch), but not Hydra's to pay for at discovery."""
    from metaseq_oneload._hydra import register_schema as register

    register()


def explain_structured_refusal() -> bool:
    """Add what to do to Hydra's ``Key 'oneload' not in 'Cfg'``, the error of ``+oneload=...``
    on a structured primary config in struct mode, which otherwise points nowhere. Wraps
    Hydra's private compose step once per process (the original stays as ``__wrapped__``);
    where a Hydra version lacks that step, its own message stands. Returns whether the
    wrapper is in place."""
    try:
        from hydra._internal.config_loader_impl import ConfigLoaderImpl
        from hydra.errors import ConfigCompositionException
    except ImportError:
        return False
    original = ConfigLoaderImpl.__dict__.get("_compose_config_from_defaults_list")
    if original is None:
        return False
    if getattr(original, "_oneload_hint", False):
        return True

    @functools.wraps(original)
    def compose(self, defaults, *args, **kwargs):
        try:
            return original(self, defaults, *args, **kwargs)
        except Exception as e:  # Hydra >= 1.2 wraps OmegaConf's ConfigKeyError; 1.1 lets it through
            found = _REFUSAL.search(str(e))
            if found is None:
                raise
            primary = next((d.config_path for d in defaults if getattr(d, "primary", False)), None)
            hint = HINT.format(name=primary or "config", cls=found.group(1))
            raise ConfigCompositionException(f"{e}{hint}").with_traceback(e.__traceback__) from e

    compose._oneload_hint = True
    ConfigLoaderImpl._compose_config_from_defaults_list = compose
    return True
