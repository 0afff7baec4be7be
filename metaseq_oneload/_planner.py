"""The plan of a load, as a value, and the one planner that makes it.

A load is decided before a byte moves (``../shared/STYLE.md``, "One plan, one executor").
:func:`plan_part` turns what one data-parallel group knows, the layout and the targets of
its model-parallel part, every rank's wanted element ranges and the :class:`Topology` (ranks,
nodes, which ranks see the files, each one's view of its page cache), into a frozen
:class:`PartPlan`: the strategy and why, the route (the broadcast buckets or the read-once
exchange's rounds), and per rank its reads, what it sends and receives through which channel
and the memory it holds. The engine gathers those inputs and executes the value
(``_execute.execute``); :func:`metaseq_oneload.plan_load` builds the same inputs for a
topology described instead of joined and calls the same function, so a plan equals its load
by construction. Pure: no collectives, no I/O (byte counts come from the layout's offsets).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Sequence, Tuple

import torch

from ._errors import CheckpointLayoutError, cap_list
from ._exchange import (Chunk, ExchangePlan, Message, cached_nodes, chunk_bytes_for, merged, overlap, plan_exchange, private_nodes,
                        shared_slots)
from ._execute import ReadItem, bucket_need, fill, pieces
from ._layout import CheckpointLayout
from ._options import ALIGN, Options
from ._plan import BlockCopy, TargetTensor, flat_shard_range

__all__ = ["Topology", "Transfer", "FileRead", "RankPlan", "PartPlan", "LoadPlan", "Entry", "Bucket", "plan_part", "choose",
           "check_views", "want_ranges", "schedule", "bucket_need", "itemsize", "to_wire", "from_wire",
           "own_shard_fits"]


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class Topology:
    """The ranks of one data-parallel group (one model-parallel part) as a load sees them.

    ``caches[d]`` is data-parallel rank d's view of the files (``_nodes.page_cache_view``:
    ``shared`` page cache, ``private`` copy on its node's own disk, ``avail`` memory)."""

    model_parallel: int
    ranks: Tuple[int, ...]  # the global rank of each data-parallel rank
    nodes: Tuple[str, ...]  # each data-parallel rank's node
    readers: Tuple[int, ...]  # the data-parallel ranks that see the files
    caches: Tuple[Mapping, ...]
    shm: bool = True  # the agreed setting: a node's ranks share pieces through shared memory (CPU groups)
    why_blind: str = ""  # what the first rank that sees no files said

    @property
    def dp_size(self) -> int:
        return len(self.ranks)

    @property
    def storage(self) -> str:
        """``private`` (every reader's copy is on its node's own disk), ``page_cache`` (the
        reads go through a page cache the node shares) or ``shared`` (network or object storage
        without one), as the readers' views say."""
        views = [self.caches[r] for r in self.readers] or [{}]
        if all(v.get("private") for v in views):
            return "private"
        return "page_cache" if all(v.get("shared") for v in views) else "shared"


@dataclass(frozen=True)
class Transfer:
    """Elements ``lo..hi`` of target ``name`` from data-parallel rank ``src`` to ``dst`` in
    round (or bucket) ``round``; ``channel``: "network" (the process group), "shm" (the node's
    shared memory) or "broadcast" (one bucket to every rank of the group, ``dst`` -1)."""

    round: int
    src: int
    dst: int
    name: str
    lo: int
    hi: int
    channel: str
    nbytes: int


@dataclass(frozen=True)
class FileRead:
    """Where one of a rank's read items comes from in one file: bytes ``first .. end`` of
    ``path`` hold its elements there (``nbytes`` of them read, in ``reads`` calls: a
    row-parallel block is read row by row), landing in elements ``start .. stop`` of target
    ``name``. ``first`` is -1 for a file without byte offsets (a legacy archive torch
    loads whole)."""

    path: str
    first: int
    end: int
    nbytes: int
    reads: int
    name: str
    start: int
    stop: int


