"""The allowlist: which classes and functions a checkpoint's pickle may name.

torch's ``weights_only`` loader accepts its own allowlist plus the process's
``torch.serialization`` safe globals; :func:`safe_globals` adds the classes real metaseq,
fairseq and fairscale checkpoints carry, for the duration of a load of ours
(:func:`allowlisted`). The one-pass header reader (:mod:`._unpickle`) accepts exactly the
same names (:func:`allowed`), so both readers of a header refuse the same files.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import threading
import typing

import torch

__all__ = ["safe_globals", "allowlisted", "allowed"]


@functools.lru_cache(maxsize=None)
def safe_globals() -> tuple:
    """(local) The classes and functions, beyond torch's own allowlist, that real metaseq,
    fairseq and fairscale checkpoints carry in their pickles."""
    return _plain_globals() + _omegaconf_globals()


@functools.lru_cache(maxsize=None)
def _plain_globals() -> tuple:
    """safe_globals() but omegaconf's: nothing here costs an import torch has not paid."""
    allowed: list = [
        argparse.Namespace,  # cfg["model"] in metaseq, `args` in old fairseq checkpoints
        collections.OrderedDict,
        collections.defaultdict,
        typing.Any,  # omegaconf container metadata refers to it
        dict,
        list,
        int,
        float,
        str,
        bool,
    ]
    try:  # numpy scalars and small arrays in meters / extra_state (e.g. best_loss)
        import numpy as np

        try:
            from numpy._core.multiarray import _reconstruct, scalar
        except ImportError:  # numpy < 2
            from numpy.core.multiarray import _reconstruct, scalar
        allowed += [np.ndarray, np.dtype, _reconstruct, scalar]
        dtypes = getattr(np, "dtypes", None)
        if dtypes is not None:
            allowed += [getattr(dtypes, n) for n in dir(dtypes) if n.endswith("DType")]
    except ImportError:
        pass
    return tuple(allowed)


@functools.lru_cache(maxsize=None)
def _omegaconf_globals() -> tuple:
    """omegaconf's classes, which fairseq checkpoints written from a live DictConfig carry.
    Importing omegaconf costs 130-190 ms of a fresh process (more than a 256 MiB warm load),
    so only torch's loader asks for them: the one-pass reader leaves any omegaconf object to
    it anyway (see :func:`allowed`)."""
    allowed: list = []
    try:  # fairseq checkpoints written from a live DictConfig
        from omegaconf import DictConfig, ListConfig
        from omegaconf.base import ContainerMetadata, Metadata
        from omegaconf.nodes import AnyNode, BooleanNode, EnumNode, FloatNode, IntegerNode, StringNode

        allowed += [DictConfig, ListConfig, ContainerMetadata, Metadata, AnyNode, BooleanNode,
                    EnumNode, FloatNode, IntegerNode, StringNode]
        try:
            from omegaconf.nodes import BytesNode, PathNode

            allowed += [BytesNode, PathNode]
        except ImportError:  # omegaconf < 2.2
            pass
    except ImportError:
        pass
    return tuple(allowed)


_ALLOWLIST_LOCK = threading.RLock()
_ALLOWLIST_USERS = 0
_ALLOWLIST_ADDED: list = []


@contextlib.contextmanager
def allowlisted():
    """(local) Our allowlist on top of whatever the process already allows, while any load of ours
    runs. Only the entries we added are removed afterwards (torch's own ``safe_globals``
    context removes its entries on exit, also ones the user had added, e.g. metaseq's shim's
    ``argparse.Namespace``). Loads run outside the lock, so header reads stay concurrent."""
    global _ALLOWLIST_USERS, _ALLOWLIST_ADDED
    with _ALLOWLIST_LOCK:
        if _ALLOWLIST_USERS == 0:
            present = set(map(id, torch.serialization.get_safe_globals()))
            _ALLOWLIST_ADDED = [g for g in safe_globals() if id(g) not in present]
            torch.serialization.add_safe_globals(_ALLOWLIST_ADDED)
        _ALLOWLIST_USERS += 1
    try:
        yield
    finally:
        with _ALLOWLIST_LOCK:
            _ALLOWLIST_USERS -= 1
            if _ALLOWLIST_USERS == 0 and _ALLOWLIST_ADDED:
                ours = set(map(id, _ALLOWLIST_ADDED))
                keep = [g for g in torch.serialization.get_safe_globals() if id(g) not in ours]
                torch.serialization.clear_safe_globals()
                torch.serialization.add_safe_globals(keep)
                _ALLOWLIST_ADDED = []


def allowed() -> dict:
    """(local) The names the one-pass header reader accepts, by dotted name: torch's own
    allowlist first, then the process's safe globals and ours, but for omegaconf's. A pickle
    naming one of those is refused by the pass, and so read by torch's loader inside
    :func:`allowlisted` (the whole allowlist), as it would be if the pass had accepted the
    name: an omegaconf object is never one the pass hands out (``_unpickle``). Either way
    torch's loader decides; leaving them out spares a plain load the import of omegaconf."""
    return _allowed_with(frozenset(torch._weights_only_unpickler._marked_safe_globals_set))


@functools.lru_cache(maxsize=8)
def _allowed_with(process: frozenset) -> dict:
    wo = torch._weights_only_unpickler
    allowed = {f"{g.__module__}.{g.__qualname__}": g for g in _plain_globals()}
    allowed.update(wo._get_user_allowed_globals())  # the process's, ``process`` as torch reads it
    allowed.update(wo._get_allowed_globals())
    return allowed
