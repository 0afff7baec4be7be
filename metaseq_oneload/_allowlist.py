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
    """(local) Every name torch's ``weights_only`` loader accepts inside :func:`allowlisted`,
    by its dotted name: its own allowlist first, then the process's safe globals and ours."""
    return _allowed_with(frozenset(torch._weights_only_unpickler._marked_safe_globals_set))


@functools.lru_cache(maxsize=8)
def _allowed_with(process: frozenset) -> dict:
    wo = torch._weights_only_unpickler
    allowed = {f"{g.__module__}.{g.__qualname__}": g for g in safe_globals()}
    allowed.update(wo._get_user_allowed_globals())  # the process's, ``process`` as torch reads it
    allowed.update(wo._get_allowed_globals())
    return allowed
