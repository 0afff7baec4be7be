"""metaseq-oneload: point at any file of a checkpoint; every rank gets its part.

Public API (everything else is private)::

    inspect(path) -> CheckpointLayout          what a checkpoint is, from metadata only
    load_state_dict(path, ...) -> state dict   this rank's part of the weights (collective)
    load_checkpoint(path, ...)                 the same, with shard_metadata, layout, report
    load_into(module, path, ...)               fill a plain, meta or FSDP2 module in place
    convert(src, dst_prefix, ...)              rewrite a checkpoint in any layout, streaming
    consolidate(src, dst) / verify(a, b)       one unflattened file / compare any two layouts
"""

from ._convert import ConvertReport, consolidate, convert
from ._errors import (
    CheckpointLayoutError,
    CheckpointNotFoundError,
    ConversionError,
    DistributedLoadError,
    OutputExistsError,
    OneloadError,
    StateDictMismatchError,
    UnsafeCheckpointError,
)
from ._layout import CheckpointLayout, discover as inspect
from ._loading import LoadedCheckpoint, LoadReport, load_checkpoint, load_into, load_state_dict
from ._verify import TensorDiff, VerifyReport, verify

__all__ = [
    "inspect",
    "load_state_dict",
    "load_checkpoint",
    "load_into",
    "convert",
    "consolidate",
    "verify",
    "CheckpointLayout",
    "LoadedCheckpoint",
    "LoadReport",
    "ConvertReport",
    "VerifyReport",
    "TensorDiff",
    "OneloadError",
    "CheckpointLayoutError",
    "CheckpointNotFoundError",
    "UnsafeCheckpointError",
    "StateDictMismatchError",
    "DistributedLoadError",
    "ConversionError",
    "OutputExistsError",
]

__version__ = "0.1.0"
