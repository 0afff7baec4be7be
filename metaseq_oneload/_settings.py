"""Every ``METASEQ_ONELOAD_*`` environment variable, read in this one place.

A verb reads the environment once, into a frozen :class:`Settings` that travels inside its
options; no other module reads ``os.environ`` for a setting. The settings that choose which
collectives a rank enters (:data:`AGREED`) are gathered with the options before the first
collective of a load, and a difference between ranks is an :class:`OptionError` naming the
variable and the ranks (:func:`disagreement`): a rank never picks its collectives from
what it alone sees (``../shared/STYLE.md``, "Settings are agreed, not sensed").

======================================  =========  ==============================================
variable                                default    what it sets
======================================  =========  ==============================================
``METASEQ_ONELOAD_ARRIVAL_TIMEOUT``     300        seconds a rank waits for its peers to arrive
                                                   (``arrival_timeout=`` wins over it)
``METASEQ_ONELOAD_NODE``                (derived)  this rank's node name (else torchrun's
                                                   GROUP_RANK, else the host name)
``METASEQ_ONELOAD_SHM``                 1          0: a node's ranks exchange through the
                                                   network, not a shared-memory segment
``METASEQ_ONELOAD_SHM_DIR``             /dev/shm   where a node's shared-memory segments live
``METASEQ_ONELOAD_O_DIRECT``            auto       a one-process load reads with O_DIRECT
                                                   the pieces the cache lacks; 0: every
                                                   read through the page cache; 1: every
                                                   local read with O_DIRECT
``METASEQ_ONELOAD_READ_THREADS``        (derived)  threads reading one file's ranges: 8, or 1
                                                   for a load's rank reading under 32 MiB,
                                                   or the CPUs for a lone load the page
                                                   cache holds
``METASEQ_ONELOAD_READ_SPLIT_MB``       16         a read larger than this is split over them
``METASEQ_ONELOAD_REMOTE_CONCURRENCY``  16         object store requests in flight per process
``METASEQ_ONELOAD_REMOTE_RETRIES``      5          retries per request after the first try
``METASEQ_ONELOAD_REMOTE_BACKOFF``      0.2        first backoff in seconds; doubled per retry,
                                                   capped at 10 s, with jitter
``METASEQ_ONELOAD_REMOTE_PART_MB``      (derived)  largest single ranged request, MiB; unset:
                                                   sized from the store's answers (8-32)
``METASEQ_ONELOAD_STORAGE_OPTIONS``     {}         JSON fsspec options, for all or per protocol
``METASEQ_ONELOAD_INDEX_KEY``           (file)     the file holding the key that signs our index
                                                   files (``~/.cache/metaseq_oneload/index-key``)
======================================  =========  ==============================================

``docs/environment.md`` holds the same table for users (tests/unit/test_settings.py checks
both against :data:`_FIELDS` and the defaults of :class:`Settings`).

``METASEQ_ONELOAD`` itself (Hydra overrides that activate the plugin) belongs to the
startup hook (``_hydra.ENV``), not to a load, and is not a setting here.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Mapping, Optional, Sequence

from ._errors import OptionError

__all__ = ["LOAD", "REMOTE", "INDEX", "Settings", "AGREED", "PREFIX", "from_env", "variable", "disagreement"]

PREFIX = "METASEQ_ONELOAD_"


@dataclass(frozen=True)
class Settings:
    """The environment's settings, as one rank read them (see the module docstring)."""

    # Only a rank that never calls the load waits this out: one whose call fails before the
    # check-in tells the others at once (_dist.tell_failed). It is sized for a rank that is
    # merely slow to arrive: the metaseq/fairseq integrations discover the set on each rank
    # (every header of the set) before the engine's check-in, which on a cold network file
    # system takes minutes for a large set while its peers wait. 120 s failed such a rank.
    arrival_timeout: float = 300.0
    node: Optional[str] = None
    shm: bool = True
    shm_dir: str = "/dev/shm"
    # None ("auto"): a load with no other rank chooses O_DIRECT per piece from the page cache
    # (cold pieces straight into their destination, no copy out of the cache; warm ones from
    # it), so that neither a cold nor a warm load pays for the other (#26). Other loads read
    # through the cache, which a node's ranks share.
    o_direct: Optional[bool] = None
    # None: 8 threads, and the serial reader for a load's rank that reads little (_engine);
    # a value set in the environment is taken as it is.
    read_threads: Optional[int] = None
    read_split_mb: float = 16.0
    remote_concurrency: int = 16
    remote_retries: int = 5
    remote_backoff: float = 0.2
    # None: sized from what the store answers (_remote.part_size_for: 8 MiB, up to 32 MiB
    # where requests cost more than their bytes); a value set in the environment is taken as it is.
    remote_part_mb: Optional[float] = None
    storage_options: str = "{}"
    index_key: str = ""

    def agreed(self) -> dict:
        """The settings every rank of a load must share (:data:`AGREED`), as JSON-ready
        values: the ones that choose which collectives a rank enters, nothing else."""
        return {name: asdict(self)[name] for name in AGREED}