@dataclass(frozen=True)
class RankPlan:
    """What one rank of the world does in a load."""

    rank: int  # Megatron's grid: rank = data_parallel_rank * M + model_parallel_rank
    model_parallel_rank: int
    data_parallel_rank: int
    files: Tuple[str, ...]  # the files it reads from (none when it only receives)
    reads: int  # read calls (contiguous byte ranges; one per stored run it touches)
    bytes_read: int  # from storage (or its node's page cache)
    bytes_out: int  # what is written into its output tensors (LoadReport.bytes_out; no flat padding)
    bytes_received: int  # from other ranks (broadcast, parallel)
    bytes_sent: int  # to other ranks
    peak_extra_bytes: int  # CPU memory beyond its output: the formula ``memory`` names
    bytes_from_other_nodes: int = 0  # of bytes_received, what crossed between nodes
    node: int = 0  # its node, numbered in rank order
    memory: str = ""  # the formula of peak_extra_bytes (the verbs' docstrings)
    read_items: Tuple[ReadItem, ...] = ()  # the target elements it reads, in order
    file_reads: Tuple[FileRead, ...] = ()  # the byte ranges of the files those come from

    @property
    def peak_bytes(self) -> int:
        return self.bytes_out + self.peak_extra_bytes


@dataclass(frozen=True)
class Entry:
    """Elements ``start .. start + length`` of target ``name`` at ``offset`` bytes into a bucket."""

    name: str
    start: int
    length: int
    offset: int


@dataclass(frozen=True)
class Bucket:
    """One broadcast: ``direct`` holds one chunk sent straight into the receivers' outputs."""

    direct: bool
    entries: Tuple[Entry, ...]


@dataclass(frozen=True)
class PartPlan:
    """The plan of one model-parallel part: what its data-parallel group executes."""

    model_parallel_rank: int
    strategy: str
    reason: str
    mode: str  # "local" (each reads its own), "exchange", "broadcast" or "scatter"
    ranks: Tuple[RankPlan, ...]
    transfers: Tuple[Transfer, ...] = ()
    exchange: Optional[ExchangePlan] = None
    schedule: Tuple[Bucket, ...] = ()
    storage_bytes: int = 0  # what the storage serves: bytes read less what a node's page cache repeats


@dataclass(frozen=True)
class LoadPlan:
    """The plan of one load call: a :class:`PartPlan` per model-parallel part (a load's
    report carries the one its group executed)."""

    path: str
    kind: str
    saved_model_parallel: int
    saved_shards: int
    saved_flat: bool
    world: int
    model_parallel: int
    flat: bool
    model_bytes: int  # tensor bytes of the whole checkpoint
    parts: Tuple[PartPlan, ...] = ()
    note: str = ""  # what the plan assumed (plan_load: a wrapping it was not given)

    @property
    def ranks(self) -> Tuple[RankPlan, ...]:
        return tuple(sorted((r for p in self.parts for r in p.ranks), key=lambda r: r.rank))

    @property
    def strategy(self) -> str:
        kinds = list(dict.fromkeys(p.strategy for p in self.parts))
        return kinds[0] if len(kinds) == 1 else "mixed"

    @property
    def reason(self) -> str:
        mixed = self.strategy == "mixed"
        return "; ".join(dict.fromkeys(f"{p.strategy}: {p.reason}" if mixed else p.reason
                                       for p in self.parts)) + self.note

    @property
    def bytes_read(self) -> int:
        return sum(r.bytes_read for r in self.ranks)

    @property
    def network_bytes(self) -> int:
        """Bytes that cross between ranks (each counted once, at its receiver)."""
        return sum(r.bytes_received for r in self.ranks)

    @property
    def storage_bytes(self) -> int:
        return sum(p.storage_bytes for p in self.parts)

    def part(self, m: int) -> PartPlan:
        return next(p for p in self.parts if p.model_parallel_rank == m)

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("parts", "note")}
        d.update(strategy=self.strategy, reason=self.reason, bytes_read=self.bytes_read,
                 network_bytes=self.network_bytes, storage_bytes=self.storage_bytes)
        d["ranks"] = [dict({f.name: getattr(r, f.name) for f in dataclasses.fields(r)
                            if f.name not in ("read_items", "file_reads")},
                           peak_bytes=r.peak_bytes, read_items=[[i.name, i.start, i.stop] for i in r.read_items],
                           file_reads=[dataclasses.asdict(f) for f in r.file_reads])
                      for r in self.ranks]
        d["transfers"] = sum(len(p.transfers) for p in self.parts)
        return d


