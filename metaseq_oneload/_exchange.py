"""Read once, exchange: the ``parallel`` strategy.

When several ranks of a data-parallel group want the same bytes (``flat=False``: every rank
wants the whole model part; replicated tensors; a blind rank), reading them on each rank
costs the storage W times what the model weighs. Here every byte some rank wants is read by
exactly one rank that can see the files (a rank that wants it where one can, so its own
copy lands in place), chosen by a balance of bytes, and sent to the others point to point,
as Megatron-Core's fully parallel load and Orbax's single-replica restore do.

Node-aware: ranks are grouped by node (``_nodes.node_key``), each reporting how it sees the
files (``_nodes.page_cache_view``). A
piece travels to another node once, to one rank of it (the relay), which hands it to the
node's other ranks; so every node receives each byte it needs at most once over the network.
Files seen by only some nodes (node-local disks) are read by the ranks that see them. Where
nodes have copies of their own (a local disk each, checked: ``private_nodes``), each reads its
own: the cluster's one read is for storage the nodes share (a network filesystem, an object
store), and a local read beats the network.

The plan is a pure function of what every rank gathered (wants, readers, nodes), computed
alike on every rank, so every rank posts matching sends and receives in one order. Reads go
in rounds of at most one chunk per reader (``chunk_bytes_for``: under half of
``bucket_bytes / readers``): a round's reads run on all readers at once, then its messages.
Peak extra memory per rank: its outputs, plus at most one bucket of staging (a read chunk
that does not land in place, and received spans that do not: none for CPU outputs of the
stored dtype), plus, where ranks of a node hand pieces over in shared memory, its own
segment (two slots of a round) and the few pieces it has mapped out of its neighbours'
(``_Segments``): one bucket summed over the node's ranks.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from ._dist import Group
from ._errors import cap_list
from ._pagecache import MADV_DONTNEED, MADV_POPULATE_READ, advise

logger = logging.getLogger("metaseq_oneload")

__all__ = ["cached_nodes", "private_nodes", "ExchangePlan", "plan_exchange",
           "exchange_loop", "overlap", "chunk_bytes_for", "merged", "shared_slots", "Chunk", "Message"]


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


def merged(intervals: list) -> list:
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
    union = sum((hi - lo) * itemsizes[name] for name, iv in per.items() for lo, hi in merged(iv))
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
    node_ids = {n: i for i, n in enumerate(dict.fromkeys(nodes))}
    node_of = [node_ids[n] for n in nodes]
    cached_ids = {node_ids[k] for k in cached if k in node_ids}
    private_ids = {node_ids[k] for k in private if k in node_ids} & {node_of[r] for r in readers}
    # Who reads for whom: a private node for its own ranks; everyone else (nodes on shared
    # storage, nodes that see nothing) from the readers outside the private nodes, or, where
    # there are none, from a private node that reads the piece anyway.
    domain_readers: dict = {d: [r for r in readers if node_of[r] == d] for d in private_ids}
    domain_readers[None] = [r for r in readers if node_of[r] not in private_ids]
    todo = _pieces(order, itemsizes, ranges, chunk_bytes, node_of, private_ids, bool(domain_readers[None]))
    routing = _Routing(len(ranges), len(node_ids), node_of, set(readers), cached_ids)
    per_owner = routing.assign(todo, readers, domain_readers)
    return ExchangePlan(_rounds(per_owner, readers, itemsizes, chunk_bytes), tuple(routing.read_bytes),
                        tuple(routing.remote), tuple(node_of), dict(itemsizes), tuple(routing.storage),
                        tuple(sorted(private_ids)))


def _pieces(order: Sequence[str], itemsizes: Mapping[str, int], ranges: Sequence[Mapping], chunk_bytes: int,
            node_of: Sequence[int], private_ids: set, shared_readers: bool) -> list:
    """(name, itemsize, lo, hi, [(domain, {rank: its span}), ...]) for every chunk some rank
    wants, in the order every rank walks; a domain is a private node (reading for its own
    ranks) or None (the readers outside them)."""
    wanted: dict = {}
    for r, rr in enumerate(ranges):
        for name, items in rr.items():
            for _, start, stop, _, _ in items:
                if stop > start:
                    wanted.setdefault(name, []).append((start, stop, r))
    served = dict.fromkeys(private_ids, 0)  # bytes a private node has read for others
    todo = []
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
                    if shared_readers or not subs:
                        subs.append((None, rest))
                    else:  # the private node that has served them least so far
                        k = min(range(len(subs)), key=lambda i: (served[subs[i][0]], i))
                        served[subs[k][0]] += (hi - lo) * size * len(rest)
                        subs[k] = (subs[k][0], {**subs[k][1], **rest})
                todo.append((name, size, lo, hi, subs))
    return todo


class _Routing:
    """Who reads each chunk and the messages that carry it on, with the bytes each rank reads,
    each node receives from others and pulls from storage, as the chunks are assigned."""

    def __init__(self, world: int, n_nodes: int, node_of: Sequence[int], readers: set, cached_ids: set):
        self.node_of, self.readers, self.cached_ids = node_of, readers, cached_ids
        self.read_bytes = [0] * world
        self.remote = [0] * n_nodes
        self.storage = [0] * n_nodes

    def assign(self, todo: list, readers: Sequence[int], domain_readers: Mapping) -> dict:
        """{reader: its chunks in order}. Readers take contiguous runs, in node order: the
        k-th of n readers the k-th n-th of the bytes (of what their domain reads). Interleaved
        chunks would each be fetched with their neighbours by the kernel's read-ahead (8 MiB
        on a virtio disk, more on network filesystems), so a node pulling every other tensor
        would pull nearly all of them."""
        node_of = self.node_of
        per_owner: dict = {r: [] for r in readers}
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
                    cands, key=lambda r: (self.storage[node_of[r]] if self.cached_ids else 0, self.read_bytes[r], r))
                per_owner[owner].append(self.chunk(name, size, lo, hi, owner, spans))
        return per_owner

    def chunk(self, name: str, size: int, lo: int, hi: int, owner: int, spans: Mapping) -> "Chunk":
        """The chunk ``owner`` reads, with its messages: to its own node's ranks directly, to
        another node once (to a relay that hands it on) where several there want it."""
        node_of = self.node_of
        self.read_bytes[owner] += (hi - lo) * size
        home = node_of[owner]
        self.storage[home] += (hi - lo) * size
        messages, held = [], dict(spans)
        self_read = ()
        if home in self.cached_ids:
            self_read = tuple(r for r in sorted(spans)
                              if r != owner and r in self.readers and node_of[r] == home)
            for r in self_read:
                self.read_bytes[r] += (spans[r][1] - spans[r][0]) * size
        by_node: dict = {}
        for r in sorted(spans):
            if r != owner and r not in self_read:
                by_node.setdefault(node_of[r], []).append(r)
        for nd, members in by_node.items():
            if nd == home or len(members) == 1:
                for r in members:
                    messages.append(Message(1, owner, r, *spans[r]))
                    if nd != home:
                        self.remote[nd] += (spans[r][1] - spans[r][0]) * size
                continue
            # Another node with several takers: the chunk crosses once, to a relay.
            relay = members[0]
            x = min(spans[r][0] for r in members)
            y = max(spans[r][1] for r in members)
            held[relay] = (x, y)
            messages.append(Message(1, owner, relay, x, y))
            self.remote[nd] += (y - x) * size
            for r in members[1:]:
                messages.append(Message(2, relay, r, *spans[r]))
        held.setdefault(owner, (lo, hi))
        return Chunk(name, lo, hi, owner, tuple(messages), tuple(sorted((r, a, b) for r, (a, b) in held.items())),
                     self_read)


def _rounds(per_owner: Mapping, readers: Sequence[int], itemsizes: Mapping[str, int], chunk_bytes: int) -> tuple:
    """A round takes from each reader its next chunks up to ``chunk_bytes``: small tensors
    share a round, so a model of many small tensors does not pay a collective for each."""
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
    return tuple(tuple(c for r in readers if j < len(batches[r]) for c in batches[r][j]) for j in range(longest))


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
    where ranks of a node share them, with the pieces each rank has mapped out of its
    neighbours' segments while it copies (``_copy_all``), come to at most one bucket."""
    share = bucket_bytes // max(1, readers)
    window = min(_COPY_THREADS * _LENT_PIECE, share // 4)
    return max(_ALIGN, (share - window) // 2 // _ALIGN * _ALIGN)


_ALIGN = 64


def shared_slots(plan: ExchangePlan, world: int) -> tuple:
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
    mapped it: nothing is left behind, whatever happens after.

    A segment's pages belong to its writer's memory. A neighbour copies out of its mapping a
    piece at a time and lets go of each piece's pages once copied (``MADV_DONTNEED``: the
    bytes stay in the segment), so a node's segments are held once, not once more in each
    rank that read them (a mapped page a process touched stays resident in it). A copy out
    of the mapping, not a ``preadv`` of the file: that would count every hand-over as a read
    (``rchar``), and the node reads each byte once."""

    def __init__(self, dp: Group, slot: Sequence[int], node_of: Sequence[int], base: str):
        self.maps: dict = {}
        self.slot = slot
        me = dp.rank
        token = dp.broadcast_bytes(os.urandom(8).hex().encode() if me == 0 else None).decode()
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


@dataclass(frozen=True)
class _Lent:
    """A neighbour's bytes in its mapped segment: copied out, then its pages let go."""

    tensor: torch.Tensor


_COPY_PIECE = 8 << 20
# A piece out of a neighbour's segment: at most (copy threads) x this is mapped in a rank at once.
_LENT_PIECE = 1 << 20
_COPY_THREADS = 4
_copiers: dict = {}  # pid -> pool: a forked child makes its own


def _madvise(t: torch.Tensor, advice: int) -> None:
    advise(t.data_ptr(), t.numel() * t.element_size(), advice)


def _copy_one(dst: torch.Tensor, src) -> None:
    if not isinstance(src, _Lent):
        dst.copy_(src)
        return
    _madvise(src.tensor, MADV_POPULATE_READ)  # one call maps the piece, not a fault per page
    dst.copy_(src.tensor)
    _madvise(src.tensor, MADV_DONTNEED)  # a shared mapping: only this rank's view goes


def _copy_all(pairs: Sequence, threads: int) -> None:
    """(local) ``dst.copy_(src)`` for every pair (``src`` a tensor, or a neighbour's
    ``_Lent`` bytes), large copies cut in pieces that run on a few threads (a copy releases
    the GIL): a memory copy on one thread is slower than the reader's parallel ``preadv`` of
    the same bytes out of the page cache."""
    pieces = []
    for dst, src in pairs:
        lent = isinstance(src, _Lent)
        n, size = dst.numel(), max(1, dst.element_size())
        step = max(1, (_LENT_PIECE if lent else _COPY_PIECE) // size)
        pieces += [(dst[i: i + step], _Lent(src.tensor[i: i + step]) if lent else src[i: i + step])
                   for i in range(0, n, step)]
    if threads <= 1 or len(pieces) <= 1:
        for dst, src in pieces:
            _copy_one(dst, src)
        return
    pool = _copiers.get(os.getpid())
    if pool is None:
        from concurrent.futures import ThreadPoolExecutor

        pool = _copiers[os.getpid()] = ThreadPoolExecutor(threads, thread_name_prefix="oneload-copy")
    for f in [pool.submit(_copy_one, dst, src) for dst, src in pieces]:
        f.result()


def exchange_loop(dp: Group, plan: ExchangePlan, targets: Mapping, wants: Sequence, reader,
                  fill: Callable, progress, shm_dir: Optional[str]) -> tuple:
    """(collective over ``dp``) Carry out ``plan``; pieces for ranks of one node go through
    shared memory in ``shm_dir`` (None: through the process group, as the plan says). Returns
    (this rank's error or None, stats: bytes received, of them from other nodes, bytes sent).
    Never raises: the caller settles, so every rank leaves after the same collectives.

    Between nodes, pieces travel as point-to-point messages of the process group. Within a
    node they go through shared memory: the sender holds them in its segment, and its
    neighbours copy them straight into their tensors once a collective says they are there
    (the round's check that every read succeeded, and one more before relayed pieces)."""
    run = _Exchange(dp, plan, targets, wants, reader, fill, progress, shm_dir)
    # Reads of the next round overlap this round's messages and copies: its shared slot is
    # the one every rank finished with before this round's check, and its staging with this
    # round's comes to one bucket (a round's chunks are half of one).
    from concurrent.futures import ThreadPoolExecutor

    ahead = ThreadPoolExecutor(1, thread_name_prefix="oneload-readahead") if len(plan.rounds) > 1 else None
    pending, error = None, None
    try:
        for j, rnd in enumerate(plan.rounds):
            dp.at(f"{run.step} (parallel read, round {j + 1} of {len(plan.rounds)})")
            # (an error of the last round's copies is said at this round's check below)
            held, exc = pending.result() if pending is not None else run.read_round(j)
            pending = None
            error = error or exc
            # Only if every rank read and made room does anyone send (and the readers' shared
            # segments hold this round's bytes once everyone is past this point).
            if dp.all_max(0 if error is None else 1):
                break
            if ahead is not None and j + 1 < len(plan.rounds):
                pending = ahead.submit(run.read_round, j + 1)
            error = run.deliver(j, rnd, held)
            held = None
    finally:
        if pending is not None:
            pending.result()  # never leave a thread writing into tensors the caller owns
        if ahead is not None:
            ahead.shutdown(wait=True)
    return error, run.stats


class _Exchange:
    """(all ranks of ``dp``) One rank's part in carrying out an exchange plan."""

    def __init__(self, dp: Group, plan: ExchangePlan, targets: Mapping, wants: Sequence, reader, fill: Callable,
                 progress, shm_dir: Optional[str]):
        self.dp, self.plan, self.targets, self.reader, self.fill, self.progress = (dp, plan, targets, reader, fill,
                                                                                   progress)
        self.me = dp.rank
        self.threads = min(_COPY_THREADS, getattr(reader, "read_threads", 1)) if reader is not None else 1
        self.by_name: dict = {}
        for w in wants:
            self.by_name.setdefault(w.name, []).append(w)
        self.stats = {"received": 0, "from_other_nodes": 0, "sent": 0}
        self.step = dp.step
        self.where, slot = shared_slots(plan, dp.size)
        self.shared = None
        if any(slot) and shm_dir is not None:
            dp.at(f"{self.step} (mapping shared memory)")
            self.shared = _Segments(dp, slot, plan.node_of, shm_dir)  # a lost rank raises, as every collective here
            # The plan's "shm" pieces go through the process group instead where a node's
            # segments cannot be mapped: the same pieces and rounds, decided alike on every
            # rank (``ok`` is agreed by a collective), only the carrier changes.
            if not self.shared.ok:
                self.shared = None
        if (reader is not None and plan.node_of[self.me] not in plan.private
                and sum(1 for i, b in enumerate(plan.storage_bytes) if b and i not in plan.private) > 1):
            reader.set_readahead(False)  # the nodes read disjoint runs of one storage's files

    def read_round(self, j: int) -> tuple:
        """This rank's reads of round ``j`` into where its span of each chunk lives:
        (held, error). Runs on the reading thread while round ``j - 1``'s messages travel."""
        me, dp = self.me, self.dp
        held: dict = {}  # chunk index -> (lo, tensor holding this rank's span of the chunk)
        try:
            for c_i, c in enumerate(self.plan.rounds[j]):
                t = self.targets[c.name]
                span = (c.lo, c.hi) if c.owner == me else c.span_of(me)
                if span is None:
                    continue
                if self.shared is not None and (j, c_i, me) in self.where:
                    buf = self.shared.view(me, j, self.where[(j, c_i, me)], span[1] - span[0], t.dtype)
                else:
                    buf = _in_place(self.by_name.get(c.name, ()), span[0], span[1], t.dtype, dp.device)
                    if buf is None:
                        buf = torch.empty(span[1] - span[0], dtype=t.dtype, device=dp.device)
                if c.owner == me or me in c.self_read:
                    self.fill(t, buf, span[0], self.reader)
                held[c_i] = (span[0], buf)
        except Exception as exc:  # a read or an allocation: said before anyone sends
            return held, exc
        return held, None

    def deliver(self, j: int, rnd: tuple, held: dict) -> Optional[BaseException]:
        """This rank's messages and copies of round ``j``, then its wants' copies out of
        staging. Its buffers die with it: what outlives a round is the next round's reads."""
        dp = self.dp
        with dp.guard():  # a lost rank raises: nothing more can be sent
            for phase in (1, 2):
                if phase == 2 and self.shared is not None and any(m.phase == 2 for c in rnd for m in c.messages):
                    dp.all_max(0)  # the relays hold what crossed between nodes
                handles, copies = self._phase(j, rnd, held, phase)
                _copy_all(copies, self.threads)  # while the messages between nodes travel
                dp.wait_all(handles)
        try:
            self._land(rnd, held)
        except Exception as exc:
            return exc
        return None

    def _phase(self, j: int, rnd: tuple, held: dict, phase: int) -> tuple:
        """Post this rank's messages of one phase: (handles, shared-memory copies to make)."""
        me, dp, node_of, sizes = self.me, self.dp, self.plan.node_of, self.plan.itemsizes
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
                    self.stats["sent"] += nbytes
                else:
                    self.stats["received"] += nbytes
                    if node_of[m.src] != node_of[me]:
                        self.stats["from_other_nodes"] += nbytes
                if self.shared is not None and node_of[m.src] == node_of[m.dst]:
                    if m.dst == me:
                        src_lo = c.lo if c.owner == m.src else c.span_of(m.src)[0]
                        src = _Lent(self.shared.view(m.src, j,
                                                     self.where[(j, c_i, m.src)] + (m.lo - src_lo) * sizes[c.name],
                                                     m.hi - m.lo, view.dtype))
                        copies.append((view, src))
                    continue
                if m.src == me:
                    handles.append(dist.isend(view, dst=dp.global_of(m.dst), group=dp.group, tag=tag))
                else:
                    handles.append(dist.irecv(view, src=dp.global_of(m.src), group=dp.group, tag=tag))
        return handles, copies

    def _land(self, rnd: tuple, held: dict) -> None:
        """Copy what this rank wants of the round out of where it was held."""
        got, pairs = 0, []
        for c_i, c in enumerate(rnd):
            if c_i not in held:
                continue
            lo, buf = held[c_i]
            for w in self.by_name.get(c.name, ()):
                a, b = max(w.start, lo), min(w.stop, lo + buf.numel())
                if a < b:
                    dst, src = w.out[a - w.start: b - w.start], buf[a - lo: b - lo]
                    if dst.data_ptr() != src.data_ptr() or dst.dtype != src.dtype:
                        pairs.append((dst, src))  # landed in staging, or a second want of the same bytes
                    got += (b - a) * dst.element_size()
        _copy_all(pairs, self.threads)
        if self.progress and got:
            self.progress(got)
