"""The engine behind every load: gather, plan, execute, verify.

Every rank of a load runs the same steps: check in (``arrive``), agree on the groups, the
options and the agreed settings; discover the checkpoint once per cluster; agree on what every
rank sees (which gives the :class:`~._planner.Topology`); plan its model-parallel part's
targets; build its wants; gather every rank's wanted ranges; let data-parallel rank 0 plan
(``_planner.plan_part``) and send the plan to its group; execute the plan
(``_execute.execute``); verify. Each step ends with ``settle``: a failure on any rank stops
every rank at the same point, none is left waiting in a collective.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Sequence

import torch

from ._dist import Group, PeerFailure, arrive, clip, settle, tell_left
from ._errors import (CheckpointLayoutError, CheckpointNotFoundError, OneloadError, OptionError, StateDictMismatchError,
                      cap_list)
from ._nodes import launched_alone, node_key, page_cache_view
from ._execute import Want, counting, execute, fill, sum64
from ._layout import CheckpointLayout
from ._options import Options
from ._plan import FlatGroup, FlatStructure, TargetTensor, flat_structure, plan_part as plan_targets
from ._planner import LoadPlan, PartPlan, Topology, check_views, choose, from_wire, plan_part, to_wire, want_ranges
from ._reading import RangeReader
from ._settings import disagreement
from .formats import adopt, discover, to_wire as layout_to_wire

__all__ = ["LoadReport", "run", "resolve_aliases"]

logger = logging.getLogger("metaseq_oneload")


@dataclass(frozen=True)
class LoadReport:
    """What a load did, for logs, the demo table and tests; ``plan`` is the plan it executed
    (its own model-parallel part's: ``plan.parts[0]``)."""

    path: str
    kind: str
    saved_model_parallel: int
    saved_shards: int
    saved_flat: bool
    target_model_parallel: int
    target_world: int
    flat: bool
    strategy: str
    reason: str
    bytes_read: int
    bytes_out: int
    seconds: float
    verified: bool = False
    digests_checked: int = 0  # verify="digest": stored tensors checked against their recorded digest
    bytes_received: int = 0  # from other ranks (parallel, broadcast)
    bytes_from_other_nodes: int = 0  # of bytes_received, what crossed between nodes
    bytes_sent: int = 0
    warnings: tuple = field(default=())
    unloaded: tuple = field(default=())  # load_into, strict=False: module tensors the checkpoint lacks
    plan: Optional[LoadPlan] = None

    def line(self) -> str:
        return (f"oneload: strategy={self.strategy} ({self.reason}); saved {self.saved_model_parallel}x"
                f"{self.saved_shards} {'flat' if self.saved_flat else 'unflattened'} -> target "
                f"{self.target_model_parallel}x{self.target_world} {'flat' if self.flat else 'unflattened'}")


def run(path, dp: Group, mp: Group, opts: Options, flat: bool, structure_from: Optional[Mapping],
        make_wants: Callable) -> tuple:
    """(collective over both groups) Discover, agree, plan, execute, verify. Returns
    (layout or None, targets, structure, report)."""
    try:
        return _steps(path, dp, mp, opts, flat, structure_from, make_wants)
    except BaseException as e:
        # Failures inside a step are settled together (every rank raises the same error:
        # none is left in a collective, and a peer still in the last gather must not read
        # "left the load"); anything else that leaves the load (an error between steps, an
        # interrupt) must not leave the others in a collective.
        if not getattr(e, "settled", False):
            tell_left((dp, mp), e)
        raise


def _steps(path, dp: Group, mp: Group, opts: Options, flat: bool, structure_from: Optional[Mapping],
           make_wants: Callable) -> tuple:
    t0 = time.perf_counter()
    groups = (dp, mp)
    # Everyone is here: a rank that failed before the load (and lives on) must not leave the
    # others in a collective until the process group's timeout. Before discovery, which may
    # take each rank a different while on a slow file system.
    given = path
    layout = path if isinstance(path, CheckpointLayout) else None
    path = layout.display_name if layout is not None else path
    arrive(groups, opts.arrival_timeout, f"loading {path}")
    if layout is None and not dp.active and not mp.active:
        layout = discover(path, trust_pickle=opts.trust_pickle)
    _agree_options(path, dp, mp, opts, flat)
    err = None
    if layout is None:
        layout, err = _discover_once(given, dp, mp, opts)
    topo, strategy = _agree_checkpoint(path, dp, mp, opts, flat, layout, err)
    if opts.digest:  # before a byte is read: a set that records no digest cannot be checked
        # Imported here: hashing (BLAKE3) and the claims' readers are no plain load's cost.
        from ._digest_check import Hashing, check as check_digests, claims_missing, settle_digest, with_claims

        error = None
        try:
            layout = with_claims(layout)
            error = claims_missing(layout, path)
        except Exception as e:  # reported collectively
            error = e
        settle_digest(groups, error, f"loading {path}: finding the recorded digests")
    checked = 0
    reader = None
    try:
        targets, structure, wants = _targets_and_wants(path, dp, mp, opts, flat, layout, strategy, topo,
                                                       structure_from, make_wants)
        part, ranges = _plan(path, dp, mp, opts, flat, layout, targets, wants, topo)
        total = sum(w.out.numel() * w.out.element_size() for w in wants)
        if layout is not None:
            # verify=True reads the files again through torch (a mapping): the cache keeps them for it
            reader = _reader(opts, part, dp, alone=dp.size == 1 and mp.size == 1 and launched_alone() and not opts.sums)
        # Logged before the bar appears: a line printed under it would break it.
        if dp.rank == 0 and mp.rank == 0 and (dp.active or mp.active or logger.isEnabledFor(logging.INFO)):
            logger.info("oneload: %s: strategy=%s (%s)", path, part.strategy, part.reason)
        progress, bar = progress_bar(opts.progress, total, dp.global_rank)
        for g in groups:
            g.at(f"loading {path}: reading")
        advance = counting(progress, total)
        hashing = Hashing(reader, layout) if opts.digest and layout is not None else None
        with bar:
            error, sums, moved = execute(part, dp, targets, wants, ranges, hashing or reader, opts.settings.shm_dir,
                                         opts.sums, advance)
            if error is None and advance is not None:
                advance.finish()
        settle(groups, error, f"loading {path}: reading")
        if opts.digest:
            for g in groups:
                g.at(f"loading {path}: checking digests")
            error, checked = check_digests(dp, mp, layout, hashing, topo.readers, reader, path)
            settle_digest(groups, error, f"loading {path}: checking digests")
        if opts.sums:
            for g in groups:
                g.at(f"loading {path}: verifying")
            error = _verify(dp, part, len(topo.readers) < topo.dp_size, targets, wants, sums, ranges, reader, opts)
            settle(groups, error, f"loading {path}: verifying")
    finally:
        if reader is not None:
            reader.close()
    plan = LoadPlan(path=str(path), kind=layout.kind if layout else "unknown",
                    saved_model_parallel=layout.model_parallel_size if layout else 0,
                    saved_shards=layout.shards_per_part if layout else 0, saved_flat=layout.flat if layout else False,
                    world=dp.size * mp.size, model_parallel=mp.size, flat=flat,
                    model_bytes=layout.total_bytes if layout else 0, parts=(part,))
    report = LoadReport(
        path=str(path), kind=plan.kind, saved_model_parallel=plan.saved_model_parallel, saved_shards=plan.saved_shards,
        saved_flat=plan.saved_flat, target_model_parallel=mp.size, target_world=dp.size, flat=flat,
        strategy=part.strategy, reason=part.reason, bytes_read=reader.bytes_read if reader is not None else 0,
        bytes_out=total, seconds=time.perf_counter() - t0, verified=opts.sums, digests_checked=checked,
        warnings=layout.warnings if layout else (), bytes_received=moved.get("received", 0),
        bytes_from_other_nodes=moved.get("from_other_nodes", 0), bytes_sent=moved.get("sent", 0), plan=plan)
    return layout, targets, structure, report


# Below this many bytes read by a rank, its reads go one after the other on the calling
# thread: starting the reader's pool and handing it the pieces costs more than overlapping
# them saves (bench/fixed_cost.py: an 8 MiB load read serially takes the time preadv does,
# with the pools 1.5x that; serial was ahead up to 32 MiB on the 2-CPU machine measured).
SERIAL_READ_BYTES = 32 << 20


def _reader(opts: Options, part: PartPlan, dp: Group, alone: bool) -> RangeReader:
    """(local) This rank's reader: the settings' pool of threads, or the serial reader where
    the plan has it read little. ``alone``: the load has no other rank and no launcher
    started other processes on this host, so no other reader of these files shares their
    page cache (O_DIRECT may be chosen per piece)."""
    mine = [r.bytes_read for r in part.ranks if r.data_parallel_rank == dp.rank]
    # $METASEQ_ONELOAD_READ_THREADS set by the user is taken as it is, small loads included
    serial = opts.settings.read_threads is None and bool(mine) and mine[0] < SERIAL_READ_BYTES
    return RangeReader(chunk_bytes=opts.chunk_bytes, trust_pickle=opts.trust_pickle, settings=opts.settings,
                       read_threads=1 if serial else None, alone=alone)


# --------------------------------------------------------------------------- agreement


def problems(dp: Group, mp: Group) -> Optional[str]:
    """What is wrong with the groups as this rank sees them (checked before any read)."""
    if dp.active and mp.active and dp.size > 1 and mp.size > 1:
        shared = set(dp.members()) & set(mp.members())
        if shared != {dp.global_rank}:
            return (f"the data-parallel group [{cap_list(dp.members())}] and the model-parallel group "
                    f"[{cap_list(mp.members())}] share ranks [{cap_list(sorted(shared))}]; they must meet in this rank only "
                    "(pass process_group=<data-parallel group>, model_parallel_group=<model-parallel group>)")
    return None


def _agree_options(path, dp: Group, mp: Group, opts: Options, flat: bool) -> None:
    """(collective over both groups) Agree on the groups, the options and the settings that
    choose collectives (a broken grid must not reach a collective it cannot finish)."""
    pre = {"rank": dp.global_rank, "mp_rank": mp.rank, "asked": opts.asked(flat, mp.size, dp.size),
           "problem": problems(dp, mp), "settings": opts.settings.agreed()}
    for g in (dp, mp):
        g.at(f"loading {path}: agreeing on the options")
    dp_pre = dp.all_gather_json(pre) if dp.active else [pre]
    mp_pre = mp.all_gather_json(pre) if mp.active else [pre]
    differ = (disagreement([i["settings"] for i in dp_pre], [i["rank"] for i in dp_pre])
              or disagreement([i["settings"] for i in mp_pre], [i["rank"] for i in mp_pre]))
    error = OptionError(differ) if differ else None
    try:
        for i in dp_pre + mp_pre:
            if i["problem"] and error is None:
                raise ValueError(f"rank {i['rank']}: {i['problem']}")
        for infos, what in ((dp_pre, "data-parallel"), (mp_pre, "model-parallel")):
            odd = [i for i in infos if i["asked"] != infos[0]["asked"]]
            if odd and error is None:
                raise ValueError(
                    f"ranks of one {what} group called with different options: rank {infos[0]['rank']} "
                    f"{infos[0]['asked']} vs rank {odd[0]['rank']} {odd[0]['asked']} (strategy, flat, bucket_mb, "
                    "chunk_mb, verify, qkv, dtype, model-parallel size, data-parallel size); pass the same on every rank.")
        if len({i["mp_rank"] for i in dp_pre}) > 1 and error is None:
            raise ValueError(
                "the ranks of this data-parallel group hold different model-parallel parts "
                f"({cap_list(sorted({(i['rank'], i['mp_rank']) for i in dp_pre}))}): process_group must join ranks that hold "
                "the same part (Megatron's data-parallel group), model_parallel_group the parts of one replica.")
    except Exception as e:
        error = e
    try:
        settle((dp, mp), error, f"loading {path}: agreeing on the options")
    except OneloadError:
        if differ:  # every rank that saw the difference names it as it is: an option error
            e = OptionError(differ)
            e.settled = True
            raise e from None
        raise


def _discover_once(path, dp: Group, mp: Group, opts: Options) -> tuple:
    """(collective over both groups) (layout or None, the error that stood in its way).

    One rank (rank 0 of both groups) reads the headers; it sends the frozen description
    down the data-parallel group of model part 0, then along each model-parallel group.
    Every other rank checks, by name, size and modification time only, that it sees the
    same files under its own path (no file opened), and discovers on its own only where it
    does not (a missing mount: blind; other files: the agreement step says which ranks
    differ). Header reads summed over the ranks are then the set's file count, whatever
    the world size (not the file count times the world size)."""
    coordinator = dp.rank == 0 and mp.rank == 0
    layout, err, payload = None, None, None
    if coordinator:
        try:
            layout = discover(path, trust_pickle=opts.trust_pickle)
        except Exception as e:  # reported collectively by the caller
            err = e
        payload = b"E"  # the others discover on their own
        if layout is not None:
            try:
                payload = b"L" + layout_to_wire(layout, path)
            except Exception:  # noqa: BLE001  (a layout that does not travel: each rank reads it)
                pass
    for g in (dp, mp):
        g.at(f"loading {path}: sending the layout")
    if mp.rank == 0:
        payload = dp.broadcast_bytes(payload)
    payload = mp.broadcast_bytes(payload)
    if coordinator:
        return layout, err
    if payload[:1] == b"L":
        try:
            return adopt(payload[1:], path, trust_pickle=opts.trust_pickle), None
        except Exception:  # noqa: BLE001  not what the coordinator sees (or not here): see for itself
            pass
    try:
        return discover(path, trust_pickle=opts.trust_pickle), None
    except Exception as e:  # reported collectively by the caller
        return None, e


def _agree_checkpoint(path, dp: Group, mp: Group, opts: Options, flat: bool, layout, err) -> tuple:
    """(collective over both groups) Every rank's view of the files, gathered: (the
    topology of this rank's data-parallel group, the strategy it will take)."""
    # Whether this rank's reads go through a page cache its node's ranks share.
    cache = {"shared": False, "why": "", "avail": -1}
    if layout is not None and dp.active and dp.size > 1:  # only ranks that may share bytes ask
        try:  # never raise before the gather: the others would wait for this rank in it
            # (auto, None: a rank among others reads through the cache)
            cache = page_cache_view([f.path for f in layout.all_files], direct=opts.settings.o_direct is True)
        except Exception as e:  # noqa: BLE001
            cache["why"] = f"its page cache could not be checked ({type(e).__name__}: {e})"
    info = {
        "rank": dp.global_rank,
        "ok": layout is not None,
        "blind": isinstance(err, CheckpointNotFoundError),
        "fp": layout.fingerprint() if layout is not None else None,
        "err": None if err is None else clip(f"{type(err).__name__}: {err}"),
        "desc": "" if layout is None else f"{layout.display_name} {layout.model_parallel_size}x{layout.shards_per_part}",
        "node": node_key(opts.settings.node),
        "cache": cache,
    }
    for g in (dp, mp):
        g.at(f"loading {path}: agreeing on the checkpoint")
    dp_infos = dp.all_gather_json(info) if dp.active else [info]
    mp_infos = mp.all_gather_json(info) if mp.active else [info]
    blind = [i for i in dp_infos if not i["ok"]]
    topo = Topology(model_parallel=mp.size, ranks=tuple(i["rank"] for i in dp_infos),
                    nodes=tuple(i["node"] for i in dp_infos),
                    readers=tuple(d for d, i in enumerate(dp_infos) if i["ok"]),
                    caches=tuple(i["cache"] for i in dp_infos),
                    shm=opts.settings.shm and dp.device.type == "cpu",  # shared memory is host memory
                    why_blind=blind[0]["err"] if blind else "")
    strategy, error = None, None
    try:
        if err is not None and isinstance(err, (OneloadError, OSError)) and all(not i["ok"] for i in dp_infos):
            raise err
        check_views(dp_infos)
        strategy, _ = choose(opts.strategy, topo, layout, flat)
        if len({i["fp"] for i in mp_infos if i["ok"]}) > 1:
            seen = [f"rank {i['rank']}: {i['desc']}" for i in mp_infos if i["ok"]]
            raise CheckpointLayoutError(
                "ranks of different model-parallel parts see different checkpoint files (" + cap_list(seen, 4, sep="; ") + ")."
            )
    except Exception as e:
        error = e
    settle((dp, mp), error, f"loading {path}: agreeing on the checkpoint")
    return topo, strategy


# --------------------------------------------------------------------------- targets and the plan


def _targets_and_wants(path, dp: Group, mp: Group, opts: Options, flat: bool, layout, strategy: str, topo: Topology,
                       structure_from: Optional[Mapping], make_wants: Callable) -> tuple:
    """(collective over both groups) This part's targets (planned by every rank that sees
    the files, sent by the reader to those that take them from it) and this rank's wants."""
    targets, structure, error = None, None, None
    try:
        if layout is not None and (strategy != "broadcast" or dp.rank == 0):
            # (with parallel, every rank that sees the files plans: it reads with its own paths)
            targets = plan_targets(layout, mp.size, mp.rank, qkv=opts.qkv, rules=opts.rules, dtype=opts.dtype)
            if flat:
                structure = flat_structure(layout, targets, structure_from)
    except Exception as e:
        error = e
    settle((dp, mp), error, f"loading {path}: planning")
    error = None
    if strategy == "broadcast" or (strategy == "parallel" and len(topo.readers) < topo.dp_size):
        dp.at(f"loading {path}: sending the targets from the reader")
        payload = None
        if dp.rank == 0:
            try:
                payload = _spec(targets, structure)
            except Exception as e:  # still send something: the others are waiting for it
                error, payload = e, json.dumps({"error": f"{type(e).__name__}: {e}"}).encode()
        payload = dp.broadcast_bytes(payload)
        if dp.rank != 0 and (strategy == "broadcast" or layout is None):
            try:
                targets, structure = _unspec(payload)
            except Exception as e:
                error = e
    wants = None
    try:
        if error is None:
            wants = resolve_aliases(make_wants(targets, structure, layout), targets)
    except Exception as e:
        error = e
    settle((dp, mp), error, f"loading {path}: matching the target")
    return targets, structure, wants


def _plan(path, dp: Group, mp: Group, opts: Options, flat: bool, layout, targets, wants, topo: Topology) -> tuple:
    """(collective over ``dp``) (this part's plan, every rank's wanted ranges).

    Every rank's wants are gathered; data-parallel rank 0 plans and sends the plan to the
    others. Only it is sure to hold the stored pieces (ranks that cannot see the files, and
    the receivers of a broadcast, hold the targets' shapes only), and the plan's byte
    accounting reads their offsets; the others execute the value they receive."""
    mine = {"ranges": want_ranges(wants),
            "direct": [w.out.dtype == targets[w.name].dtype and w.out.is_contiguous() and w.out.device == dp.device
                       for w in wants]}
    dp.at(f"loading {path}: planning who reads what")
    gathered = dp.all_gather_json(mine) if dp.active else [mine]
    ranges, direct = [g["ranges"] for g in gathered], [g["direct"] for g in gathered]
    part, error, payload = None, None, None
    if dp.rank == 0:
        try:
            part = plan_part(layout, targets, ranges, direct, topo, opts, flat, mp.rank)
            if dp.active and dp.size > 1:  # only sent to the group's other ranks
                payload = to_wire(part)
        except Exception as e:  # still send something: the others are waiting for it
            error, payload = e, json.dumps({"error": f"{type(e).__name__}: {e}"}).encode()
    if dp.active and dp.size > 1:
        payload = dp.broadcast_bytes(payload)
        if dp.rank != 0:
            try:
                if payload.startswith(b'{"error"'):
                    error = PeerFailure("the reader could not plan the load")
                else:
                    part = from_wire(payload)
            except Exception as e:
                error = e
    settle((dp, mp), error, f"loading {path}: planning who reads what")
    return part, ranges


def _spec(targets: Mapping[str, TargetTensor], structure: Optional[FlatStructure]) -> bytes:
    """What receivers without files need to know about the targets (no paths)."""
    return json.dumps({
        "targets": [[t.name, list(t.shape), str(t.dtype).replace("torch.", ""), t.alias_of] for t in targets.values()],
        "structure": None if structure is None else {
            "groups": [[g.fsdp_path, g.flat_name, list(g.names), [list(s) for s in g.shapes],
                        [list(p) for p in g.shared]] for g in structure.groups],
            "buffers": list(structure.buffer_names),
        },
    }).encode()


def _unspec(payload: bytes) -> tuple:
    obj = json.loads(payload)
    targets = OrderedDict(
        (n, TargetTensor(n, tuple(shape), getattr(torch, dtype), (), alias))
        for n, shape, dtype, alias in obj["targets"]
    )
    structure = None
    if obj["structure"] is not None:
        structure = FlatStructure(
            tuple(FlatGroup(p, f, tuple(names), tuple(tuple(s) for s in shapes), tuple(tuple(x) for x in shared))
                  for p, f, names, shapes, shared in obj["structure"]["groups"]),
            tuple(obj["structure"]["buffers"]),
        )
    return targets, structure


def resolve_aliases(wants: Sequence[Want], targets: Mapping[str, TargetTensor]) -> list:
    """Wants of a tied name become wants of its source (the only one read or sent); every
    want must name a target and lie inside it."""
    out = []
    for w in wants:
        t = targets.get(w.name)
        if t is None:
            raise StateDictMismatchError(f"{w.name}: wanted, but the checkpoint has no such tensor.")
        if t.alias_of is not None:
            w = Want(t.alias_of, w.start, w.out)
            t = targets[t.alias_of]
        if not 0 <= w.start <= w.stop <= t.numel:
            raise StateDictMismatchError(f"{w.name}: elements {w.start}..{w.stop} wanted, the tensor has {t.numel}.")
        out.append(w)
    return out


# --------------------------------------------------------------------------- progress


def progress_bar(enabled, total: int, rank: int):
    """(callback taking (bytes done, bytes in all) or None, the context the load runs in)."""
    if callable(enabled):
        return enabled, contextlib.nullcontext()
    if enabled is None:
        enabled = rank == 0 and sys.stderr.isatty() and total >= (256 << 20)
    if not enabled:
        return None, contextlib.nullcontext()
    from tqdm import tqdm

    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="oneload", leave=False)
    return (lambda done, _total: bar.update(done - bar.n)), _logging_through(bar)


