"""Where the ``oneload`` Hydra group is found when the package runs from a source checkout.

Apart from :mod:`._hydra` because the package's ``__init__`` calls it at every import: this
module imports nothing but the standard library's ``importlib`` (``_hydra`` builds Hydra's
schema dataclasses, several milliseconds of a script's first load).
"""

import importlib.util
import os
import sys

__all__ = ["CONFIG_MODULE", "source_tree_configs"]

# The package Hydra reads the group from; see hydra_plugins/oneload_searchpath.
CONFIG_MODULE = "metaseq_oneload.hydra_configs"


def source_tree_configs() -> bool:
    """(local) Make ``metaseq_oneload.hydra_configs`` importable where the package is
    imported from a source checkout (the repository root on ``sys.path`` ahead of any
    install: ``pytest`` from the root, ``PYTHONPATH=repo``). The group lives in the
    repository's top-level ``hydra_configs/``, which an install maps into the package and a
    bare source tree does not. Idempotent; a no-op where the module is found. Returns
    whether it registered the module."""
    if CONFIG_MODULE in sys.modules:
        return False
    try:
        if importlib.util.find_spec(CONFIG_MODULE) is not None:
            return False
    except (ImportError, ValueError):
        pass
    folder = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "hydra_configs")
    init = os.path.join(folder, "__init__.py")
    if not os.path.isfile(init) or not os.path.isdir(os.path.join(folder, "oneload")):
        return False
    spec = importlib.util.spec_from_file_location(CONFIG_MODULE, init, submodule_search_locations=[folder])
    module = importlib.util.module_from_spec(spec)
    sys.modules[CONFIG_MODULE] = module
    spec.loader.exec_module(module)
    parent = sys.modules.get(CONFIG_MODULE.rsplit(".", 1)[0])
    if parent is not None:
        setattr(parent, CONFIG_MODULE.rsplit(".", 1)[1], module)
    return True
