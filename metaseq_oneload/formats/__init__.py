"""Checkpoint formats: one module per family, behind one registry.

Each format module offers ``NAME``, ``detect(path) -> bool`` (cheap: names, at most one
cached header) and ``describe(path, *, trust_pickle) -> CheckpointLayout``.
:func:`discover` asks them in order and the first that recognises the path describes it:

========================  ====================================================================
``dcp``                   ``torch.distributed.checkpoint`` folders (``.metadata`` + ``*.distcp``), local or URL;
                          the Hugging Face writer's distributed save (``shard-*-model-*.safetensors``)
``huggingface``           ``model.safetensors``, sharded ``*.index.json`` sets, ``pytorch_model.bin``
``plain``                 one ``torch.save``'d state dict, bare or in a training script's container
``metaseq``               metaseq/fairseq ``.pt`` sets by their file-name grammar (the last resort)
========================  ====================================================================

Adding a writer's format is one module here, one line in :data:`FORMATS`, and its corpus
entries under ``tests/fixtures/``.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from dataclasses import dataclass
from typing import Callable, Optional

from .. import _storage
from .._errors import CheckpointLayoutError, CheckpointNotFoundError, reading
from .._layout import CheckpointLayout
from . import _index, dcp, huggingface, metaseq, plain

__all__ = ["Format", "FORMATS", "discover", "format_of", "to_wire", "adopt"]


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
# comes last because it claims every path (and so gives the not-found errors). DCP first: a
# shard file of the Hugging Face writer's distributed save is a .safetensors file holding a
# chunk, which only the whole folder describes.
FORMATS: tuple = tuple(Format.of(m) for m in (dcp, huggingface, plain, metaseq))


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
    path = _weights_of_prefix(os.fspath(path))
    _storage.refresh(path)  # objects as the store holds them now, pinned for the load that follows
    fmt = format_of(path)
    if _storage.is_url(path) and fmt.name not in ("plain", "metaseq", "dcp"):
        raise CheckpointLayoutError(
            f"{path}: a {fmt.name} checkpoint at a URL, which this version reads from local files only "
            "(torch.save .pt files and sets, and DCP folders, are read from URLs). Copy it to a local folder first "
            "(e.g. `aws s3 cp --recursive`) and pass that folder.")
    with reading(path):  # what a file holds never surfaces as a bare TypeError or OSError
        layout = fmt.describe(path, trust_pickle=trust_pickle)
    return _as_given(layout, path)


# What follows a prefix the tool prints for a weight file that is not a .pt set (convert's
# safetensors output, a Hugging Face folder's model / pytorch_model).
_WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json")


def _weights_of_prefix(path: str) -> str:
    """``path`` itself, unless nothing is there and it is a prefix the tool printed for a
    safetensors or .bin file beside no .pt set of that prefix: then that file."""
    if _storage.is_url(path) or glob.has_magic(path) or os.path.lexists(path) or path.endswith((".pt", os.sep)):
        return path
    found = [path + s for s in _WEIGHT_SUFFIXES if os.path.isfile(path + s)]
    if not found or glob.glob(glob.escape(path) + "[-_]*.pt"):
        return path  # a .pt set (or nothing): the metaseq grammar's resolution says which
    return found[0]


def _given_folder(path: str) -> str:
    if _storage.is_url(path):  # a URL names one place for every rank: no links, no cwd
        return path.rstrip("/") if _storage.isdir(path) else path.rsplit("/", 1)[0]
    given = path if os.path.isdir(path) and not glob.has_magic(path) else os.path.dirname(path)
    return os.path.abspath(given or ".")


def _as_given(layout: CheckpointLayout, path: str) -> CheckpointLayout:
    """The layout with its paths under the folder the user named, where that folder is a
    link to the real one (checkpoints often live behind links to shared storage): what
    ``inspect`` shows and what errors name is then what the user typed. The describers
    resolve links to group files; that stays, only the spelling changes."""
    if _storage.is_url(path):
        return layout
    given = _given_folder(path)
    if given == layout.directory or os.path.realpath(given) != os.path.realpath(layout.directory):
        return layout
    return _relocated(layout, given)


def to_wire(layout: CheckpointLayout, path: str) -> bytes:
    """(coordinator) What one rank sends the others instead of letting each discover: the
    layout (no header, no file digest) and where it lies relative to the path it was given."""
    d = _index.to_json(layout, identities=False)
    d["where"] = {"directory": layout.directory, "given": _given_folder(os.fspath(path)), "index": layout.index}
    return json.dumps(d, separators=(",", ":")).encode()


def adopt(payload: bytes, path: "str | os.PathLike", *, trust_pickle: bool = False) -> CheckpointLayout:
    """(local) The layout another rank discovered, as this rank sees the files: its folder
    found from this rank's own ``path`` the way the sender's was from its path, every file
    there with the sender's size and modification time. Reads no file.

    Raises:
        CheckpointNotFoundError: the files are not visible here.
        CheckpointLayoutError: they are, but differ from the sender's (then discover here).
    """
    d = json.loads(payload)
    where = d["where"]
    if _storage.is_url(where["directory"]) or _storage.is_url(os.fspath(path)):
        return _vouched(_adopt_url(d, path, trust_pickle=trust_pickle))
    folder = os.path.normpath(os.path.join(_given_folder(os.fspath(path)),
                                           os.path.relpath(where["directory"], where["given"])))
    layout = _index.from_json(d, folder, trust_pickle=trust_pickle, index=False)
    if where["index"]:
        layout = dataclasses.replace(layout, index=os.path.join(folder, os.path.basename(where["index"])))
    for row, rows in zip(layout.files, d["files"]):
        for f, sent in zip(row, rows):
            try:
                st = os.stat(f.path)
            except FileNotFoundError:
                raise CheckpointNotFoundError(f"{f.path}: not here (the coordinating rank has it).") from None
            except OSError as e:
                raise CheckpointLayoutError(f"{f.path}: cannot read it here ({e.strerror or e}).") from None
            if (st.st_size, st.st_mtime_ns) != (sent["size"], sent["mtime_ns"]):
                raise CheckpointLayoutError(f"{f.path}: not the file the coordinating rank sees (size or time differ).")
    return _vouched(layout)


def _vouched(layout: CheckpointLayout) -> CheckpointLayout:
    """A DCP layout's chunks, which the sender checked item by item, taken as checked here
    (:func:`.dcp.vouch_layout`: this rank does not parse every item again)."""
    if layout.flavor == "dcp":
        dcp.vouch_layout(layout)
    return layout


def _adopt_url(d: dict, path, *, trust_pickle: bool) -> CheckpointLayout:
    """An object store shows every rank the same objects under one URL: the sender's layout
    is taken as it is (no request per file per rank), where this rank was given the same URL."""
    where = d["where"]
    if os.fspath(path) != where["given"] and _given_folder(os.fspath(path)) != where["given"]:
        raise CheckpointLayoutError(f"{path}: not the URL the coordinating rank was given ({where['given']}).")
    layout = _index.from_json(d, where["directory"], trust_pickle=trust_pickle, index=False)
    if where["index"]:
        layout = dataclasses.replace(layout, index=where["index"])
    for row, rows in zip(layout.files, d["files"]):  # read the versions the sender described
        for f, sent in zip(row, rows):
            _storage.pin(f.path, sent["size"], sent["mtime_ns"])
    return layout


def _relocated(layout: CheckpointLayout, given: str) -> CheckpointLayout:
    """The same layout, every path under ``given`` instead of ``layout.directory``."""
    real = layout.directory

    def moved(p: str) -> str:
        return os.path.join(given, os.path.relpath(p, real)) if p.startswith(real + os.sep) else p

    files = tuple(tuple(dataclasses.replace(f, path=moved(f.path)) for f in row) for row in layout.files)
    parts = tuple(
        dataclasses.replace(part, tensors={
            n: dataclasses.replace(t, extents=tuple(dataclasses.replace(e, path=moved(e.path)) for e in t.extents))
            for n, t in part.tensors.items()})
        for part in layout.parts)
    return dataclasses.replace(layout, directory=given, files=files, parts=parts)
