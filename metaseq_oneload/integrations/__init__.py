"""metaseq's and fairseq's integration: :func:`install` routes every checkpoint load of
the library a program uses through the engine; :func:`uninstall` puts it back as it was.

One core holds the logic (``_core``: the patched functions, written once; ``_checkpoint``:
a rank's view of a set and its groups; ``_optimizer``: the optimizer state resharded like
the weights; ``_broadcast``: objects between ranks without pickled tensors; ``_patching``
and ``_install``: what is installed, and how it is undone). ``metaseq`` and ``fairseq``
each declare what their library keeps where (a :class:`._core.Framework`) and replace its
functions; they are the only modules that import those libraries, and only inside install().
"""

from ._broadcast import broadcast_object
from ._core import fill_from_checkpoint
from ._install import install, uninstall
from ._patching import current_config, installed

__all__ = ["install", "uninstall", "installed", "current_config", "broadcast_object", "fill_from_checkpoint"]
