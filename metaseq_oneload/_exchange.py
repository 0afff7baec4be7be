"""Read once, exchange: the ``parallel`` strategy.

When several ranks of a data-parallel group want the same bytes (``flat=False``: every rank
wants the whole model part; replicated tensors; a blind rank), reading them on each rank
costs the storage W times what the model weighs. Here every byte some rank wants is read by
exactly one rank that can see the files (a rank that wants it where one can, so its own
copy lands in place), chosen by a balance of bytes, and sent to the others point to point,
as Megatron-Core's fully parallel load and Orbax's single-replica restore do.

Node-aware: ranks are grouped by node (torchrun's ``GROUP_RANK``, else the host name). A
piece travels to another node once, to one rank of it (the relay), which hands it to the
node's other ranks; so every node receives each byte it needs at most once over the network.
Files seen by only some nodes (node-local disks) are read by the ranks that see them. Where
nodes have copies of their own (a local disk each, checked: ``private_nodes``), each reads its
own: the cluster's one read is for storage the nodes share (a network filesystem, an object
store), and a local read beats the network.

The plan is a pure function of what every rank gathered (wants, readers, nodes), computed
alike on every rank, so every rank posts matching sends and receives in one order. Reads go
in rounds of at most one chunk per reader (``bucket_bytes / readers`` each): a round's reads
run on all readers at once, then its messages. Peak extra memory per rank: its outputs plus
at most one bucket of staging (a read chunk that does not land in place, and received spans
that do not).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import socket
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from ._dist import Group
from ._errors import cap_list
from ._reading import direct_by_default
from ._storage import is_url

logger = logging.getLogger("metaseq_oneload")

__all__ = ["node_key", "page_cache_view", "cached_nodes", "private_nodes", "ExchangePlan", "plan_exchange",
           "exchange_loop", "overlap", "chunk_bytes_for"]


def node_key() -> str:
    """(local) Which node this process runs on, as the other ranks will compare it:
    ``$METASEQ_ONELOAD_NODE`` if set, else torchrun's node rank (``GROUP_RANK``, which also
    tells apart two agents started on one host), else the host name."""
    explicit = os.environ.get("METASEQ_ONELOAD_NODE")
    if explicit:
        return explicit
    group = os.environ.get("GROUP_RANK")
    if group is not None and os.environ.get("LOCAL_WORLD_SIZE"):
        return f"{socket.gethostname()}/node{group}"
    return socket.gethostname()


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
        direct = direct_by_default()
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


def private_nodes(views: Sequence[Mapping], nodes: Sequence[str], readers: Sequence[int]) -> frozenset:
    """(local, the same on every rank) Node keys whose every reader sees the files on storage
    of its node's own (``page_cache_view``'s ``private``), where there is more than one
    node: each of them reads what its ranks want from its own copy rather than over the
    network from another node's."""
    if len(set(nodes)) < 2:
        return frozenset()
    readers = set(readers)
    out = set()
    for key in dict.fromkeys(nodes):
        mine = [r for r, n in enumerate(nodes) if n == key and r in readers]
        if mine and all(views[r].get("private") for r in mine):
            out.add(key)
    return frozenset(out)


def cached_nodes(views: Sequence[Mapping], nodes: Sequence[str], readers: Sequence[int],
                 ranges: Sequence[Mapping], itemsizes: Mapping[str, int]) -> tuple:
    """(local, the same on every rank) (node keys whose ranks may each read their own wants,
    why the others may not). A node qualifies when every reader of it reads the same files
    (the same inodes) through the page cache and the least memory one of them reports holds
    the node's outputs plus one copy of what they want (so the cached pages survive until
    the last rank has read them)."""
    readers = set(readers)
    out, notes = set(), []
    for key in dict.fromkeys(nodes):
        members = [r for r, n in enumerate(nodes) if n == key]
        mine = [r for r in members if r in readers]
        if len(mine) < 2:
            continue  # nothing to share on this node
        odd = [r for r in mine if not views[r].get("shared")]
        if odd:
            notes.append(f"node {key}: {views[odd[0]].get('why') or 'no page cache'}")
            continue
        if len({views[r].get("files", "") for r in mine}) > 1:
            notes.append(f"node {key}: its ranks read different copies of the files (ranks {cap_list(mine)}), "
                         "whose pages they do not share")
            continue
        wanted, union = overlap([ranges[r] for r in members], itemsizes)
        known = [int(views[r].get("avail", -1)) for r in mine if int(views[r].get("avail", -1)) >= 0]
        avail = min(known, default=-1)
        if avail >= 0 and avail < wanted + union:
            notes.append(f"node {key}: {avail / 2**30:.1f} GiB free for {(wanted + union) / 2**30:.1f} GiB of "
                         "outputs and cached pages")
            continue
        out.add(key)
    return frozenset(out), notes


