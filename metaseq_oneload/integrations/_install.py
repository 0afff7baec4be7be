""":func:`install` and :func:`uninstall`: which libraries get patched, and when.

Each library's patch is the module of its name in this package (``metaseq.py``,
``fairseq.py``) with a ``patch(patches, *, hydra_schema)``; it is imported only here, inside
:func:`install`, so that importing the integrations imports neither library.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
import threading
from typing import Any, Iterable, Optional, Sequence

import torch

from .. import _allowlist
from .._hydra import OneloadConfig, to_config
from .._import_hook import AfterImport
from ._broadcast import TensorRef
from ._patching import STATE, Patches

__all__ = ["install", "uninstall"]

logger = logging.getLogger("metaseq_oneload")

_LOCK = threading.RLock()

# Each has a module of its name in this package with a `patch(patches, *, hydra_schema)`.
_LIBRARIES = ("metaseq", "fairseq")


def install(config: Any = None, *, explicit: Optional[Iterable[str]] = None, hydra_schema: bool = False) -> bool:
    """(every rank, local) Route metaseq's checkpoint loading (and fairseq's) through
    metaseq-oneload.

    Patches what the program uses: the libraries already imported, else metaseq (or, where
    only fairseq is installed, fairseq). A library imported later is patched as it is
    imported. Idempotent: a later call changes the configuration only where it passes one
    (a repeated ``install()`` keeps what the start-up hook composed); ``strategy="off"``
    undoes an installation. Reversible with :func:`uninstall`.

    Args:
        config: an :class:`~metaseq_oneload.hydra.OneloadConfig`, a composed ``oneload`` node or a
            mapping of its fields; None keeps the installed configuration (the defaults,
            ``strategy="auto"``, on a first call).
        explicit: the loading settings the user gave (dotted keys such as
            ``common.model_parallel_size`` or flags such as ``--use-sharded-state``); the
            start-up hook passes what it saw on the command line. Values that differ from
            metaseq's defaults count as given anyway. None keeps what an earlier call gave.
        hydra_schema: also store metaseq's ``base_config`` with an optional ``oneload`` node
            in Hydra's ConfigStore, for Hydra apps that compose metaseq's config with
            ``+oneload=...``. Off by default: metaseq's own configs (and the checkpoints
            they are saved into) then stay free of a ``oneload`` key.

    Returns:
        True if this call installed the patch, False if it was installed already, or the
        strategy is "off".

    Raises:
        ImportError: neither metaseq nor fairseq can be imported.

    Example::

        import metaseq_oneload
        metaseq_oneload.install({"strategy": "broadcast"})
        models, cfg, task = metaseq.checkpoint_utils.load_model_ensemble_and_task(["/ckpt/"])
    """
    with _LOCK:
        if config is not None:
            new = to_config(config)
        elif STATE.patches is not None:
            new = STATE.config
        else:
            new = OneloadConfig()
        if explicit is not None:
            STATE.explicit = frozenset(explicit)
        elif STATE.patches is None:
            STATE.explicit = frozenset()
        if not new.enabled:
            if _uninstall_locked():
                logger.info("metaseq-oneload: strategy=off: uninstalled, metaseq's own loading is back")
            else:
                logger.info("metaseq-oneload: strategy=off: metaseq's loading left as it is")
            STATE.config = new
            return False
        STATE.config = new
        if STATE.patches is not None:
            return False
        return _install_locked(new, hydra_schema)


def _install_locked(config: OneloadConfig, hydra_schema: bool) -> bool:
    imported = [lib for lib in _LIBRARIES if lib in sys.modules]
    importable = [lib for lib in _LIBRARIES if lib not in sys.modules and _importable(lib)]
    now = imported or importable[:1]
    later = [lib for lib in importable if lib not in now]
    if not now:
        raise ImportError(
            "metaseq_oneload.install(): neither metaseq nor fairseq can be imported. Install "
            "metaseq from its repository (pip install -e path/to/metaseq) in this environment."
        )
    patches = Patches()
    libraries = []
    STATE.hydra_schema = hydra_schema
    try:
        for lib in now:
            if _patch_library(patches, lib):
                libraries.append(lib)
        if not libraries:
            raise ImportError(f"metaseq_oneload.install(): {', '.join(now)} could not be patched (see the log).")
        _allow_checkpoint_globals(patches)
    except BaseException:
        patches.undo()
        STATE.originals.clear()
        raise
    if later:
        finder = AfterImport.watch(later, lambda: _patch_later(later))
        patches.on_undo(lambda: sys.meta_path.remove(finder) if finder in sys.meta_path else None)
    STATE.patches = patches
    STATE.libraries = tuple(libraries)
    logger.info("metaseq-oneload: installed for %s (strategy=%s)%s", ", ".join(libraries), config.strategy,
                f"; {', '.join(later)} when imported" if later else "")
    return True


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _patch_library(patches: Patches, lib: str) -> bool:
    """Patch one library into ``patches``, all of it or nothing. metaseq failing is an
    error; fairseq failing is a warning (it must not stand in the way of metaseq)."""
    sub = Patches()
    try:
        importlib.import_module(f"{__package__}.{lib}").patch(sub, hydra_schema=STATE.hydra_schema)
    except Exception as e:
        sub.undo()
        if lib == "metaseq":
            raise
        logger.warning("metaseq-oneload: %s is installed but could not be patched (%s: %s)", lib, type(e).__name__, e)
        return False
    patches.extend(sub)
    return True


def _patch_later(names: Sequence[str]) -> None:
    """(import hook) A library the program imports after install(): patch it now. A
    failure is logged, never raised: it would make the program's own import fail."""
    with _LOCK:
        if STATE.patches is None:
            return
        for lib in names:
            if lib not in sys.modules or lib in STATE.libraries:
                continue
            try:
                patched = _patch_library(STATE.patches, lib)
            except Exception as e:  # noqa: BLE001
                logger.error("metaseq-oneload: %s was imported after install() and could not be patched (%s: %s); "
                             "its loading is left as it is", lib, type(e).__name__, e)
                continue
            if patched:
                STATE.libraries += (lib,)
                logger.info("metaseq-oneload: installed for %s (imported after install())", lib)


