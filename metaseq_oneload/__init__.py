"""metaseq-oneload: point at any file of a checkpoint; every rank gets its part.

Public API (everything else is private)::

    inspect(path) -> CheckpointLayout          what a checkpoint is, from metadata only
    load_state_dict(path, ...) -> state dict   this rank's part of the weights (collective)
    load_checkpoint(path, ...)                 the same, with shard_metadata, layout, report
    load_into(module, path, ...)               fill a plain, meta or FSDP2 module in place
"""

from ._errors import (
    CheckpointLayoutError,
    CheckpointNotFoundError,
    DistributedLoadError,
    OneloadError,
    StateDictMismatchError,
    UnsafeCheckpointError,
)
from ._layout import CheckpointLayout, discover as inspect
from ._loading import LoadedCheckpoint, LoadReport, load_checkpoint, load_into, load_state_dict

__all__ = [
    "inspect",
    "load_state_dict",
    "load_checkpoint",
    "load_into",
    "CheckpointLayout",
    "LoadedCheckpoint",
    "LoadReport",
    "OneloadError",
    "CheckpointLayoutError",
    "CheckpointNotFoundError",
    "UnsafeCheckpointError",
    "StateDictMismatchError",
    "DistributedLoadError",
]

__version__ = "0.1.0"
