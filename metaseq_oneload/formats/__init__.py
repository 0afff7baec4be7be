"""Checkpoint formats: one module per family, behind one registry.

Each format module offers ``NAME``, ``detect(path) -> bool`` (cheap: names, at most one
cached header) and ``describe(path, *, trust_pickle) -> CheckpointLayout``.
:func:`discover` asks them in order and the first that recognises the path describes it:

========================  ====================================================================
``huggingface``           ``model.safetensors``, sharded ``*.index.json`` sets, ``pytorch_model.bin``
``dcp``                   ``torch.distributed.checkpoint`` folders (recognised, not read yet)
``plain``                 one ``torch.save``'d state dict, bare or in a training script's container
``metaseq``               metaseq/fairseq ``.pt`` sets by their file-name grammar (the last resort)
========================  ====================================================================

Adding a writer's format is one module here, one line in :data:`FORMATS`, and its corpus
entries under ``tests/fixtures/``.
"""

from __future__ import annotations

import dataclasses
import glob
import os
from dataclasses import dataclass
from typing import Callable, Optional

from .._layout import CheckpointLayout
from . import dcp, huggingface, metaseq, plain

__all__ = ["Format", "FORMATS", "discover", "format_of"]


@dataclass(frozen=True)
class Format:
    """One checkpoint family: how to recognise it and how to describe it."""

    name: str
    detect: Callable[[str], bool]
    describe: Callable[..., CheckpointLayout]

    @classmethod
    def of(cls, module) -> "Format":
        return cls(module.NAME, module.detect, module.describe)


# Order matters: the first format that recognises a path describes it; metaseq's grammar
# comes last because it claims every path (and so gives the not-found errors).
FORMATS: tuple = tuple(Format.of(m) for m in (huggingface, dcp, plain, metaseq))


def format_of(path: "str | os.PathLike") -> Optional[Format]:
    """(local) The format that would describe ``path``."""
    path = os.fspath(path)
    return next((f for f in FORMATS if f.detect(path)), None)


def discover(path: "str | os.PathLike", *, trust_pickle: bool = False) -> CheckpointLayout:
    """(any rank, local) Describe the checkpoint that ``path`` belongs to.

    ``path`` may be a folder, any file of a set (any part, any shard, a ``checkpoint_last-*``
    link or text pointer), the un-suffixed name metaseq scripts take (``.../checkpoint_last.pt``,
    ``.../reshard.pt``), or a glob; a plain ``torch.save`` file under any name; or a Hugging
    Face folder or weight file (``model.safetensors``, a sharded ``*.index.json`` set,
    ``pytorch_model.bin``). Reads file names and headers only, never tensor data, and
    modifies nothing on disk.

    Raises:
        CheckpointLayoutError: with the file(s), what was found, what was expected and what
            to do, for a missing shard or part, a truncated or non-checkpoint file, an empty
            or ambiguous folder, mixed checkpoints, inconsistent padding, a symlink loop.
        CheckpointNotFoundError: nothing at the path.
        UnsafeCheckpointError: a header needs a class outside the allowlist.
    """
    path = os.fspath(path)
    return _as_given(format_of(path).describe(path, trust_pickle=trust_pickle), path)


def _as_given(layout: CheckpointLayout, path: str) -> CheckpointLayout:
    """The layout with its paths under the folder the user named, where that folder is a
    link to the real one (checkpoints often live behind links to shared storage): what
    ``inspect`` shows and what errors name is then what the user typed. The describers
    resolve links to group files; that stays, only the spelling changes."""
    given = path if os.path.isdir(path) and not glob.has_magic(path) else os.path.dirname(path)
    given = os.path.abspath(given or ".")
    real = layout.directory
    if given == real or os.path.realpath(given) != os.path.realpath(real):
        return layout

    def moved(p: str) -> str:
        return os.path.join(given, os.path.relpath(p, real)) if p.startswith(real + os.sep) else p

    files = tuple(tuple(dataclasses.replace(f, path=moved(f.path)) for f in row) for row in layout.files)
    parts = tuple(
        dataclasses.replace(part, tensors={
            n: dataclasses.replace(t, extents=tuple(dataclasses.replace(e, path=moved(e.path)) for e in t.extents))
            for n, t in part.tensors.items()})
        for part in layout.parts)
    return dataclasses.replace(layout, directory=given, files=files, parts=parts)