# --------------------------------------------------------------------------- strategy


def own_shard_fits(layout: CheckpointLayout, mp_size: int, world: int, flat: bool) -> tuple:
    """(fits, why) for the own-shard strategy."""
    if layout.model_parallel_size != mp_size:
        return False, f"saved model-parallel size {layout.model_parallel_size} != target {mp_size}"
    if layout.shards_per_part != world:
        return False, f"saved {layout.shards_per_part} shard(s) per part != {world} data-parallel rank(s)"
    if flat != layout.flat and layout.shards_per_part > 1:
        return False, "the target is unflattened but the saved shards are flat" if not flat else "saved shards are not flat"
    if flat:
        for part in layout.parts:
            for fp in part.flat_params:
                for d, real in enumerate(fp.real_numels):
                    lo, hi, size = flat_shard_range(fp.total_numel, d, world)
                    if real != hi - lo or fp.shard_numels[d] != size:
                        return False, f"{fp.key}: saved shard boundaries differ from fairscale's for {world} ranks"
    return True, "the saved layout matches the world: each rank reads its own file"


def check_views(infos: Sequence[Mapping]) -> None:
    """(local, alike on every rank) Raise unless the ranks that see files see the same ones
    and data-parallel rank 0, the reader of its part, is one of them."""
    broken = [info for info in infos if not info["ok"] and not info["blind"]]
    if broken:
        raise CheckpointLayoutError(
            "the checkpoint is damaged as some ranks see it: "
            + cap_list([f"rank {info['rank']}: {info['err']}" for info in broken], 4, sep="; ")
        )
    if not infos[0]["ok"]:
        raise CheckpointLayoutError(
            f"data-parallel rank 0 (rank {infos[0]['rank']}), the reader of this model part, cannot read "
            f"the checkpoint: {infos[0]['err']}"
        )
    if len({info["fp"] for info in infos if info["ok"]}) > 1:
        odd = [f"rank {info['rank']}: {info['desc']}" for info in infos if info["ok"]]
        raise CheckpointLayoutError(
            "the ranks see different checkpoint files (" + cap_list(odd, 4, sep="; ") + "). Every rank must see the "
            "same files (or none, with strategy='broadcast'); sync the folder or fix the path."
        )