# The settings that decide which collectives a rank enters: a node's ranks meet in a
# shared-memory segment only if every one of them uses it, in the same folder.
AGREED = ("shm", "shm_dir")

# field -> (variable suffix, kind); a kind says how a value is read and checked (_KINDS)
_FIELDS = {
    "arrival_timeout": ("ARRIVAL_TIMEOUT", "seconds"),
    "node": ("NODE", "text"),
    "shm": ("SHM", "flag_on"),
    "shm_dir": ("SHM_DIR", "text"),
    "o_direct": ("O_DIRECT", "flag_auto"),
    "read_threads": ("READ_THREADS", "count"),
    "read_split_mb": ("READ_SPLIT_MB", "mb"),
    "remote_concurrency": ("REMOTE_CONCURRENCY", "count"),
    "remote_retries": ("REMOTE_RETRIES", "count0"),
    "remote_backoff": ("REMOTE_BACKOFF", "seconds0"),
    "remote_part_mb": ("REMOTE_PART_MB", "part_mb"),
    "storage_options": ("STORAGE_OPTIONS", "json_object"),
    "index_key": ("INDEX_KEY", "path"),
}

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_INF = float("inf")


def _whole(low: int):
    return lambda v: low <= v < _INF and v.is_integer()


# kind -> (what a value must be, the check of its number). Every wording starts "a number"
# (tests and users match on it); the bounds are what the code behind the variable needs (a
# ranged request under 64 KiB costs more in requests than it saves in memory).
_KINDS = {
    "seconds": ("a number of seconds above 0", lambda v: 0 < v < _INF),
    "seconds0": ("a number of seconds, 0 or more", lambda v: 0 <= v < _INF),
    "mb": ("a number of MiB above 0", lambda v: 0 < v < _INF),
    "part_mb": ("a number of MiB, at least 0.0625 (64 KiB)", lambda v: 1 / 16 <= v < _INF),
    "count": ("a number (whole, at least 1)", _whole(1)),
    "count0": ("a number (whole, 0 or more)", _whole(0)),
}


def variable(field: str) -> str:
    """The environment variable behind a :class:`Settings` field."""
    return PREFIX + _FIELDS[field][0]


def _parse(field: str, raw: str):
    name, kind = _FIELDS[field]
    var = PREFIX + name
    if kind in ("text", "path"):
        return raw
    if kind == "json_object":
        try:
            ok = isinstance(json.loads(raw), dict)
        except ValueError:
            ok = False
        if not ok:
            raise OptionError(f"${var}={raw!r}: expected a JSON object (fsspec options for every protocol, "
                              '{"anon": true}, or per protocol, {"s3": {"endpoint_url": "..."}}). Set it so, '
                              "or unset it for the default.")
        return raw
    if kind in ("flag", "flag_on", "flag_auto"):
        low = raw.lower()
        if low in _TRUE or low in _FALSE:
            return low in _TRUE
        if kind == "flag_auto" and low == "auto":
            return None
        also = " or auto" if kind == "flag_auto" else ""
        raise OptionError(f"${var}={raw!r}: expected 1 or 0 (also true/false, yes/no, on/off){also}. "
                          f"Set it to one of those, or unset it for the default.")
    what, ok = _KINDS[kind]
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (value == value and ok(value)):
        raise OptionError(f"${var}={raw!r}: expected {what}. Set it so, or unset it for the default.")
    return int(value) if kind.startswith("count") else value


# Which settings each user reads: a verb checks only the variables it uses, so a malformed
# object-store variable does not fail a load of local files (nor the index key lookup).
LOAD = ("arrival_timeout", "node", "shm", "shm_dir", "o_direct", "read_threads", "read_split_mb")
REMOTE = ("remote_concurrency", "remote_retries", "remote_backoff", "remote_part_mb", "storage_options")
INDEX = ("index_key",)


def from_env(environ: Optional[Mapping[str, str]] = None, *, only: Optional[Sequence[str]] = None) -> Settings:
    """(local, any rank) The settings the environment holds now; a variable set to nothing
    (or blanks) counts as unset. A malformed value is an :class:`OptionError` naming it.
    ``only``: read (and check) just these fields (:data:`LOAD`, :data:`REMOTE`,
    :data:`INDEX`); the others keep their defaults."""
    env = os.environ if environ is None else environ
    values = {}
    for field in (_FIELDS if only is None else only):
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