@dataclass(frozen=True)
class Message:
    """One send: elements ``lo..hi`` of target ``name`` from local rank ``src`` to ``dst``.
    ``phase`` 1 leaves the reader; phase 2 leaves a relay for its node's other ranks."""

    phase: int
    src: int
    dst: int
    lo: int
    hi: int


@dataclass(frozen=True)
class Chunk:
    """Elements ``lo..hi`` of target ``name``, read by local rank ``owner``; ``spans[r]``
    is the range rank ``r`` holds once the chunk's messages are done (its wants' extent
    inside the chunk, or a relay's node's extent)."""

    name: str
    lo: int
    hi: int
    owner: int
    messages: tuple
    spans: tuple  # ((rank, lo, hi), ...)
    # Ranks of the owner's node that read their own span through the page cache the owner's
    # read filled: a memory copy, where a message would cost two.
    self_read: tuple = ()

    def span_of(self, rank: int) -> Optional[tuple]:
        for r, lo, hi in self.spans:
            if r == rank:
                return lo, hi
        return None


@dataclass(frozen=True)
class ExchangePlan:
    rounds: tuple  # of tuples of Chunk
    read_bytes: tuple  # per local rank: what it reads (from storage, or its node's page cache)
    remote_bytes: tuple  # per node index: what the node receives from other nodes
    node_of: tuple  # per local rank: the index of its node
    itemsizes: Mapping  # target name -> bytes per element
    storage_bytes: tuple = ()  # per node index: what the node pulls from storage
    private: tuple = ()  # node indices that read their own copy (``plan_exchange``'s ``private``)

    @property
    def moves(self) -> bool:
        """Whether any bytes travel between ranks (else every rank just reads its own)."""
        return any(c.messages for rnd in self.rounds for c in rnd)


def _merged(intervals: list) -> list:
    out: list = []
    for lo, hi in sorted(intervals):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return out


def overlap(ranges: Sequence[Mapping], itemsizes: Mapping[str, int]) -> tuple:
    """(bytes wanted summed over ranks, bytes of their union): how much reading each
    rank's own wants would read more than once."""
    total, per = 0, {}
    for rr in ranges:
        for name, items in rr.items():
            for _, start, stop, _, _ in items:
                total += (stop - start) * itemsizes[name]
                per.setdefault(name, []).append((start, stop))
    union = sum((hi - lo) * itemsizes[name] for name, iv in per.items() for lo, hi in _merged(iv))
    return total, union


