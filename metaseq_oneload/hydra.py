"""metaseq-oneload's Hydra and OmegaConf pieces (docs/hydra.md).

    register_resolver()                  ``${oneload:KEY,PATH}``: a checkpoint's layout in any config
    register_configs(base, name)         the ``oneload`` group's schema, and ``base`` + an ``oneload`` node
    extend_schema(base)                  ``base`` + an optional ``oneload`` node (what register_configs stores)
    compose_oneload(overrides)           the ``oneload`` group composed on its own -> OneloadConfig
    OneloadConfig                        the group's fields, checked
    checkpoint_settings(layout)          what the files say: model_parallel_size, ddp_backend, ...
    fill_settings(cfg, layout, ...)      write those into a metaseq-shaped config where the user left them
    CheckpointSettingsError              a given setting contradicts the files
    activate(argv)                       turn metaseq-oneload on from ``+oneload=...`` (a --user-dir's hook)

A submodule of its own because Hydra imports the package on plugin discovery: importing this
module imports neither torch nor Hydra (Hydra only once something is composed or registered).
The names live in the private ``_hydra`` (schema, resolver, settings, argv) and ``_startup``
(the start-up hook) modules; this one only says which of them are public.
"""

from ._hydra import (
    CheckpointSettingsError,
    OneloadConfig,
    checkpoint_settings,
    compose_oneload,
    extend_schema,
    fill_settings,
    register_configs,
    register_resolver,
)
from ._startup import activate

__all__ = [
    "register_resolver",
    "register_configs",
    "extend_schema",
    "compose_oneload",
    "OneloadConfig",
    "checkpoint_settings",
    "fill_settings",
    "CheckpointSettingsError",
    "activate",
]
