"""A load's options: what every rank of one load must have been called with alike, and the
checks every verb's numeric options share (:func:`check_option`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Union

import torch

from ._dist import arrival_timeout as checked_timeout
from ._errors import OptionError
from ._settings import LOAD, Settings, from_env

__all__ = ["STRATEGIES", "ALIGN", "Options", "Progress", "check_option"]

STRATEGIES = ("auto", "own_shard", "reshard", "broadcast", "parallel")
ALIGN = 64  # bytes: pieces in a bucket or a shared-memory slot start on this boundary

# A progress callback gets (bytes done so far, bytes in all); True/False/None: a bar or not.
Progress = Optional[Union[bool, Callable[[int, int], None]]]


@dataclass(frozen=True)
class Options:
    """One load's options, as the verb was called, with the environment's settings read once."""

    strategy: str = "auto"
    bucket_mb: float = 256
    chunk_mb: float = 64
    # False; True: compare sums with torch's own reading of the files; "digest": check every
    # stored tensor read against the digest recorded beside the set (``_digest_check``).
    verify: Union[bool, str] = False
    trust_pickle: bool = False
    qkv: str = "auto"
    rules: Optional[Mapping] = None
    dtype: Optional[torch.dtype] = None
    progress: Progress = None
    # seconds; None: the settings' (``$METASEQ_ONELOAD_ARRIVAL_TIMEOUT``, else 300)
    arrival_timeout: Optional[float] = None
    # None: read at construction, once per verb (``_settings.from_env``).
    settings: Optional[Settings] = None

    def __post_init__(self):
        if self.arrival_timeout is not None:  # the keyword wins, and is checked first
            object.__setattr__(self, "arrival_timeout", checked_timeout(self.arrival_timeout))
        if self.settings is None:
            object.__setattr__(self, "settings", from_env(only=LOAD))
        if self.arrival_timeout is None:
            object.__setattr__(self, "arrival_timeout", checked_timeout(self.settings.arrival_timeout))
        if self.strategy not in STRATEGIES:
            raise OptionError(f"strategy={self.strategy!r}: expected one of {', '.join(STRATEGIES)}.")
        check_option("bucket_mb", self.bucket_mb)
        check_option("chunk_mb", self.chunk_mb)
        if not (self.verify is None or self.verify == "digest"
                or (not isinstance(self.verify, str) and self.verify in (0, 1))):
            raise OptionError(f"verify={self.verify!r}: expected False, True (compare "
                              "sums with torch's own reading) or \"digest\" (check the recorded digests). Nothing "
                              "was read.")

    @property
    def sums(self) -> bool:
        """verify=True: compare per-tensor sums with torch's own reading of the files."""
        return not isinstance(self.verify, str) and bool(self.verify)

    @property
    def digest(self) -> bool:
        """verify="digest": check what is read against the set's recorded digests."""
        return self.verify == "digest"

    @property
    def bucket_bytes(self) -> int:
        return max(ALIGN, int(self.bucket_mb * (1 << 20)) // ALIGN * ALIGN)

    @property
    def chunk_bytes(self) -> int:
        return max(1 << 16, int(self.chunk_mb * (1 << 20)))

    def asked(self, flat: bool, mp_size: int, dp_size: int) -> list:
        """What the ranks of one load must agree on, in the order the error lists it."""
        return [self.strategy, flat, self.bucket_mb, self.chunk_mb, self.verify, self.qkv, str(self.dtype),
                mp_size, dp_size]


# How each numeric option is checked, wherever it is taken (load, plan, convert, verify,
# export-hf and their flags): (what it must be, the test, an example of a good value).
_CHECKS = {
    "mb": ("a positive number of MiB", lambda v: 0 < v < float("inf"), "64"),
    "count": ("a whole number of at least 1", lambda v: v >= 1 and float(v).is_integer(), "4"),
    "tolerance": ("a finite number of at least 0", lambda v: 0 <= v < float("inf"), "1e-5"),
    "top": ("a whole number of at least 0", lambda v: v >= 0 and float(v).is_integer(), "10"),
}
_KINDS = {"bucket_mb": "mb", "chunk_mb": "mb", "jobs": "count", "world": "count", "model_parallel": "count",
          "shards": "count", "atol": "tolerance", "rtol": "tolerance", "top": "top", "nodes": "count",
          "ranks_per_node": "count"}


def check_option(name: str, value, kind: Optional[str] = None):
    """``value`` if option ``name`` may take it, else an :class:`OptionError` that names it
    as the API spells it, with the command line's flag in the ``(CLI: ...)`` form the CLI
    shows instead. ``None`` (the default) is always allowed."""
    if value is None:
        return value
    what, ok, example = _CHECKS[kind or _KINDS[name]]
    try:
        good = not isinstance(value, bool) and bool(ok(float(value)))
    except (TypeError, ValueError, OverflowError):
        good = False
    if not good:
        flag = "--" + name.replace("_", "-")
        shown = f"{value:g}" if isinstance(value, float) else str(value)
        raise OptionError(f"{name}={value!r} (CLI: {flag} {shown}): expected {what}, e.g. {name}={example} "
                          f"(CLI: {flag} {example}). Nothing was read or written.")
    return value
