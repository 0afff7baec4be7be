"""A load's plan before the load: for a world of W ranks (M model-parallel parts), what each
rank would read, the strategy ``auto`` would pick and why, each rank's peak extra memory and
the bytes that cross the network. Nothing but metadata is read.

The plan is computed by the engine's own steps, run without a process group: the same
strategy choice (``_loading._choose``), the same per-part targets (``plan_part``), the same
per-rank wants as :func:`metaseq_oneload.load_state_dict` builds them, the same broadcast
schedule or read-once exchange plan (``_exchange.plan_exchange``), and the same fill code (``_execute.fill``) against a reader that counts the
bytes it is asked for instead of reading them (outputs on the meta device). So the bytes a
plan states are the bytes a load of the same call reads; tests/distributed/test_load_plan.py
holds the two equal on real gloo ranks.
"""

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Dict, Mapping, Optional, Tuple

import torch

from ._dist import Group
from ._layout import CheckpointLayout
from ._exchange import _in_place, _merged, _shared_slots, page_cache_view
from ._execute import fill
from ._loading import (_choose, _exchange_choice, _Options, _resolve_aliases, _schedule, _want_ranges,
                       bucket_need, check_option, OptionError, state_dict_wants)
from ._plan import BlockCopy, FlatStructure, plan_part
from .formats import discover

__all__ = ["RankPlan", "LoadPlan", "plan_load"]


@dataclass(frozen=True)
class RankPlan:
    """What one rank of the world does in a load."""

    rank: int  # Megatron's grid: rank = data_parallel_rank * M + model_parallel_rank
    model_parallel_rank: int
    data_parallel_rank: int
    files: Tuple[str, ...]  # the files it reads from (none when it only receives)
    reads: int  # read calls (contiguous byte ranges; one per stored run it touches)
    bytes_read: int  # from storage
    bytes_out: int  # what is written into its output tensors (LoadReport.bytes_out; no flat padding)
    bytes_received: int  # from other ranks (broadcast, parallel)
    bytes_sent: int  # to other ranks (the reader when broadcasting; every reader with parallel)
    peak_extra_bytes: int  # CPU memory beyond its output, by docs/loading.md's formulas

    @property
    def peak_bytes(self) -> int:
        return self.bytes_out + self.peak_extra_bytes


@dataclass(frozen=True)
class LoadPlan:
    """The plan of one load call, for every rank; see :func:`plan_load`."""

    path: str
    kind: str
    saved_model_parallel: int
    saved_shards: int
    saved_flat: bool
    world: int
    model_parallel: int
    flat: bool
    strategy: str
    reason: str
    model_bytes: int  # tensor bytes of the whole checkpoint
    ranks: Tuple[RankPlan, ...] = field(default=())
    # What the storage serves: the bytes read, less the repeats a node's page cache serves
    storage_bytes: int = 0

    @property
    def bytes_read(self) -> int:
        return sum(r.bytes_read for r in self.ranks)

    @property
    def network_bytes(self) -> int:
        """Bytes that cross between ranks (each counted once, at its receiver)."""
        return sum(r.bytes_received for r in self.ranks)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["ranks"] = [dict(dataclasses.asdict(r), peak_bytes=r.peak_bytes) for r in self.ranks]
        d["bytes_read"], d["network_bytes"] = self.bytes_read, self.network_bytes
        return d