def choose(asked: str, topo: Topology, layout: Optional[CheckpointLayout], flat: bool) -> tuple:
    """(local, alike on every rank) (strategy, reason) before anyone's wants are known; raises
    where the strategy asked for cannot load this layout on this topology."""
    blind = [d for d in range(topo.dp_size) if d not in topo.readers]
    if blind:
        who = "rank" + ("s " if len(blind) > 1 else " ") + cap_list([topo.ranks[d] for d in blind])
        if asked == "broadcast":
            return "broadcast", f"{who} cannot see the files; data-parallel rank 0 reads and broadcasts"
        if asked in ("auto", "parallel"):
            return "parallel", (f"{who} cannot see the files; the {len(topo.readers)} rank(s) that can "
                                "read each byte once between them and send it on")
        raise CheckpointLayoutError(
            f"strategy={asked!r} needs every rank to read the files, but {who} cannot "
            f"({topo.why_blind}). Use strategy='parallel' or strategy='auto' to read once among the "
            "ranks that can and send it on, or strategy='broadcast'."
        )
    if asked == "broadcast":
        return "broadcast", "requested: data-parallel rank 0 reads and broadcasts in buckets"
    if asked == "parallel":
        return "parallel", "requested: each byte read once, split among the ranks by bytes, and sent on"
    fits, why = own_shard_fits(layout, topo.model_parallel, topo.dp_size, flat)
    if asked == "own_shard" and not fits:
        raise CheckpointLayoutError(
            f"strategy='own_shard' needs the saved layout to match the world, but {why}. "
            "Use strategy='reshard' or strategy='auto' to read byte ranges from any layout."
        )
    if fits and asked in ("auto", "own_shard"):
        return "own_shard", why
    mp_note = (f", model-parallel {layout.model_parallel_size}->{topo.model_parallel}"
               if layout.model_parallel_size != topo.model_parallel else "")
    return "reshard", (f"{'requested' if asked == 'reshard' else why}; each rank reads only its "
                       f"byte ranges{mp_note}")


def exchange_choice(strategy: str, asked: str, reason: str, ranges: Sequence[Mapping], sizes: Mapping[str, int],
                    order: Sequence[str], topo: Topology, bucket_bytes: int) -> tuple:
    """(local, alike on every rank) (strategy, reason, the exchange plan or None), given every
    rank's wanted ranges.

    ``parallel`` asked for reads every byte once in all and sends it on, even between ranks
    of one node and between nodes that each have a copy. Otherwise, where ranks want the
    same bytes: a node with a copy on a disk of its own reads what its ranks want from it
    (no other storage is asked, and a local read beats the network); nodes on shared storage
    (network filesystems, object stores) read each byte once between them and send it on.
    Ranks of a node whose page cache can hold the bytes each read their own (the repeats are
    memory copies out of the cache, cheaper than a message's two); only what other nodes and
    blind ranks want travels, and ``auto`` says ``parallel`` where anything does. Where
    nothing needs to travel, the strategy stays as it was."""
    wanted, union = overlap(ranges, sizes)
    if strategy != "parallel" and wanted <= 1.05 * union:
        return strategy, reason, None
    readers, nodes, caches = list(topo.readers), list(topo.nodes), list(topo.caches)
    strict = asked == "parallel"
    cached, notes = (frozenset(), []) if strict else cached_nodes(caches, nodes, readers, ranges, sizes)
    private = frozenset() if strict else private_nodes(caches, nodes, readers)
    plan = plan_exchange(order, sizes, ranges, readers, nodes, chunk_bytes_for(bucket_bytes, len(readers)), cached,
                         private)
    times = f"{wanted / max(union, 1):.2f}x"
    own = ""
    if private:
        kinds = sorted({caches[r].get("fs") or "?" for r in readers if nodes[r] in private})
        n = len(set(nodes))
        own = (f"every node has a copy on a disk of its own ({', '.join(kinds)}) and reads it there"
               if len(private) == n else
               f"{len(private)} of {n} nodes have a copy on a disk of their own ({', '.join(kinds)}) and read it there")
    if not plan.moves and len(readers) == len(ranges):  # (blind ranks keep the plan: the readers verify for them)
        if wanted > 1.05 * union:
            where = (f"{own}, each node's storage once; ranks of a node through its page cache" if own else
                     "on one node whose page cache holds them: each rank reads its own, the storage serves them once")
            reason += f"; the ranks want {times} the bytes there are, {where}"
        return strategy, reason, None
    share = (f"; {own}" if own else "") + ("; ranks of a node read through its page cache" if cached else "") + (
        f" ({'; '.join(notes)}: exchanged there)" if notes else "")
    if strategy != "parallel" and asked == "auto":
        return "parallel", (f"the ranks want {times} the bytes there are (the same bytes on several ranks): each "
                            f"node reads its share once, split by bytes, and sends it on{share}"), plan
    if strategy != "parallel":
        reason += f"; bytes wanted by several ranks are read once per node and sent on{share}"
    elif cached or own:
        reason += share
    return strategy, reason, plan


