"""Run a callback right after a package has been imported: how the start-up hook
(:mod:`._startup`) installs the patch once metaseq or fairseq is imported, and how
:func:`metaseq_oneload.install` patches a library the program imports later.

A module of its own, importing nothing of this package: the start-up hook must stay free
of torch, and the integrations must not import the start-up hook back.
"""

import importlib.abc
import importlib.util
import sys
import threading
from typing import Any, Callable, Iterable

__all__ = ["AfterImport"]


class AfterImport(importlib.abc.MetaPathFinder):
    """Runs a callback once the first of some top-level packages has finished importing
    (its ``__init__`` executed), then leaves ``sys.meta_path``."""

    def __init__(self, names: Iterable[str], callback: Callable[[], None]):
        self.names = frozenset(names)
        self.callback = callback
        self._searching = threading.local()
        self._fired = False

    @classmethod
    def watch(cls, names: Iterable[str], callback: Callable[[], None]) -> "AfterImport":
        """(local) Put a finder for ``names`` first on ``sys.meta_path``; returns it."""
        finder = cls(names, callback)
        sys.meta_path.insert(0, finder)
        return finder

    def find_spec(self, fullname: str, path: Any = None, target: Any = None):
        if fullname not in self.names or getattr(self._searching, "on", False):
            return None
        self._searching.on = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._searching.on = False
        if spec is None or spec.loader is None:
            return None
        spec.loader = _ThenCall(spec.loader, self)
        return spec

    def fire(self) -> None:
        if self._fired:
            return
        self._fired = True
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        self.callback()


class _ThenCall(importlib.abc.Loader):
    """A loader that runs the real one, puts it back on the module, then fires."""

    def __init__(self, loader: Any, finder: AfterImport):
        self._loader = loader
        self._finder = finder

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        module.__loader__ = self._loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        self._finder.fire()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)
