"""The errors this package raises on purpose.

Every message says what was found, what was expected and what to do, and names the
file(s) involved. Tests pin the wording with ``pytest.raises(..., match=...)``.
"""

from __future__ import annotations


class OneloadError(RuntimeError):
    """Base class of every error metaseq-oneload raises on purpose."""


class CheckpointLayoutError(OneloadError):
    """The files do not form one complete, consistent checkpoint (missing shard, mixed
    runs, truncated or non-checkpoint file, ambiguous folder, symlink loop...)."""


class CheckpointNotFoundError(CheckpointLayoutError, FileNotFoundError):
    """Nothing at the path: no file, folder or suffixed set. With ``strategy="auto"`` a
    rank that cannot see the files receives them by broadcast instead."""


class UnsafeCheckpointError(OneloadError):
    """A checkpoint's pickle needs a class outside the allowlist; nothing was executed."""


class StateDictMismatchError(OneloadError):
    """The target (module or requested layout) does not match the checkpoint: missing,
    unexpected or wrongly shaped tensors. Raised before any weight is written."""


class ConversionError(OneloadError):
    """A conversion cannot proceed as asked (bad target, unsafe destination, incomplete write)."""


class OutputExistsError(ConversionError, FileExistsError):
    """A destination file exists and ``overwrite`` was not given, or it is a source file."""


class UnsupportedArchitectureError(ConversionError):
    """The checkpoint's architecture has settings Hugging Face OPT cannot express. Raised
    before anything is written; ``settings`` names each one."""

    def __init__(self, message: str, settings=()):
        super().__init__(message)
        self.settings = tuple(settings)


class DistributedLoadError(OneloadError):
    """Raised on every rank when any rank of a collective load failed.

    ``failures`` maps the global rank of each failing rank to its message.
    """

    def __init__(self, message: str, failures: dict[int, str] | None = None):
        super().__init__(message)
        self.failures = dict(failures or {})


def cap_list(items, n: int = 5, fmt=str, sep: str = ", ") -> str:
    """``items`` joined for a message, the first ``n`` (each through ``fmt``) then a count:
    a folder or cfg that claims a million shards must not make a 100 MB error message, nor
    take seconds to format one."""
    items = items if isinstance(items, (list, tuple, range)) else list(items)
    head = sep.join(fmt(x) for x in items[:n])
    return head + (f" ... and {len(items) - n} more" if len(items) > n else "")
