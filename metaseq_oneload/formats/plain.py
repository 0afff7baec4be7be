"""Plain PyTorch checkpoints: one ``torch.save`` file holding a state dict, bare
(``torch.save(model.state_dict())``) or in the container a training script put it in
(``{"state_dict": ...}`` from Lightning, ``{"model_state_dict": ...}`` from the PyTorch
tutorials, ``{"module": ...}`` from DeepSpeed, ``{"model": ...}`` without a metaseq/fairseq
``cfg``), under any file name (``model.pt``, ``weights.pth``, ``final.ckpt``).

Files named by the metaseq grammar with part or shard suffixes, and folders, belong to
:mod:`.metaseq`; a bare state dict found there is described the same way.
"""

from __future__ import annotations

import glob
import os
from typing import Mapping

from .. import _storage
from .._errors import CheckpointLayoutError
from .._layout import CheckpointFile, CheckpointLayout, CheckpointSettings, FileName
from .._reading import read_header
from . import _parts, _torchsave

NAME = "plain"


def _single_file(path: str):
    """The real file a single-file path names, or None where the path is a folder, a glob,
    a member of a suffixed set, or nothing."""
    if glob.has_magic(path) or not _storage.lexists(path) or _storage.isdir(path):
        return None
    try:
        real = _torchsave.resolve_links(path)
    except CheckpointLayoutError:
        return None
    if _storage.isdir(real):
        return None
    parsed = FileName.parse(os.path.basename(real))
    if parsed is not None and (parsed.part is not None or parsed.shard is not None):
        return None
    return real


def detect(path: str) -> bool:
    """One readable torch file whose pickle is a state dict and no metaseq/fairseq dict."""
    real = _single_file(os.fspath(path))
    if real is None:
        return False
    if not real.endswith(".pt"):
        return True  # no other family takes such a name: what the file is, describe() says
    try:
        header = read_header(real)
    except CheckpointLayoutError:
        return False  # damaged or not torch: the metaseq describer says what it is
    except Exception:  # an unsafe pickle: refused there, with its message
        return False
    return (isinstance(header, Mapping) and _torchsave.container(header) is not None
            and not any(k in header for k in _torchsave.TRAINING_KEYS))  # such a file is theirs


def describe(path: str, *, trust_pickle: bool = False) -> CheckpointLayout:
    """(any rank, local) The one-file layout of a plain state dict."""
    real = _single_file(os.fspath(path))
    directory, base = os.path.split(real)
    prefix = base[:-3] if base.endswith(".pt") else base
    given = os.path.basename(os.fspath(path))
    fileset = _torchsave.FileSet(directory, prefix, (real,), (given,) if given != base else ())
    with _torchsave.alone_if_one([real]):
        header = read_header(real, trust_pickle=trust_pickle)
    f = CheckpointFile(real, 0, 0, _storage.getsize(real), _torchsave.file_format(real))
    ts = _torchsave.TorchSet(fileset, FileName(prefix), ((f,),), {real: header})
    parts, metadata_key, stale = _parts.build_parts(ts)
    return CheckpointLayout(
        directory=directory,
        prefix=prefix,
        name=FileName(prefix),
        files=((f,),),
        parts=parts,
        cfg=CheckpointSettings(),
        metadata_key=metadata_key,
        aliases=fileset.aliases,
        num_updates=None,
        flavor="pytorch",
        notes=tuple(w for _, w in stale),
        stale_metadata=tuple(dict.fromkeys(k for k, _ in stale)),
        trust_pickle=trust_pickle,
    )
