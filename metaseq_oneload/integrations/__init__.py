"""metaseq's and fairseq's integration: :func:`install` routes every checkpoint load of
the library a program uses through the engine; :func:`uninstall` puts it back as it was.

``_core`` holds what both share (patch bookkeeping, the engine's load of a layout,
optimizer-state placement, ``broadcast_object``); ``metaseq`` and ``fairseq`` hold each
library's patch, the only modules that import those libraries, and only inside install().
"""

from ._core import broadcast_object, current_config, fill_from_checkpoint, install, installed, uninstall

__all__ = ["install", "uninstall", "installed", "current_config", "broadcast_object", "fill_from_checkpoint"]