@contextlib.contextmanager
def _logging_through(bar):
    """The bar, with console log records written through it (tqdm.write) while it shows:
    a line logged mid-read would otherwise break it on a terminal."""
    from tqdm.contrib.logging import logging_redirect_tqdm

    with bar, logging_redirect_tqdm():
        yield bar


# --------------------------------------------------------------------------- verify


class _MmapReader:
    """Reads the same elements through ``torch.load(mmap=True)``: the independent path
    ``verify=True`` checks the byte arithmetic against."""

    def __init__(self, inner: RangeReader):
        self.inner = inner
        self.chunk_bytes = inner.chunk_bytes

    def read_extent(self, ext, start, out, dtype):
        out.copy_(self.inner.read_from_mmap(ext, start, out.numel()))


def _fingerprint(target: TargetTensor, start: int, stop: int, reader, chunk_bytes: int,
                 dtype: Optional[torch.dtype] = None) -> float:
    """float64 sum of ``target`` elements ``start..stop`` read through ``reader``, as they
    look once cast to ``dtype`` (the destination's; default the target's)."""
    size = torch.empty((), dtype=target.dtype).element_size()
    step = max(1, min(chunk_bytes, _SUM_SCRATCH) // size)
    # One scratch buffer, reused: a fresh chunk-sized buffer per step is a fresh mapping from
    # malloc (above its threshold), and its page faults cost more than the sums.
    scratch = _scratch(target.dtype, min(step, stop - start))
    total = 0.0
    for lo in range(start, stop, step):
        hi = min(stop, lo + step)
        tmp = scratch[: hi - lo]
        fill(target, tmp, lo, reader)
        total += sum64(tmp if dtype in (None, target.dtype) else tmp.to(dtype))
    return total


_SUM_SCRATCH = 8 << 20
_scratches: dict = {}  # (pid, thread, dtype) -> buffer


def _scratch(dtype: torch.dtype, numel: int) -> torch.Tensor:
    key = (os.getpid(), threading.get_ident(), dtype)
    buf = _scratches.get(key)
    if buf is None or buf.numel() < numel:
        buf = _scratches[key] = torch.empty(max(numel, 1), dtype=dtype)
    return buf


def _close(a: float, b: float, n: int) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9 * max(1, n))