def uninstall() -> bool:
    """(every rank, local) Undo :func:`install`: every patched name gets its original back,
    the configuration returns to the defaults. Returns False if nothing was installed."""
    with _LOCK:
        done = _uninstall_locked()
        STATE.config = OneloadConfig()
        STATE.explicit = frozenset()
        return done


def _uninstall_locked() -> bool:
    if STATE.patches is None:
        return False
    STATE.patches.undo()
    STATE.patches = None
    STATE.originals.clear()
    STATE.libraries = ()
    return True


def _allow_checkpoint_globals(patches: Patches) -> None:
    """Add the engine's allowlist to torch's, so that the ``torch.load`` calls metaseq
    makes itself (reshard scripts, ``_broadcast_object_slow``) work under weights_only; on
    uninstall remove exactly the entries this added."""
    add = getattr(torch.serialization, "add_safe_globals", None)
    if add is None:  # torch < 2.4: weights_only is not the default there
        return
    # The engine's own loads add and remove entries under the allowlist's lock.
    lock = getattr(_allowlist, "_ALLOWLIST_LOCK", None) or threading.RLock()
    with lock:
        before = list(torch.serialization.get_safe_globals())
        ours = [g for g in list(_allowlist.safe_globals()) + [TensorRef] if g not in before]
        add(ours)

    def remove() -> None:
        with lock:
            now = list(torch.serialization.get_safe_globals())
            torch.serialization.clear_safe_globals()
            torch.serialization.add_safe_globals([g for g in now if g not in ours])

    patches.on_undo(remove)
