"""The patch's bookkeeping: what :func:`metaseq_oneload.install` changed (undone exactly and
in reverse), the originals it replaced, and the configuration the patched functions use.

Every module of the integrations reads the installed state here and nowhere else; nothing
here imports metaseq, fairseq or torch.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Callable, Optional

from .._hydra import OneloadConfig

__all__ = ["Patches", "STATE", "swap", "rebind", "original", "installed", "current_config"]

_ABSENT = object()


class Patches:
    """What :func:`install` changed, undone exactly and in reverse (pytest's MonkeyPatch)."""

    def __init__(self) -> None:
        self._undo: list = []

    def setattr(self, target: Any, name: str, value: Any) -> None:
        self._undo.append((target, name, vars(target).get(name, _ABSENT)))
        setattr(target, name, value)

    def on_undo(self, fn: Callable[[], None]) -> None:
        self._undo.append((None, fn, None))

    def extend(self, other: "Patches") -> None:
        """Take over ``other``'s changes: undone with these, after them."""
        self._undo.extend(other._undo)
        other._undo = []

    def undo(self) -> None:
        while self._undo:
            target, name, old = self._undo.pop()
            if target is None:
                name()
            elif old is _ABSENT:
                if name in vars(target):
                    delattr(target, name)
            else:
                setattr(target, name, old)


@dataclasses.dataclass
class State:
    """The installation in effect (one per process)."""

    patches: Optional[Patches] = None  # None: not installed
    config: OneloadConfig = dataclasses.field(default_factory=OneloadConfig)
    explicit: frozenset = frozenset()  # the loading settings the user gave (see install())
    originals: dict = dataclasses.field(default_factory=dict)  # 'module.name' / 'Class.name' -> replaced
    libraries: tuple = ()  # the libraries patched
    hydra_schema: bool = False


STATE = State()


def installed() -> bool:
    """Whether :func:`install` is in effect."""
    return STATE.patches is not None


def current_config() -> OneloadConfig:
    """The configuration the patched functions use."""
    return STATE.config


def original(key: str) -> Callable:
    """The function ``key`` ('metaseq.checkpoint_utils.load_checkpoint') that the patch replaced."""
    return STATE.originals[key]


def swap(patches: Patches, target: Any, name: str, new: Callable) -> Callable:
    """Replace ``target.name`` and remember the original under 'module.name' / 'Class.name'."""
    label = target.__name__ if isinstance(target, type(sys)) else f"{target.__module__}.{target.__qualname__}"
    old = getattr(target, name)
    STATE.originals[f"{label}.{name}"] = old
    patches.setattr(target, name, new)
    return old


def rebind(patches: Patches, prefix: str, name: str, old: Any, new: Any) -> None:
    """Point every already-imported ``prefix.*`` module that did ``from x import name`` at
    ``new``: patching only the defining module would leave those copies behind."""
    for modname, mod in list(sys.modules.items()):
        if mod is None or not (modname == prefix or modname.startswith(prefix + ".")):
            continue
        if vars(mod).get(name, _ABSENT) is old:
            patches.setattr(mod, name, new)