# --------------------------------------------------------------------------- broadcast schedule


def schedule(targets: Mapping[str, TargetTensor], bucket_bytes: int, direct: bool,
             chunk_bytes: Optional[int] = None) -> Tuple[Bucket, ...]:
    """Buckets of entries, in the one order every rank walks. With ``direct``, a tensor of
    at least a quarter bucket goes in chunks of ``chunk_bytes`` (default: a bucket) straight
    into the receivers' outputs: those stage nothing, so a smaller staging bucket need not
    multiply their broadcasts."""
    buckets, current, used = [], [], 0
    for t in targets.values():
        if t.alias_of is not None:
            continue
        size_of = itemsize(t.dtype)
        per = max(1, bucket_bytes // size_of)
        if direct and t.nbytes >= bucket_bytes // 4:
            step = max(1, (chunk_bytes or bucket_bytes) // size_of)
            for lo in range(0, t.numel, step):
                buckets.append(Bucket(True, (Entry(t.name, lo, min(step, t.numel - lo), 0),)))
            continue
        for lo in range(0, t.numel, per):
            n = min(per, t.numel - lo)
            size = -(-(n * size_of) // ALIGN) * ALIGN
            if used + size > bucket_bytes and current:
                buckets.append(Bucket(False, tuple(current)))
                current, used = [], 0
            current.append(Entry(t.name, lo, n, used))
            used += size
    if current:
        buckets.append(Bucket(False, tuple(current)))
    return tuple(buckets)


def want_ranges(wants: Sequence) -> dict:
    """A rank's wants as JSON: name -> [[name, start, stop, dtype, index in wants], ...]."""
    mine: dict = {}
    for k, w in enumerate(wants):
        mine.setdefault(w.name, []).append([w.name, w.start, w.stop, str(w.out.dtype).replace("torch.", ""), k])
    return mine


# --------------------------------------------------------------------------- the planner


class _Counter:
    """Stands in for the reader: counts what the fill code asks for, reads nothing."""

    def __init__(self, chunk_bytes: int, spans: Optional[dict] = None):
        self.chunk_bytes = chunk_bytes
        self.bytes_read = 0
        self.reads = 0
        self.files: Dict[str, None] = {}
        self.items: list = []
        self.file_reads: Dict[tuple, list] = {}  # (item index, path) -> [first, end, nbytes, reads]
        self.spans = spans  # path -> [(first byte, past the last)], shared by the ranks of a node

    def take(self, target: TargetTensor, lo: int, hi: int) -> None:
        self.items.append(ReadItem(target.name, lo, hi))
        fill(target, torch.empty(hi - lo, dtype=target.dtype, device="meta"), lo, self)

    def read_extent(self, ext, start, out, dtype) -> None:
        n = out.numel()
        if n == 0:
            return
        self.files.setdefault(ext.path)
        where = self.file_reads.setdefault((len(self.items) - 1, ext.path), [-1, -1, 0, 0])
        if ext.byte_offset is None:
            # A file without byte offsets (legacy format): the reader loads it whole, and
            # its bytes_read counts range reads only; so does this count.
            return
        self.reads += 1
        nbytes = n * itemsize(dtype)
        self.bytes_read += nbytes
        at = ext.byte_offset + start * (nbytes // n)
        where[0] = at if where[0] < 0 else min(where[0], at)
        where[1] = max(where[1], at + nbytes)
        where[2] += nbytes
        where[3] += 1
        if self.spans is not None:
            self.spans.setdefault(ext.path, []).append((at, at + nbytes))

    def located(self) -> tuple:
        """The :class:`FileRead` of every item, in the items' order."""
        out = []
        for (k, path), (first, end, nbytes, reads) in self.file_reads.items():
            item = self.items[k]
            out.append(FileRead(path, first, end, nbytes, reads, item.name, item.start, item.stop))
        return tuple(out)


def _staging(targets: Mapping[str, TargetTensor], ranges: Mapping, chunk_bytes: int) -> int:
    """A reading rank's one staging buffer: at most a chunk, where a stored dtype differs
    from the destination's or a row-parallel weight is split anew; none where the bytes go
    straight into the outputs."""
    need = 0
    for name in ranges:
        t = targets[name]
        for c in t.copies:
            if isinstance(c, BlockCopy):
                need = max(need, min(chunk_bytes, c.rows * c.src_cols * itemsize(c.src.dtype)))
            elif c.src.dtype != t.dtype:
                need = max(need, min(chunk_bytes, c.length * itemsize(c.src.dtype)))
    return need


def _out_bytes(rr: Mapping) -> int:
    return sum((b - a) * itemsize(getattr(torch, dt)) for items in rr.values() for _, a, b, dt, _ in items)


def _whole(rr: Mapping, order: Sequence[str], targets: Mapping[str, TargetTensor]) -> bool:
    items = [i for v in rr.values() for i in v]
    return len(items) == len(order) and all(a == 0 and b == targets[n].numel for n, a, b, _, _ in items)


def plan_part(layout: CheckpointLayout, targets: Mapping[str, TargetTensor], ranges: Sequence[Mapping],
              direct: Sequence[Sequence[bool]], topo: Topology, opts: Options, flat: bool, m: int) -> PartPlan:
    """(local, pure) The plan of model-parallel part ``m``: ``ranges[d]`` are data-parallel
    rank d's wants (:func:`want_ranges`), ``direct[d][k]`` whether its k-th want's output can
    take the bytes as they travel (the target's dtype, contiguous, on the group's device)."""
    strategy, reason = choose(opts.strategy, topo, layout, flat)
    order = [n for n, t in targets.items() if t.alias_of is None]
    if strategy == "broadcast":
        return _broadcast_part(targets, ranges, direct, order, topo, opts, m, reason)
    exchange = None
    if strategy in ("own_shard", "reshard", "parallel") and topo.dp_size > 1:
        sizes = {n: itemsize(t.dtype) for n, t in targets.items()}
        strategy, reason, exchange = exchange_choice(strategy, opts.strategy, reason, ranges, sizes, order, topo,
                                                     opts.bucket_bytes)
    if exchange is not None:
        return _exchange_part(targets, ranges, direct, topo, opts, m, strategy, reason, exchange)
    spans: dict = {}  # node -> path -> byte ranges its ranks read: one page cache per node
    ranks = []
    for d, rr in enumerate(ranges):
        counter = _Counter(opts.chunk_bytes, spans.setdefault(topo.nodes[d], {}))
        for items in rr.values():
            for n, a, b, _, _ in items:
                counter.take(targets[n], a, b)
        ranks.append(_rank(topo, m, d, counter, _out_bytes(rr), 0, 0, 0,
                           _staging(targets, rr, opts.chunk_bytes), "output + one staging chunk"))
    if strategy == "own_shard":
        reason = _own_file_note(layout, m, ranks, reason)
    read = sum(r.bytes_read for r in ranks)
    cached = topo.dp_size > 1 and all(topo.caches[r].get("shared") for r in topo.readers)
    storage = (sum(hi - lo for node in spans.values() for iv in node.values() for lo, hi in merged(iv))
               if cached else read)
    return PartPlan(m, strategy, reason, "local", tuple(ranks), storage_bytes=storage)


def _rank(topo: Topology, m: int, d: int, counter: Optional[_Counter], out: int, received: int, sent: int,
          from_nodes: int, extra: int, memory: str) -> RankPlan:
    node = list(dict.fromkeys(topo.nodes)).index(topo.nodes[d])
    files, reads, read, items, located = ((), 0, 0, (), ()) if counter is None else (
        tuple(counter.files), counter.reads, counter.bytes_read, tuple(counter.items), counter.located())
    return RankPlan(d * topo.model_parallel + m, m, d, files, reads, read, out, received, sent, extra, from_nodes,
                    node, memory, items, located)


def _broadcast_part(targets, ranges, direct, order, topo: Topology, opts: Options, m: int, reason: str) -> PartPlan:
    """Data-parallel rank 0 reads; every rank that wants every tensor whole gets buckets by
    broadcast (straight into its outputs where all can take them), else pieces point to point."""
    dp_size = len(ranges)
    whole = all(_whole(rr, order, targets) for rr in ranges)
    straight = whole and all(all(f) for f in direct)
    # Where every rank takes every bucket, each holds one: a W-th of ``bucket_mb`` apiece
    # keeps the group's staging at one bucket in all.
    share = max(ALIGN, opts.bucket_bytes // dp_size // ALIGN * ALIGN) if whole else opts.bucket_bytes
    buckets = schedule(targets, share, straight, opts.bucket_bytes)
    counter = _Counter(opts.chunk_bytes)
    received = [0] * dp_size
    transfers = []
    for k, b in enumerate(buckets):
        hits = [] if whole else pieces(b.entries, ranges)
        if not whole and not hits:
            continue  # no one wants these bytes: the scatter loop skips the bucket
        for e in b.entries:
            counter.take(targets[e.name], e.start, e.start + e.length)
        if whole:
            e = b.entries[-1]
            size = e.offset + e.length * itemsize(targets[e.name].dtype)
            transfers.append(Transfer(k, 0, -1, e.name, e.start, e.start + e.length, "broadcast", size))
            for d in range(1, dp_size):
                received[d] += size
            continue
        for i, r, lo, hi, _ in hits:
            if r != 0:
                nbytes = (hi - lo) * itemsize(targets[b.entries[i].name].dtype)
                transfers.append(Transfer(k, 0, r, b.entries[i].name, lo, hi, "network", nbytes))
                received[r] += nbytes
    bucket = bucket_need(buckets, targets)
    ranks = []
    for d, rr in enumerate(ranges):
        holds = bucket if d == 0 or (whole and bucket) else 0
        ranks.append(_rank(topo, m, d, counter if d == 0 else None, _out_bytes(rr), received[d],
                           sum(received) if d == 0 else 0, 0, holds,
                           "output + bucket / W" if whole else "output + one bucket"))
    read = ranks[0].bytes_read
    return PartPlan(m, "broadcast", reason, "broadcast" if whole else "scatter", tuple(ranks), tuple(transfers),
                    schedule=buckets, storage_bytes=read)


def _in_place(rr: Mapping, flags: Sequence[bool], name: str, lo: int, hi: int) -> bool:
    """Whether one of a rank's wants takes elements ``lo..hi`` of ``name`` as they travel."""
    return any(a <= lo and hi <= b and flags[k] for _, a, b, _, k in rr.get(name, ()))


def _exchange_part(targets, ranges, direct, topo: Topology, opts: Options, m: int, strategy: str, reason: str,
                   plan: ExchangePlan) -> PartPlan:
    """Every byte read once per node (or cluster) and sent on, as ``plan`` says."""
    dp_size = len(ranges)
    counters = [_Counter(opts.chunk_bytes) for _ in range(dp_size)]
    received, sent, others, extra = [0] * dp_size, [0] * dp_size, [0] * dp_size, [0] * dp_size
    node_of, sizes = plan.node_of, plan.itemsizes
    transfers = []
    for j, rnd in enumerate(plan.rounds):
        staged = [0] * dp_size
        for c in rnd:
            t = targets[c.name]
            counters[c.owner].take(t, c.lo, c.hi)
            for r in c.self_read:
                counters[r].take(t, *c.span_of(r))
            for r, lo, hi in c.spans:
                if not _in_place(ranges[r], direct[r], c.name, lo, hi):
                    staged[r] += (hi - lo) * sizes[c.name]
            for msg in c.messages:
                nbytes = (msg.hi - msg.lo) * sizes[c.name]
                local = node_of[msg.src] == node_of[msg.dst]
                channel = "shm" if local and topo.shm else "network"
                transfers.append(Transfer(j, msg.src, msg.dst, c.name, msg.lo, msg.hi, channel, nbytes))
                received[msg.dst] += nbytes
                sent[msg.src] += nbytes
                others[msg.dst] += 0 if local else nbytes
        extra = [max(a, b) for a, b in zip(extra, staged)]
    # A rank holds its own shared segment (two slots); its neighbours let go of each piece
    # they copied out of it (``_exchange._Segments``), so its pages count once, in the writer.
    slot = shared_slots(plan, dp_size)[1] if topo.shm else [0] * dp_size
    ranks = []
    for d in range(dp_size):
        shared = 2 * slot[d]
        held = max(extra[d], _staging(targets, ranges[d], opts.chunk_bytes)) + shared
        ranks.append(_rank(topo, m, d, counters[d], _out_bytes(ranges[d]), received[d], sent[d], others[d], held,
                           "output + one bucket of staging + its shared-memory slots"))
    return PartPlan(m, strategy, reason, "exchange", tuple(ranks), tuple(transfers), exchange=plan,
                    storage_bytes=sum(plan.storage_bytes) if plan.storage_bytes else sum(plan.read_bytes))


def _own_file_note(layout: CheckpointLayout, m: int, ranks, reason: str) -> str:
    """own_shard's reason, as the ranks' reads bear it out: a rank that also reads another
    file than its own (the buffers every shard repeats are read from the first) is named."""
    others, names = [], set()
    for r in ranks:
        own = layout.files[m][r.data_parallel_rank].path
        if any(f != own for f in r.files):
            others.append(r)
            names.update(os.path.basename(f) for f in r.files if f != own)
    if not others:
        return reason
    names = sorted(names)
    who = "rank" + ("s " if len(others) > 1 else " ") + ", ".join(str(r.rank) for r in others[:8]) + (
        " ..." if len(others) > 8 else "")
    return (f"{reason}; {who} also read{'s' if len(others) == 1 else ''} from {', '.join(names[:4])}: the unsharded "
            "tensors (buffers) every shard file repeats are read from one copy")


# --------------------------------------------------------------------------- on the wire


_WIRE = {c.__name__: c for c in (PartPlan, RankPlan, ReadItem, FileRead, Transfer, Bucket, Entry, ExchangePlan, Chunk, Message)}


def to_wire(part: PartPlan) -> bytes:
    """A part's plan as JSON, for the ranks that did not compute it (only these frozen types
    travel, and only they come back: nothing in it is code)."""

    def enc(x):
        if dataclasses.is_dataclass(x):
            return {"__t": type(x).__name__, **{f.name: enc(getattr(x, f.name)) for f in dataclasses.fields(x)}}
        if isinstance(x, (tuple, list)):
            return [enc(v) for v in x]
        if isinstance(x, Mapping):  # its own tag: a key (a tensor's name) is data, never a type tag
            return {"__m": [[str(k), enc(v)] for k, v in x.items()]}
        return x

    return json.dumps(enc(part), separators=(",", ":")).encode()


def from_wire(payload: bytes) -> PartPlan:

    def dec(x):
        if isinstance(x, list):
            return tuple(dec(v) for v in x)
        if isinstance(x, dict) and set(x) == {"__m"}:
            return {k: dec(v) for k, v in x["__m"]}
        if isinstance(x, dict):
            fields = {k: dec(v) for k, v in x.items() if k != "__t"}
            return _WIRE[x["__t"]](**fields)
        return x

    part = dec(json.loads(payload))
    if not isinstance(part, PartPlan):
        raise ValueError("not a part's plan")
    return part