def _verify(dp: Group, part: PartPlan, blind: bool, targets, wants, sums, ranges, reader,
            opts: Options) -> Optional[BaseException]:
    """(collective over ``dp`` where the reader sums for others) This rank's verify failure,
    or None. Ranks that received from the reader without reading (a broadcast, pieces sent
    to ranks that cannot see the files) have the reader compute their sums."""
    if not (part.mode in ("broadcast", "scatter") or (part.mode == "exchange" and blind)):
        try:
            mm = _MmapReader(reader)
            for w in wants:
                got = sum64(w.out)
                exp = _fingerprint(targets[w.name], w.start, w.stop, mm, opts.chunk_bytes, w.out.dtype)
                if not _close(got, exp, w.out.numel()):
                    raise OneloadError(f"verify: {w.name}[{w.start}:{w.stop}]: loaded sum {got!r} != source sum {exp!r}")
        except Exception as e:
            return e
        return None
    whole = part.mode == "broadcast"
    # The reader computes what arrived or should have, through torch's own reading of the
    # files, and tells the others; it always sends, so no one waits on a failed reader.
    payload, error = None, None
    if dp.rank == 0:
        try:
            mm = _MmapReader(reader)
            if whole:
                expected = {n: _fingerprint(t, 0, t.numel, mm, opts.chunk_bytes)
                            for n, t in targets.items() if t.alias_of is None}
            else:
                expected = [[_fingerprint(targets[n], a, b, mm, opts.chunk_bytes, getattr(torch, dt))
                             for rr in r.values() for n, a, b, dt, _ in rr] for r in ranges]
            payload = json.dumps({"expected": expected}).encode()
        except Exception as e:
            error, payload = e, json.dumps({"error": f"{type(e).__name__}: {e}"}).encode()
    payload = json.loads(dp.broadcast_bytes(payload))
    if error is not None:
        return error
    if "error" in payload:
        return PeerFailure(f"verify: the reader could not compute the source sums ({payload['error']})")
    return _compare(dp, whole, payload["expected"], targets, wants, sums, ranges)


def _compare(dp: Group, whole: bool, expected, targets, wants, sums, ranges) -> Optional[BaseException]:
    try:
        if whole:
            for n, got in sums.items():
                if not _close(got, expected[n], targets[n].numel):
                    raise OneloadError(f"verify: {n}: received sum {got!r} != source sum {expected[n]!r}")
        else:
            mine = [w for rr in ranges[dp.rank].values() for w in rr]
            for (n, a, b, _, k), exp in zip(mine, expected[dp.rank]):
                got = sum64(wants[k].out)
                if not _close(got, exp, b - a):
                    raise OneloadError(f"verify: {n}[{a}:{b}]: received sum {got!r} != source sum {exp!r}")
    except Exception as e:
        return e
    return None