def plan_exchange(order: Sequence[str], itemsizes: Mapping[str, int], ranges: Sequence[Mapping],
                  readers: Sequence[int], nodes: Sequence[str], chunk_bytes: int,
                  cached: frozenset = frozenset(), private: frozenset = frozenset()) -> ExchangePlan:
    """(local, identical on every rank) Who reads which chunk and who sends what to whom.

    ``order``: target names in the one order every rank walks; ``ranges[r]``: rank r's wants
    as ``{name: [[name, start, stop, dtype, k], ...]}``; ``readers``: the local ranks that
    see the files; ``nodes[r]``: rank r's node key; ``cached``: node keys whose ranks share
    a page cache over the files (``cached_nodes``). On such a node, every reader that wants
    a chunk the node reads reads its own span: the storage serves the node once, the
    repeats are copies out of the cache, and nothing travels inside the node but what
    blind ranks want. ``private``: node keys with a copy of the files on storage of their
    own (``private_nodes``): such a node reads whatever its ranks want from its copy, and
    nothing crosses into it; it also serves nodes that can read nothing themselves.
    """
    if not readers:
        raise ValueError("no rank can read the files")
    world = len(ranges)
    node_ids = {n: i for i, n in enumerate(dict.fromkeys(nodes))}
    node_of = [node_ids[n] for n in nodes]
    wanted: dict = {}
    for r, rr in enumerate(ranges):
        for name, items in rr.items():
            for _, start, stop, _, _ in items:
                if stop > start:
                    wanted.setdefault(name, []).append((start, stop, r))
    per_owner: dict = {r: [] for r in readers}
    read_bytes = [0] * world
    remote = [0] * len(node_ids)
    storage = [0] * len(node_ids)
    is_reader = set(readers)
    cached_ids = {node_ids[k] for k in cached if k in node_ids}
    private_ids = {node_ids[k] for k in private if k in node_ids} & {node_of[r] for r in readers}
    # Who reads for whom: a private node for its own ranks; everyone else (nodes on shared
    # storage, nodes that see nothing) from the readers outside the private nodes, or, where
    # there are none, from a private node that reads the piece anyway.
    domain_readers: dict = {d: [r for r in readers if node_of[r] == d] for d in private_ids}
    domain_readers[None] = [r for r in readers if node_of[r] not in private_ids]
    served = dict.fromkeys(private_ids, 0)  # bytes a private node has read for others
    todo = []  # (name, itemsize, lo, hi, [(domain, {rank: its span}), ...]) in the order every rank walks
    for name in order:
        items = wanted.get(name)
        if not items:
            continue
        size = itemsizes[name]
        per = max(1, chunk_bytes // size)
        # Cut where any rank's wants start or stop: within a piece the same ranks want every
        # byte, so disjoint wants stay with their owners and nothing moves.
        cuts = sorted({x for a, b, _ in items for x in (a, b)})
        pieces = [(x, y) for x, y in zip(cuts, cuts[1:]) if any(a <= x and y <= b for a, b, _ in items)]
        for lo0, hi0 in pieces:
            for lo in range(lo0, hi0, per):
                hi = min(hi0, lo + per)
                groups: dict = {}
                for a, b, r in items:
                    x, y = max(a, lo), min(b, hi)
                    if x < y:
                        g = groups.setdefault(node_of[r] if node_of[r] in private_ids else None, {})
                        s = g.get(r)
                        g[r] = (x, y) if s is None else (min(s[0], x), max(s[1], y))
                rest = groups.pop(None, None)
                subs = sorted(groups.items())
                if rest:
                    if domain_readers[None] or not subs:
                        subs.append((None, rest))
                    else:  # the private node that has served them least so far
                        k = min(range(len(subs)), key=lambda i: (served[subs[i][0]], i))
                        served[subs[k][0]] += (hi - lo) * size * len(rest)
                        subs[k] = (subs[k][0], {**subs[k][1], **rest})
                todo.append((name, size, lo, hi, subs))
    # Readers take contiguous runs, in node order: the k-th of n readers the k-th n-th of the
    # bytes (of what their domain reads). Interleaved chunks would each be fetched with their
    # neighbours by the kernel's read-ahead (8 MiB on a virtio disk, more on network
    # filesystems), so a node pulling every other tensor would pull nearly all of them.
    total: dict = {}
    for _, size, lo, hi, subs in todo:
        for d, _ in subs:
            total[d] = total.get(d, 0) + (hi - lo) * size
    at = dict.fromkeys(total, 0)
    for name, size, lo, hi, subs in todo:
        nbytes = (hi - lo) * size
        for d, spans in subs:
            pool = domain_readers[d] or list(readers)
            ordered = sorted(pool, key=lambda r: (node_of[r], r))
            turn = ordered[min(len(ordered) - 1, (at[d] + nbytes // 2) * len(ordered) // max(1, total[d]))]
            at[d] += nbytes
            # A reader that wants the chunk reads it (its copy lands in place): the one whose
            # turn it is, else the one with the fewest bytes so far (balanced by what each node
            # pulls from storage, where nodes share a page cache).
            cands = [r for r in pool if r in spans] or pool
            owner = turn if turn in cands else min(
                cands, key=lambda r: (storage[node_of[r]] if cached_ids else 0, read_bytes[r], r))
            read_bytes[owner] += nbytes
            messages, held = [], dict(spans)
            home = node_of[owner]
            storage[home] += nbytes
            self_read = ()
            if home in cached_ids:
                self_read = tuple(r for r in sorted(spans) if r != owner and r in is_reader and node_of[r] == home)
                for r in self_read:
                    read_bytes[r] += (spans[r][1] - spans[r][0]) * size
            by_node: dict = {}
            for r in sorted(spans):
                if r != owner and r not in self_read:
                    by_node.setdefault(node_of[r], []).append(r)
            for nd, members in by_node.items():
                if nd == home or len(members) == 1:
                    for r in members:
                        messages.append(Message(1, owner, r, *spans[r]))
                        if nd != home:
                            remote[nd] += (spans[r][1] - spans[r][0]) * size
                    continue
                # Another node with several takers: the chunk crosses once, to a relay.
                relay = members[0]
                x = min(spans[r][0] for r in members)
                y = max(spans[r][1] for r in members)
                held[relay] = (x, y)
                messages.append(Message(1, owner, relay, x, y))
                remote[nd] += (y - x) * size
                for r in members[1:]:
                    messages.append(Message(2, relay, r, *spans[r]))
            held.setdefault(owner, (lo, hi))
            per_owner[owner].append(Chunk(name, lo, hi, owner, tuple(messages),
                                          tuple(sorted((r, a, b) for r, (a, b) in held.items())), self_read))
    # A round takes from each reader its next chunks up to ``chunk_bytes``: small tensors
    # share a round, so a model of many small tensors does not pay a collective for each.
    batches: dict = {}
    for r, chunks in per_owner.items():
        out, cur, used = [], [], 0
        for c in chunks:
            nbytes = (c.hi - c.lo) * itemsizes[c.name]
            if cur and used + nbytes > chunk_bytes:
                out.append(cur)
                cur, used = [], 0
            cur.append(c)
            used += nbytes
        if cur:
            out.append(cur)
        batches[r] = out
    longest = max((len(v) for v in batches.values()), default=0)
    rounds = tuple(tuple(c for r in readers if j < len(batches[r]) for c in batches[r][j]) for j in range(longest))
    return ExchangePlan(rounds, tuple(read_bytes), tuple(remote), tuple(node_of), dict(itemsizes), tuple(storage),
                        tuple(sorted(private_ids)))


def _in_place(wants: Sequence, lo: int, hi: int, dtype: torch.dtype, device: torch.device) -> Optional[torch.Tensor]:
    """The slice of one want's output that is exactly elements ``lo..hi``, if it can take
    the bytes as they travel (same dtype, contiguous, on the group's device)."""
    for w in wants:
        if w.start <= lo and hi <= w.stop:
            out = w.out[lo - w.start: hi - w.start]
            if out.dtype == dtype and out.device == device and out.is_contiguous():
                return out
    return None


def chunk_bytes_for(bucket_bytes: int, readers: int) -> int:
    """A reader's share of a round: a round's chunks, double-buffered in shared memory
    where ranks of a node share them, come to at most one bucket."""
    return max(_ALIGN, bucket_bytes // (2 * max(1, readers)))


_ALIGN = 64


def _shared_slots(plan: ExchangePlan, world: int) -> tuple:
    """Where each rank keeps, in its shared-memory segment, what it hands to ranks of its
    own node: ({(round, chunk index, rank): byte offset in that rank's slot}, slot bytes
    per rank). Every rank computes the same from the plan."""
    node_of, sizes = plan.node_of, plan.itemsizes
    where: dict = {}
    slot = [0] * world
    for j, rnd in enumerate(plan.rounds):
        used = [0] * world
        for c_i, c in enumerate(rnd):
            for r in range(world):
                local = [m for m in c.messages if m.src == r and node_of[m.dst] == node_of[r]]
                if not local:
                    continue
                span = (c.lo, c.hi) if c.owner == r else c.span_of(r)
                where[(j, c_i, r)] = used[r]
                used[r] += -(-((span[1] - span[0]) * sizes[c.name]) // _ALIGN) * _ALIGN
        slot = [max(a, b) for a, b in zip(slot, used)]
    return where, slot


class _Segments:
    """(all ranks of the group) One shared-memory file per rank that hands bytes to ranks of
    its node, in ``/dev/shm``, two slots (rounds alternate, so a rank fills the next while
    its neighbours still copy the last), mapped by those ranks and unlinked once all have
    mapped it: nothing is left behind, whatever happens after."""

    def __init__(self, dp: Group, slot: Sequence[int], node_of: Sequence[int]):
        self.maps: dict = {}
        self.slot = slot
        me = dp.rank
        token = dp.broadcast_bytes(os.urandom(8).hex().encode() if me == 0 else None).decode()
        base = os.environ.get("METASEQ_ONELOAD_SHM_DIR", "/dev/shm")
        path = os.path.join(base, f"oneload-{token}-{me}")
        error = None
        try:
            if slot[me]:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    os.ftruncate(fd, 2 * slot[me])
                finally:
                    os.close(fd)
        except OSError as e:
            error = e
        try:  # a lost rank raises in a collective here: the file goes all the same
            ok = not dp.all_max(0 if error is None else 1)
            try:
                if ok:
                    for r, n in enumerate(slot):
                        if n and node_of[r] == node_of[me]:
                            self.maps[r] = torch.from_file(os.path.join(base, f"oneload-{token}-{r}"),
                                                           shared=True, size=2 * n, dtype=torch.uint8)
            except Exception as e:  # noqa: BLE001  (a node whose /dev/shm is not shared: fall back)
                error = error or e
            self.ok = not dp.all_max(0 if (error is None and ok) else 1)
        finally:
            if slot[me]:
                with contextlib.suppress(OSError):
                    os.unlink(path)
        if not self.ok:
            self.maps.clear()
            logger.debug("oneload: no shared memory between the ranks of a node (%s); sending through the "
                         "process group", error)

    def view(self, rank: int, j: int, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        start = (j % 2) * self.slot[rank] + offset
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        return self.maps[rank][start: start + nbytes].view(dtype)


_COPY_PIECE = 8 << 20
_copiers: dict = {}  # pid -> pool: a forked child makes its own


def _copy_all(pairs: Sequence, threads: int) -> None:
    """(local) ``dst.copy_(src)`` for every pair, large copies cut in pieces that run on a
    few threads (a copy releases the GIL): a memory copy on one thread is slower than the
    reader's parallel ``preadv`` of the same bytes out of the page cache."""
    pieces = []
    for dst, src in pairs:
        n = dst.numel()
        step = max(1, _COPY_PIECE // max(1, dst.element_size()))
        pieces += [(dst[i: i + step], src[i: i + step]) for i in range(0, n, step)]
    if threads <= 1 or len(pieces) <= 1:
        for dst, src in pieces:
            dst.copy_(src)
        return
    pool = _copiers.get(os.getpid())
    if pool is None:
        from concurrent.futures import ThreadPoolExecutor

        pool = _copiers[os.getpid()] = ThreadPoolExecutor(threads, thread_name_prefix="oneload-copy")
    for f in [pool.submit(dst.copy_, src) for dst, src in pieces]:
        f.result()


def exchange_loop(dp: Group, plan: ExchangePlan, targets: Mapping, wants: Sequence, reader,
                  fill: Callable, progress) -> tuple:
    """(collective over ``dp``) Carry out ``plan``. Returns (this rank's error or None,
    stats: bytes received, of them from other nodes, bytes sent). Never raises: the caller
    settles, so every rank leaves after the same collectives.

    Between nodes, pieces travel as point-to-point messages of the process group. Within a
    node they go through shared memory: the sender holds them in its segment, and its
    neighbours copy them straight into their tensors once a collective says they are there
    (the round's check that every read succeeded, and one more before relayed pieces)."""
    me = dp.rank
    threads = min(4, getattr(reader, "read_threads", 1)) if reader is not None else 1
    by_name: dict = {}
    for w in wants:
        by_name.setdefault(w.name, []).append(w)
    stats = {"received": 0, "from_other_nodes": 0, "sent": 0}
    error: Optional[BaseException] = None
    step = dp.step
    node_of, sizes = plan.node_of, plan.itemsizes
    where, slot = _shared_slots(plan, dp.size)
    shared = None
    # Shared memory is host memory: for a CUDA group (NCCL) the pieces stay on the device.
    if any(slot) and dp.device.type == "cpu" and os.environ.get("METASEQ_ONELOAD_SHM", "1") != "0":
        dp.at(f"{step} (mapping shared memory)")
        shared = _Segments(dp, slot, node_of)  # a lost rank raises, as every collective here
        if not shared.ok:
            shared = None

    if (reader is not None and node_of[me] not in plan.private
            and sum(1 for i, b in enumerate(plan.storage_bytes) if b and i not in plan.private) > 1):
        reader.set_readahead(False)  # the nodes read disjoint runs of one storage's files

    def read_round(j: int) -> tuple:
        """This rank's reads of round ``j`` into where its span of each chunk lives:
        (held, error). Runs on the reading thread while round ``j - 1``'s messages travel."""
        held: dict = {}  # chunk index -> (lo, tensor holding this rank's span of the chunk)
        try:
            for c_i, c in enumerate(plan.rounds[j]):
                t = targets[c.name]
                span = (c.lo, c.hi) if c.owner == me else c.span_of(me)
                if span is None:
                    continue
                if shared is not None and (j, c_i, me) in where:
                    buf = shared.view(me, j, where[(j, c_i, me)], span[1] - span[0], t.dtype)
                else:
                    buf = _in_place(by_name.get(c.name, ()), span[0], span[1], t.dtype, dp.device)
                    if buf is None:
                        buf = torch.empty(span[1] - span[0], dtype=t.dtype, device=dp.device)
                if c.owner == me or me in c.self_read:
                    fill(t, buf, span[0], reader)
                held[c_i] = (span[0], buf)
        except Exception as exc:  # a read or an allocation: said before anyone sends
            return held, exc
        return held, None

    def deliver(j: int, rnd: tuple, held: dict) -> Optional[BaseException]:
        """This rank's messages and copies of round ``j``, then its wants' copies out of
        staging. Its buffers die with it: what outlives a round is the next round's reads."""
        error = None
        with dp.guard():  # a lost rank raises: nothing more can be sent
            for phase in (1, 2):
                if phase == 2 and shared is not None and any(m.phase == 2 for c in rnd for m in c.messages):
                    dp.all_max(0)  # the relays hold what crossed between nodes
                handles, tag, copies = [], 0, []
                for c_i, c in enumerate(rnd):
                    for m in c.messages:
                        tag += 1  # the message's place in the round: the same on every rank
                        if m.phase != phase or me not in (m.src, m.dst):
                            continue
                        lo, buf = held[c_i]
                        view = buf[m.lo - lo: m.hi - lo]
                        nbytes = view.numel() * view.element_size()
                        if m.src == me:
                            stats["sent"] += nbytes
                        else:
                            stats["received"] += nbytes
                            if node_of[m.src] != node_of[me]:
                                stats["from_other_nodes"] += nbytes
                        if shared is not None and node_of[m.src] == node_of[m.dst]:
                            if m.dst == me:
                                src_lo = c.lo if c.owner == m.src else c.span_of(m.src)[0]
                                src = shared.view(m.src, j, where[(j, c_i, m.src)] + (m.lo - src_lo) * sizes[c.name],
                                                  m.hi - m.lo, view.dtype)
                                copies.append((view, src))
                            continue
                        if m.src == me:
                            handles.append(dist.isend(view, dst=dp.global_of(m.dst), group=dp.group, tag=tag))
                        else:
                            handles.append(dist.irecv(view, src=dp.global_of(m.src), group=dp.group, tag=tag))
                _copy_all(copies, threads)  # while the messages between nodes travel
                dp.wait_all(handles)
        try:
            got, pairs = 0, []
            for c_i, c in enumerate(rnd):
                if c_i not in held:
                    continue
                lo, buf = held[c_i]
                for w in by_name.get(c.name, ()):
                    a, b = max(w.start, lo), min(w.stop, lo + buf.numel())
                    if a < b:
                        dst, src = w.out[a - w.start: b - w.start], buf[a - lo: b - lo]
                        if dst.data_ptr() != src.data_ptr() or dst.dtype != src.dtype:
                            pairs.append((dst, src))  # landed in staging, or a second want of the same bytes
                        got += (b - a) * dst.element_size()
            _copy_all(pairs, threads)
            if progress and got:
                progress(got)
        except Exception as exc:
            error = exc
        return error

    # Reads of the next round overlap this round's messages and copies: its shared slot is
    # the one every rank finished with before this round's check, and its staging with this
    # round's comes to one bucket (a round's chunks are half of one).
    from concurrent.futures import ThreadPoolExecutor

    ahead = ThreadPoolExecutor(1, thread_name_prefix="oneload-readahead") if len(plan.rounds) > 1 else None
    pending = None
    try:
        for j, rnd in enumerate(plan.rounds):
            dp.at(f"{step} (parallel read, round {j + 1} of {len(plan.rounds)})")
            # (an error of the last round's copies is said at this round's check below)
            held, exc = pending.result() if pending is not None else read_round(j)
            pending = None
            error = error or exc
            # Only if every rank read and made room does anyone send (and the readers' shared
            # segments hold this round's bytes once everyone is past this point).
            if dp.all_max(0 if error is None else 1):
                break
            if ahead is not None and j + 1 < len(plan.rounds):
                pending = ahead.submit(read_round, j + 1)
            error = deliver(j, rnd, held)
            held = None
    finally:
        if pending is not None:
            pending.result()  # never leave a thread writing into tensors the caller owns
        if ahead is not None:
            ahead.shutdown(wait=True)
    return error, stats

