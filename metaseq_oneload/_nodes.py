"""What one rank knows of its node and tells the others: which node it runs on
(:func:`node_key`) and how it sees the checkpoint's files (:func:`page_cache_view`: through a
page cache its node's ranks share, on a disk of the node's own, with how much memory left).
The planner decides from what every rank reported (``_exchange.cached_nodes``,
``private_nodes``); nothing here talks to other ranks.
"""

from __future__ import annotations

import hashlib
import os
import socket
from typing import Optional, Sequence

from ._settings import from_env
from ._storage import is_url

__all__ = ["node_key", "page_cache_view", "launched_alone", "LOCAL_SIZES"]


def node_key(explicit: Optional[str] = None) -> str:
    """(local) Which node this process runs on, as the other ranks will compare it:
    ``explicit`` (the settings' ``node``, ``$METASEQ_ONELOAD_NODE``) if set, else torchrun's
    node rank (``GROUP_RANK``, which also tells apart two agents started on one host), else
    the host name. (torchrun's variables describe the process, not a setting of ours.)"""
    if explicit:
        return explicit
    group = os.environ.get("GROUP_RANK")
    if group is not None and os.environ.get("LOCAL_WORLD_SIZE"):
        return f"{socket.gethostname()}/node{group}"
    return socket.gethostname()


# How many processes a launcher started on this host: torchrun, DeepSpeed, Horovod, Open MPI,
# MPICH/Intel MPI, MVAPICH2, Cray PALS and PMI, IBM jsrun, srun's step; then Slurm's
# allocation (--ntasks-per-node; its tasks per node), which says what may run, not what did.
LAUNCHED_SIZES = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "HOROVOD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE",
                  "MPI_LOCALNRANKS", "MV2_COMM_WORLD_LOCAL_SIZE", "PALS_LOCAL_SIZE", "PMI_LOCAL_SIZE",
                  "JSM_NAMESPACE_LOCAL_SIZE", "SLURM_STEP_TASKS_PER_NODE")
