"""help() for the public names: their annotations as the source writes them.

The modules use postponed annotations (``from __future__ import annotations``), which
``inspect.signature`` shows as quoted strings (``path: 'str | os.PathLike'``). The package's
``__getattr__`` and the public submodules give each public function a ``__signature__`` whose
annotations read as written. Cheap to import: no torch, and ``inspect`` only when used.
"""

import re

__all__ = ["plain_signature"]


class _Text(str):
    """An annotation's source text, shown as written (``path: str | os.PathLike``)."""

    def __repr__(self) -> str:
        return str(self)


_QUOTED_NAME = re.compile(r"(['\"])([A-Za-z_][\w.]*)\1")


def _plain(annotation):
    if not isinstance(annotation, str):
        return annotation
    # Quotes inside a postponed annotation ("'str | os.PathLike'", Optional['dist.X']) are
    # for the interpreter only; help() would show them twice. Literal['x'] keeps its quotes.
    text = annotation.strip()
    if len(text) > 1 and text[0] == text[-1] and text[0] in "'\"":
        text = text[1:-1]
    if "Literal[" not in text:
        text = _QUOTED_NAME.sub(r"\2", text)
    return _Text(text)


def plain_signature(obj) -> None:
    """(local) Give ``obj`` a ``__signature__`` whose annotations read as the source writes
    them. A class shows its own ``__init__``'s (subclasses keep theirs)."""
    import inspect
    import types

    if isinstance(obj, type):
        obj = obj.__dict__.get("__init__")
    if not isinstance(obj, types.FunctionType) or "__signature__" in obj.__dict__:
        return
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return
    params = [p.replace(annotation=_plain(p.annotation)) for p in sig.parameters.values()]
    obj.__signature__ = sig.replace(parameters=params, return_annotation=_plain(sig.return_annotation))