class _CountingReader:
    """Stands in for RangeReader: counts what the fill code asks for, reads nothing."""

    def __init__(self, chunk_bytes: int, spans: Optional[dict] = None):
        self.chunk_bytes = chunk_bytes
        self.bytes_read = 0
        self.reads = 0
        self.files: Dict[str, None] = {}
        self.spans = spans  # path -> [(first byte, past the last)], shared by the ranks of a node

    def read_extent(self, ext, start, out, dtype) -> None:
        n = out.numel()
        if n == 0:
            return
        self.files.setdefault(ext.path)
        if ext.byte_offset is None:
            # A file without byte offsets (legacy format): RangeReader loads it whole, and
            # its bytes_read counts range reads only; so does this count.
            return
        self.reads += 1
        nbytes = n * torch.empty((), dtype=dtype).element_size()
        self.bytes_read += nbytes
        if self.spans is not None:
            at = ext.byte_offset + start * (nbytes // n)
            self.spans.setdefault(ext.path, []).append((at, at + nbytes))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _wants(targets, structure: Optional[FlatStructure], flat: bool, dp_rank: int, dp_size: int,
           dtype: Optional[torch.dtype]) -> list:
    """This rank's wants, built by the load's own code, on the meta device."""
    return state_dict_wants(targets, structure, flat, dp_rank, dp_size, "meta")[0]


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _staging_bytes(targets, wants, chunk_bytes: int) -> int:
    """The reading ranks' one staging buffer (docs/loading.md): at most a chunk, where a
    stored dtype differs from the destination's or a row-parallel weight is split anew;
    none where the bytes go straight into the outputs."""
    need = 0
    for w in wants:
        t = targets[w.name]
        for c in t.copies:
            if isinstance(c, BlockCopy):
                need = max(need, min(chunk_bytes, c.rows * c.src_cols * _itemsize(c.src.dtype)))
            elif c.src.dtype != t.dtype:
                need = max(need, min(chunk_bytes, c.length * _itemsize(c.src.dtype)))
    return need


def plan_load(
    path: "str | os.PathLike | CheckpointLayout",
    *,
    world: int,
    model_parallel: int = 1,
    flat: bool = False,
    strategy: str = "auto",
    shard_metadata: Optional[Mapping] = None,
    bucket_mb: float = 256,
    chunk_mb: float = 64,
    qkv: str = "auto",
    dtype: Optional[torch.dtype] = None,
    trust_pickle: bool = False,
    wrapping: "Mapping | str | os.PathLike | None" = None,
) -> LoadPlan:
    """(local, metadata only) What ``load_state_dict(path, flat=..., strategy=...)`` would do
    on a world of ``world`` ranks, ``model_parallel`` parts of it, every rank seeing the files.

    Args:
        path: anything :func:`metaseq_oneload.inspect` takes, or its layout.
        world: the total number of ranks; a multiple of ``model_parallel``.
        model_parallel: the target model-parallel size.
        flat, strategy, shard_metadata, bucket_mb, chunk_mb, qkv, dtype, trust_pickle: as
            for :func:`metaseq_oneload.load_state_dict`.
        wrapping: instead of ``shard_metadata``, a flat shard file whose FSDP wrapping the
            model follows (as :func:`metaseq_oneload.convert`'s). With ``flat=True`` on
            unflattened metaseq weights and neither given, the plan assumes metaseq's wrapping
            (each ``*.layers.N`` its own FSDP instance) and its reason says so.

    Raises:
        ValueError: ``world`` is not a positive multiple of ``model_parallel``.
        CheckpointLayoutError: the strategy cannot load this layout (as the load would say).
    """
    check_option("world", world)
    check_option("model_parallel", model_parallel)
    if world % model_parallel:
        raise OptionError(f"world={world}, model_parallel={model_parallel}: the world must be a positive multiple "
                          "of the model-parallel size (each model-parallel part has as many data-parallel ranks).")
    opts = _Options(strategy=strategy, bucket_mb=bucket_mb, chunk_mb=chunk_mb, trust_pickle=trust_pickle, qkv=qkv,
                    dtype=dtype)
    layout = path if isinstance(path, CheckpointLayout) else discover(path, trust_pickle=trust_pickle)
    assumed = ""
    if flat and shard_metadata is None and wrapping is not None:
        from ._convert import _wrapping_metadata

        shard_metadata = _wrapping_metadata(wrapping, trust_pickle)
    elif flat and shard_metadata is None and not layout.flat and layout.flavor != "pytorch":
        assumed = ("; flat shards as metaseq wraps its models (each *.layers.N its own FSDP instance; "
                   "wrapping=SHARD.pt (CLI: --wrapping SHARD.pt) plans another model's)")
    dp_size = world // model_parallel
    info = {"rank": 0, "ok": True, "blind": False, "fp": layout.fingerprint(), "err": None, "desc": ""}
    chosen, reason = _choose(opts, [dict(info, rank=d) for d in range(dp_size)], layout, model_parallel, dp_size,
                             flat, Group(None, "data-parallel"))
    cache = page_cache_view([f.path for f in layout.all_files])
    ranks = []
    # Bytes the ranks read each on their own: on one node with a page cache, one read of
    # each serves them all.
    spans: dict = {}
    plain = 0
    # Every part's data-parallel group decides on its own from the same start, as the
    # engine's do: the strategy and reason of one part never feed the next.
    first, why = chosen, reason
    decided: Dict[Tuple[str, str], None] = {}
    for m in range(model_parallel):
        chosen, reason = first, why
        targets = plan_part(layout, model_parallel, m, qkv=qkv, dtype=dtype)
        structure = None
        if flat:
            if shard_metadata is not None:
                structure = FlatStructure.from_metadata(shard_metadata)
            elif assumed:
                from ._convert import _metaseq_wrapping

                structure = _metaseq_wrapping(targets, set(layout.parts[0].buffer_names))
            else:
                structure = FlatStructure.from_layout(layout, targets)
            structure.check_against(targets)
        per_dp = [_resolve_aliases(_wants(targets, structure, flat, d, dp_size, dtype), targets)
                  for d in range(dp_size)]
        outs = [sum(_nbytes(w.out) for w in wants) for wants in per_dp]  # as LoadReport.bytes_out
        if chosen == "broadcast":
            decided.setdefault((chosen, reason))
            ranks += _broadcast_part(m, model_parallel, targets, per_dp, outs, flat, opts)
            continue
        if chosen in ("own_shard", "reshard", "parallel") and dp_size > 1:
            # As the engine decides: read once and exchange where ranks want the same bytes.
            ranges = [_want_ranges(wants) for wants in per_dp]
            sizes = {n: _itemsize(t.dtype) for n, t in targets.items()}
            # One node, as these ranks' page cache sees the files here.
            chosen, reason, plan = _exchange_choice(
                chosen, strategy, reason, ranges, sizes, [n for n, t in targets.items() if t.alias_of is None],
                list(range(dp_size)), ["node"] * dp_size, [cache] * dp_size, opts.bucket_bytes)
            if plan is not None:
                decided.setdefault((chosen, reason))
                ranks += _parallel_part(m, model_parallel, targets, per_dp, outs, plan, sizes, opts)
                continue
        decided.setdefault((chosen, reason))
        for d, wants in enumerate(per_dp):
            reader = _CountingReader(opts.chunk_bytes, spans)
            for w in wants:
                fill(targets[w.name], w.out, w.start, reader)
            plain += reader.bytes_read
            extra = _staging_bytes(targets, wants, opts.chunk_bytes)
            ranks.append(RankPlan(d * model_parallel + m, m, d, tuple(reader.files), reader.reads,
                                  reader.bytes_read, outs[d], 0, 0, extra))
    ranks.sort(key=lambda r: r.rank)
    chosen = next(iter(decided))[0]
    if len({c for c, _ in decided}) > 1:
        chosen = "mixed"
    reason = "; ".join(dict.fromkeys(f"{c}: {r}" if chosen == "mixed" else r for c, r in decided))
    if chosen == "own_shard":
        reason = _own_file_note(layout, ranks, reason)
    reason += assumed
    read = sum(r.bytes_read for r in ranks)
    return LoadPlan(path=layout.display_name, kind=layout.kind, saved_model_parallel=layout.model_parallel_size,
                    saved_shards=layout.shards_per_part, saved_flat=layout.flat, world=world,
                    model_parallel=model_parallel, flat=flat, strategy=chosen, reason=reason,
                    model_bytes=layout.total_bytes, ranks=tuple(ranks),
                    storage_bytes=(read - plain + sum(hi - lo for iv in spans.values() for lo, hi in _merged(iv))
                                   if cache["shared"] else read))


def _own_file_note(layout: CheckpointLayout, ranks, reason: str) -> str:
    """own_shard's reason, as the ranks' reads bear it out: a rank that also reads another
    file than its own (the buffers every shard repeats are read from the first) is named."""
    others, names = [], set()
    for r in ranks:
        own = layout.files[r.model_parallel_rank][r.data_parallel_rank].path
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


def _parallel_part(m: int, mp_size: int, targets, per_dp, outs, plan, sizes, opts: _Options) -> list:
    """The ranks of model-parallel part ``m`` when they read once between them and exchange."""
    dp_size = len(per_dp)
    readers = [_CountingReader(opts.chunk_bytes) for _ in range(dp_size)]
    received, sent, extra = [0] * dp_size, [0] * dp_size, [0] * dp_size
    meta = torch.device("meta")
    for rnd in plan.rounds:
        staged = [0] * dp_size
        for c in rnd:
            t = targets[c.name]
            fill(t, torch.empty(c.hi - c.lo, dtype=t.dtype, device="meta"), c.lo, readers[c.owner])
            for r in c.self_read:
                lo, hi = c.span_of(r)
                fill(t, torch.empty(hi - lo, dtype=t.dtype, device="meta"), lo, readers[r])
            for r, lo, hi in c.spans:
                by_name = [w for w in per_dp[r] if w.name == c.name]
                if _in_place(by_name, lo, hi, t.dtype, meta) is None:
                    staged[r] += (hi - lo) * sizes[c.name]
            for msg in c.messages:
                nbytes = (msg.hi - msg.lo) * sizes[c.name]
                received[msg.dst] += nbytes
                sent[msg.src] += nbytes
        extra = [max(a, b) for a, b in zip(extra, staged)]
    # One node: every rank maps the node's shared segments (two slots each) and may touch all.
    shared = 2 * sum(_shared_slots(plan, dp_size)[1])
    out = []
    for d in range(dp_size):
        rd = readers[d]
        extra_d = max(extra[d], _staging_bytes(targets, per_dp[d], opts.chunk_bytes)) + shared
        out.append(RankPlan(d * mp_size + m, m, d, tuple(rd.files), rd.reads, rd.bytes_read, outs[d],
                            received[d], sent[d], extra_d))
    return out


def _broadcast_part(m: int, mp_size: int, targets, per_dp, outs, flat: bool, opts: _Options) -> list:
    """The ranks of model-parallel part ``m`` when data-parallel rank 0 reads and sends."""
    dp_size = len(per_dp)
    whole = not flat  # every rank wants every tensor whole: broadcasts, else point-to-point pieces
    reader = _CountingReader(opts.chunk_bytes)
    received = [0] * dp_size
    if whole:
        # Direct broadcasts into the receivers' outputs: their outputs are CPU tensors of
        # the target dtype (load_state_dict's default device, gloo's device).
        schedule = _schedule(targets, opts.bucket_bytes, direct=True)
        for _, entries in schedule:
            size = 0
            for e in entries:
                t = targets[e.name]
                view = torch.empty(e.length, dtype=t.dtype, device="meta")
                fill(t, view, e.start, reader)
                size = e.offset + _nbytes(view)
            for d in range(1, dp_size):
                received[d] += size
        bucket = bucket_need(schedule, targets)  # 0 when every bucket goes straight into the outputs
    else:
        wanted = {}
        for d, wants in enumerate(per_dp):
            for w in wants:
                wanted.setdefault(w.name, []).append((w.start, w.stop, d, _nbytes(w.out) // max(1, w.out.numel())))
        schedule = _schedule(targets, opts.bucket_bytes, direct=False)
        for _, entries in schedule:
            hits = []
            for e in entries:
                for lo, hi, d, item in wanted.get(e.name, ()):
                    a, b = max(lo, e.start), min(hi, e.start + e.length)
                    if a < b:
                        hits.append((d, (b - a) * item))
            if not hits:
                continue
            for e in entries:
                t = targets[e.name]
                fill(t, torch.empty(e.length, dtype=t.dtype, device="meta"), e.start, reader)
            for d, n in hits:
                if d != 0:
                    received[d] += n
        bucket = bucket_need(schedule, targets)
    sent = sum(received)
    out = []
    for d in range(dp_size):
        is_reader = d == 0
        extra = bucket if is_reader or (whole and bucket) else 0
        out.append(RankPlan(d * mp_size + m, m, d, tuple(reader.files) if is_reader else (),
                            reader.reads if is_reader else 0, reader.bytes_read if is_reader else 0, outs[d],
                            received[d], sent if is_reader else 0, extra))
    return out
