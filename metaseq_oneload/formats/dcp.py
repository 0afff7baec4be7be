"""``torch.distributed.checkpoint`` folders (a ``.metadata`` file beside ``*.distcp``
files), recognised so that they get a true answer instead of "no *.pt files".

Reading them is not implemented yet; the describer says how to get a file this package
reads (torch's own converter) or to load them with ``torch.distributed.checkpoint.load``.
"""

from __future__ import annotations

import os

from .._errors import CheckpointLayoutError
from .._layout import CheckpointLayout

NAME = "dcp"


def _folder(path: str) -> str:
    return os.path.dirname(path) if os.path.basename(path) == ".metadata" else path


def detect(path: str) -> bool:
    folder = _folder(os.fspath(path))
    return os.path.isdir(folder) and os.path.isfile(os.path.join(folder, ".metadata"))


def describe(path: str, *, trust_pickle: bool = False) -> CheckpointLayout:
    folder = _folder(os.fspath(path))
    n = sum(1 for e in os.listdir(folder) if e.endswith(".distcp"))
    raise CheckpointLayoutError(
        f"{folder}: a torch.distributed.checkpoint folder (.metadata and {n} .distcp file(s)), which "
        "this version of metaseq-oneload does not read. Load it with torch.distributed.checkpoint.load, "
        "or convert it once with `python -m torch.distributed.checkpoint.format_utils dcp_to_torch "
        f"{folder} OUT.pt` and point at OUT.pt."
    )