ALLOCATED_SIZES = ("SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
LOCAL_SIZES = LAUNCHED_SIZES + ALLOCATED_SIZES


def _counts(raw: Optional[str]) -> list:
    # Slurm writes "4", or for uneven nodes "1(x2),3" (the same text on every node): any count
    # above 1 may be this node's
    out = []
    for part in (raw or "").split(","):
        part = part.split("(")[0].strip()
        if part:
            out.append(int(part) if part.isdigit() else 2)  # (unreadable: as if several)
    return out


def launched_alone() -> bool:
    """(local) Whether no launcher says it started other processes on this host beside this
    one (:data:`LOCAL_SIZES`; where no launcher's local count says 1, a ``WORLD_SIZE`` above 1
    counts too, as a launcher may have put its processes anywhere): where one did, each may be
    loading the same files "alone" (``no_dist=True``, no process group), and a page cache they
    share must stay theirs to share. A launcher this does not know errs towards "alone": the
    reads then choose ``O_DIRECT`` per piece, still correct bytes."""
    if any(n > 1 for v in LOCAL_SIZES for n in _counts(os.environ.get(v))):
        return False
    if any(_counts(os.environ.get(v)) == [1] for v in LAUNCHED_SIZES):
        return True
    return all(n <= 1 for n in _counts(os.environ.get("WORLD_SIZE")))


# Filesystems whose reads go through the kernel's page cache, which every process of a host
# shares: a second rank's read of bytes a neighbour read is a memory copy, not a storage
# read. FUSE mounts are left out (many, such as mountpoint-s3 and gcsfuse by default, serve
# every read from the remote store), as is anything not named here.
_CACHED_FS = frozenset({
    "ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "jfs", "reiserfs", "tmpfs", "ramfs", "overlay",
    "squashfs", "nfs", "nfs4", "lustre", "gpfs", "beegfs", "ceph", "cephfs", "wekafs",
})


# Filesystems whose bytes live on the node itself (its disks, its memory): another node's copy
# of the files is other storage, and this node reading its own copy takes nothing from it.
# Network filesystems, FUSE (object stores, gcsfuse, JuiceFS...) and anything not named here
# may be one storage behind every node: there, every byte is read once per cluster.
_PRIVATE_FS = frozenset({
    "ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "jfs", "reiserfs", "tmpfs", "ramfs", "overlay",
    "squashfs",
})


def _fs_type(path: str) -> Optional[str]:
    """The type of the filesystem ``path`` lies on, from /proc/self/mountinfo (the longest
    mount point above it); None where that cannot be read."""
    try:
        real = os.path.realpath(path)
        best, kind = "", None
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields = left.split()
                if len(fields) < 5 or not right:
                    continue
                mnt = fields[4].replace("\\040", " ").replace("\\011", "\t").replace("\\134", "\\")
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, kind = mnt, right.split()[0]
        return kind
    except OSError:
        return None


def _cgroup_room() -> Optional[int]:
    """Bytes this process's memory cgroup can still take (its limit less what it holds but
    cannot reclaim: usage less file pages), or None without a limit. cgroup v2, else v1;
    this process's own cgroup (``/proc/self/cgroup``), else the mount's root."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = [ln.strip().split(":", 2) for ln in f if ln.count(":") >= 2]
    except OSError:
        lines = []
    v2 = next((p for h, c, p in lines if h == "0" and c == ""), "/")
    v1 = next((p for h, c, p in lines if "memory" in c.split(",")), "/")
    for base, limit_f, usage_f, cache_key in (
            (f"/sys/fs/cgroup{v2.rstrip('/')}", "memory.max", "memory.current", "file"),
            ("/sys/fs/cgroup", "memory.max", "memory.current", "file"),
            (f"/sys/fs/cgroup/memory{v1.rstrip('/')}", "memory.limit_in_bytes", "memory.usage_in_bytes", "total_cache"),
            ("/sys/fs/cgroup/memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "total_cache")):
        try:
            with open(os.path.join(base, limit_f)) as f:
                limit = f.read().strip()
            with open(os.path.join(base, usage_f)) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if not limit.isdigit() or int(limit) >= (1 << 60):
            return None  # no limit here
        cached = 0
        try:  # page cache counts in the usage but is reclaimed before the limit bites
            with open(os.path.join(base, "memory.stat")) as f:
                for line in f:
                    k, _, v = line.partition(" ")
                    if k == cache_key:
                        cached = int(v)
        except (OSError, ValueError):
            pass
        return max(0, int(limit) - usage + cached)
    return None


def _available_memory() -> Optional[int]:
    """Bytes this process could still fill with page cache and outputs: the kernel's
    MemAvailable, capped by what its cgroup can still take."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    room = _cgroup_room()
    if room is not None:
        avail = room if avail is None else min(avail, room)
    return avail


def page_cache_view(paths: Sequence[str], direct: Optional[bool] = None) -> dict:
    """(local) What this rank tells the others about its reads of ``paths``: whether they go
    through its host's page cache (``shared``, with ``why`` not), whether the files lie on
    storage of this node's own (``private``: a local disk or memory filesystem, named in
    ``fs``), and the memory left for the page cache (``avail``, bytes, -1 unknown). JSON,
    for the gathered rank descriptions. ``direct``: whether the reads use ``O_DIRECT``
    (default: as a RangeReader decides)."""
    if direct is None:
        direct = from_env(only=("o_direct",)).o_direct
    avail = _available_memory()
    view = {"shared": False, "why": "", "avail": -1 if avail is None else avail, "private": False, "fs": ""}
    if any(is_url(p) for p in paths):
        view["why"], view["fs"] = "object storage has no page cache", "object storage"
        return view
    kinds = {}
    for p in paths:
        d = os.path.dirname(os.path.abspath(p))
        if d not in kinds:
            kinds[d] = _fs_type(d)
    names = sorted({str(k) for k in kinds.values()})
    view["fs"] = ", ".join(names)
    view["files"] = _identity(paths)
    view["private"] = bool(kinds) and all(k in _PRIVATE_FS for k in kinds.values())
    if direct:
        view["why"] = "reads bypass the page cache (O_DIRECT)"
        return view
    odd = [k for k in names if k not in _CACHED_FS]
    if odd or not kinds:
        view["why"] = f"the files lie on {', '.join(odd) or 'no'} filesystem(s), whose reads may not be cached"
        return view
    view["shared"] = True
    return view


def _identity(paths: Sequence[str]) -> str:
    """Which files these are, as the kernel knows them (device and inode, size and time):
    ranks of a node that read different copies of a checkpoint share no cached pages."""
    h = hashlib.sha1()
    for p in sorted(paths):
        try:
            st = os.stat(p)
            h.update(f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns};".encode())
        except OSError:
            h.update(f"?{p};".encode())
    return h.hexdigest()[:16]
