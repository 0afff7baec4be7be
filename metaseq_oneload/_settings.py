"""Every ``METASEQ_ONELOAD_*`` environment variable, read in this one place.

A verb reads the environment once, into a frozen :class:`Settings` that travels inside its
options; no other module reads ``os.environ`` for a setting. The settings that choose which
collectives a rank enters (:data:`AGREED`) are gathered with the options before the first
collective of a load, and a difference between ranks is an :class:`OptionError` naming the
variable and the ranks (:func:`disagreement`): a rank never picks its collectives from
what it alone sees (``../shared/STYLE.md``, "Settings are agreed, not sensed").

===================================  =========  ===========================================
variable                             default    what it sets
===================================  =========  ===========================================
``METASEQ_ONELOAD_ARRIVAL_TIMEOUT``  300        seconds a rank waits for its peers to arrive
``METASEQ_ONELOAD_NODE``             (derived)  this rank's node name (torchrun's GROUP_RANK,
                                                else the host name)
``METASEQ_ONELOAD_SHM``              1          0: a node's ranks exchange through the
                                                network, not a shared-memory segment
``METASEQ_ONELOAD_SHM_DIR``          /dev/shm   where a node's shared-memory segments live
``METASEQ_ONELOAD_O_DIRECT``         0          1: local reads bypass the page cache
``METASEQ_ONELOAD_READ_THREADS``     8          threads reading one file's ranges
``METASEQ_ONELOAD_READ_SPLIT_MB``    16         a read larger than this is split over them
``METASEQ_ONELOAD_REMOTE_*``                    object stores: ``CONCURRENCY`` (16),
                                                ``RETRIES`` (5), ``BACKOFF`` (0.2 s),
                                                ``PART_MB`` (8)
``METASEQ_ONELOAD_STORAGE_OPTIONS``  {}         JSON fsspec options, for all or per protocol
``METASEQ_ONELOAD_INDEX_KEY``        (file)     the key that signs our index files
===================================  =========  ===========================================

``METASEQ_ONELOAD`` itself (Hydra overrides that activate the plugin) belongs to the
startup hook (``_hydra.ENV``), not to a load, and is not a setting here.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Mapping, Optional, Sequence

from ._errors import OptionError

__all__ = ["Settings", "AGREED", "from_env", "disagreement"]

PREFIX = "METASEQ_ONELOAD_"


@dataclass(frozen=True)
class Settings:
    """The environment's settings, as one rank read them (see the module docstring)."""

    arrival_timeout: float = 300.0
    node: Optional[str] = None
    shm: bool = True
    shm_dir: str = "/dev/shm"
    o_direct: bool = False
    read_threads: int = 8
    read_split_mb: float = 16.0
    remote_concurrency: int = 16
    remote_retries: int = 5
    remote_backoff: float = 0.2
    remote_part_mb: float = 8.0
    storage_options: str = "{}"
    index_key: str = ""

    def agreed(self) -> dict:
        """The settings every rank of a load must share, as JSON-ready values (never the
        index key: it is a secret, and only this process uses it)."""
        return {name: asdict(self)[name] for name in AGREED}


# The settings that decide which collectives a rank enters: a node's ranks meet in a
# shared-memory segment only if every one of them uses it, in the same folder.
AGREED = ("shm", "shm_dir")

# field -> (variable suffix, kind)
_FIELDS = {
    "arrival_timeout": ("ARRIVAL_TIMEOUT", "seconds"),
    "node": ("NODE", "text"),
    "shm": ("SHM", "flag_on"),
    "shm_dir": ("SHM_DIR", "text"),
    "o_direct": ("O_DIRECT", "flag"),
    "read_threads": ("READ_THREADS", "count"),
    "read_split_mb": ("READ_SPLIT_MB", "mb"),
    "remote_concurrency": ("REMOTE_CONCURRENCY", "count"),
    "remote_retries": ("REMOTE_RETRIES", "count0"),
    "remote_backoff": ("REMOTE_BACKOFF", "seconds0"),
    "remote_part_mb": ("REMOTE_PART_MB", "mb"),
    "storage_options": ("STORAGE_OPTIONS", "text"),
    "index_key": ("INDEX_KEY", "secret"),
}

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def variable(field: str) -> str:
    """The environment variable behind a :class:`Settings` field."""
    return PREFIX + _FIELDS[field][0]


def _parse(field: str, raw: str):
    name, kind = _FIELDS[field]
    var = PREFIX + name
    if kind in ("text", "secret"):
        return raw
    if kind in ("flag", "flag_on"):
        low = raw.lower()
        if low in _TRUE or low in _FALSE:
            return low in _TRUE
        raise OptionError(f"${var}={raw!r}: expected 1 or 0 (also true/false, yes/no, on/off). "
                          f"Set it to one of those, or unset it for the default.")
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    ok = {
        "seconds": value > 0,
        "seconds0": value >= 0,
        "mb": value > 0,
        "count": value >= 1 and value.is_integer() if value == value else False,
        "count0": value >= 0 and value.is_integer() if value == value else False,
    }[kind] and value < float("inf")
    if not ok:
        what = {"seconds": "a positive number of seconds", "seconds0": "a number of seconds of at least 0",
                "mb": "a positive number of MiB", "count": "a whole number of at least 1",
                "count0": "a whole number of at least 0"}[kind]
        raise OptionError(f"${var}={raw!r}: expected {what}. Set it so, or unset it for the default.")
    return int(value) if kind.startswith("count") else value


def from_env(environ: Optional[Mapping[str, str]] = None) -> Settings:
    """(local, any rank) The settings the environment holds now; a variable set to nothing
    (or blanks) counts as unset. A malformed value is an :class:`OptionError` naming it."""
    env = os.environ if environ is None else environ
    values = {}
    for field in _FIELDS:
        raw = env.get(variable(field), "").strip()
        if raw:
            values[field] = _parse(field, raw)
    return Settings(**values)


def disagreement(agreed: Sequence[Mapping], ranks: Sequence[int]) -> Optional[str]:
    """(local) Given every rank's :meth:`Settings.agreed` (in group order) and their global
    ranks, a message naming the first variable that differs and the ranks on each side;
    None where all agree."""
    if not agreed:
        return None
    for field in AGREED:
        values = {}
        for rank, a in zip(ranks, agreed):
            values.setdefault(repr(a.get(field)), []).append(rank)
        if len(values) > 1:
            sides = "; ".join(f"{v} on rank(s) {', '.join(map(str, rs[:8]))}{' ...' if len(rs) > 8 else ''}"
                              for v, rs in values.items())
            return (f"${variable(field)} differs between the ranks of one load ({sides}): it decides which "
                    "collectives a rank enters. Set it the same in every rank's environment (or unset it "
                    "everywhere).")
    return None
