"""Writing ``torch.distributed.checkpoint`` folders: ``convert(path, dst, format="dcp")``.

What a folder holds (what ``dcp.save(model.state_dict())`` with torch's ``FileSystemWriter``
and its default torch.save serialization writes on N ranks)::

    DST/__{r}_0.distcp   r < N (``shards``, default 1): chunk r of every tensor along dim 0,
                         split as ``torch.chunk`` (FSDP2's ``Shard(0)``) splits it; 0-d
                         tensors and empty chunks: rank 0's file, none
    DST/.metadata        a pickle of torch's own ``Metadata``: per tensor its dtype, size
                         and chunks; ``planner_data`` (name -> (name,), what the default
                         planner's flattening records); ``storage_data``
                         (``MetadataIndex`` -> ``_StorageInfo``: file, offset, length);
                         ``storage_meta``; version "1.0.0"

Each item of a ``.distcp`` file is a complete torch.save archive of one chunk, back to back
(each starting on a 64-byte boundary, so that its data record is aligned in the file too),
written by the zip writer of ``.pt`` outputs (:func:`._writing.append_torch`): the archive is
laid out with holes, then its data record is streamed in by the one executor, chunk by chunk.
The names are the model's logical tensors with metaseq's names, model-parallel parts merged
(what ``consolidate`` writes), so ``dcp.load(model.state_dict(), checkpoint_id=DST)`` loads
them into a plain model or an FSDP2 one at any world size. A tied name (metaseq's
``decoder.output_projection.weight``) is an entry of its own pointing at the bytes of the
name it is tied to: stored once, loaded under both names.

Not carried: the optimizer state, ``cfg``, meters and other non-tensor values (a report's
notes say so when the source had them).

Peak memory, whatever the model size: ``jobs x 3 x chunk_bytes`` (per job: the executor's
buffer, the reader's dtype staging and a row block, as for every ``convert``) plus the
metadata, ``O(tensors x shards)`` small objects (a few hundred bytes each). ``jobs`` is at
most ``shards`` (one job per file).

Files appear under their final names only when all are complete, ``.metadata`` last
(:class:`._outputs.OutputSet`: exclusive creation, never through a link, the commit journal
``DST/..metadata.oneload-commit``, ``overwrite`` semantics and the destination lock
``DST/..metadata.oneload-lock``). With ``overwrite``, the files of an older save in ``DST``
that the new one does not replace are removed: those its ``.metadata`` lists and those named
as torch names them (``__{rank}_{n}.distcp``), never another ``*.distcp`` nor through a link.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import pickle
import re
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from ._dcp_meta import read_metadata
from ._digest_record import WriteDigests, canonical_routes
from ._errors import OneloadError, OptionError, OutputExistsError
from ._execute import ReadItem
from ._layout import CheckpointLayout
from ._optim import state_of
from ._outputs import OutputSet, check_space, destination_error, local_destination, open_for_writing, write_new
from ._plan import plan_part
from ._reading import RangeReader, read_header
from ._threads import check_signals
from ._writing import Cancelled, Meter, Record, append_torch, executor_chunks, storage_key
from .formats import discover

__all__ = ["DcpItem", "plan_items", "dcp_files", "write_dcp", "METADATA"]

METADATA = ".metadata"
_ALIGN = 64
# What one item adds to its file beyond its data: the archive's pickle, zip headers and
# directory, and the alignment (1.5 KiB for torch 2.13's archive of one tensor).
_ITEM_OVERHEAD = 2048
# torch's own names for the files of a save (FileSystemWriter: __{rank}_{n}.distcp): only
# these and the files the older .metadata lists are an older save's, never a user's x.distcp.
_OLDER = re.compile(r"^(?:__\d+_\d+\.distcp|__\d+\.metadata)$")


@dataclass(frozen=True)
class DcpItem:
    """One chunk of one tensor, as one archive of ``.distcp`` file ``file``: rows
    ``offsets[0] .. offsets[0] + sizes[0]`` (all of the other dims), elements
    ``start .. stop`` of the flattened tensor ``name``."""

    name: str
    file: int
    index: int  # its place in the tensor's chunk list (MetadataIndex's hint)
    offsets: tuple
    sizes: tuple
    start: int
    stop: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return (self.stop - self.start) * torch.empty((), dtype=self.dtype).element_size()


def plan_items(targets: dict, shards: int) -> list:
    """(local) The items of each of ``shards`` files, ``[file][k]``, in the targets' order:
    every tensor that is not a tied alias, split along dim 0 as ``torch.chunk`` splits it."""
    files: list = [[] for _ in range(shards)]
    for name, t in targets.items():
        if t.alias_of is not None:
            continue
        shape = tuple(t.shape)
        if not shape:
            files[0].append(DcpItem(name, 0, 0, (), (), 0, 1, t.dtype))
            continue
        rows, row = shape[0], t.numel // shape[0] if shape[0] else 0
        step = -(-rows // shards) if rows else 0
        index = 0
        for r in range(shards):
            r0, r1 = min(rows, r * step), min(rows, (r + 1) * step)
            if r1 > r0 or (rows == 0 and r == 0):
                files[r].append(DcpItem(name, r, index, (r0,) + (0,) * (len(shape) - 1),
                                        (r1 - r0,) + shape[1:], r0 * row, r1 * row, t.dtype))
                index += 1
    return files


def dcp_files(dst: str, shards: int) -> list:
    """The files of a DCP folder of ``shards`` files, ``.metadata`` last."""
    return [os.path.join(dst, f"__{r}_0.distcp") for r in range(shards)] + [os.path.join(dst, METADATA)]


def _check(layout: CheckpointLayout, path: Any, dst: Any, *, model_parallel, shards, flat, wrapping) -> tuple:
    """(destination folder, shards): the request checked before anything is written."""
    if model_parallel not in (None, 1):
        raise OptionError(
            f"model_parallel={model_parallel} with format='dcp': a torch.distributed.checkpoint folder holds each "
            "tensor whole, by name (model-parallel parts merged; dcp.load reshards it onto any world). Leave "
            "model_parallel out (CLI: --model-parallel), or write format='torch' (CLI: --format torch).")
    if flat:
        raise OptionError("flat=True (CLI: --flat) with format='dcp': a torch.distributed.checkpoint folder holds "
                          "the model's tensors by name, not fairscale flat parameters. Leave flat out (CLI: --flat).")
    if wrapping is not None:
        raise OptionError("wrapping= (CLI: --wrapping) applies to flat outputs; a format='dcp' folder has no FSDP "
                          "wrapping. Leave it out.")
    n = 1 if shards is None else int(shards)
    if n < 1:
        raise OptionError(f"shards={n}: expected at least 1 file.")
    folder = os.path.abspath(local_destination(dst))
    if folder.endswith((".pt", ".safetensors", ".distcp", METADATA)):
        raise OptionError(f"{dst}: a format='dcp' output is a folder (DST/.metadata and DST/__0_0.distcp ...); "
                          "name a folder, e.g. /out/checkpoint_dcp.")
    if os.path.lexists(folder) and not os.path.isdir(folder):
        raise OutputExistsError(f"{folder}: exists and is not a folder; a format='dcp' output is a folder. Choose "
                                "another destination.")
    given = os.path.abspath(os.fspath(path))
    given = given if os.path.isdir(given) else os.path.dirname(given)
    if os.path.isdir(folder) and any(os.path.isdir(d) and os.path.samefile(folder, d)
                                     for d in (layout.directory, given)):
        raise OutputExistsError(
            f"{folder}: the folder of the source checkpoint; a DCP folder written there would mix with the source "
            "(discovery could no longer tell which checkpoint the folder holds). Choose another folder.")
    return folder, n


def _older(folder: str, finals: Sequence[str]) -> list:
    """Files of an earlier DCP save in ``folder`` that the new one does not overwrite."""
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    listed: set = set()
    if METADATA in names:
        try:
            listed = {i.relative_path for i in read_metadata(os.path.join(folder, METADATA)).items.values()}
        except OneloadError:
            pass  # a damaged .metadata lists nothing: torch's own names only
    older = [os.path.join(folder, n) for n in names if (_OLDER.match(n) or n in listed)
             and os.path.join(folder, n) not in finals]
    links = [f for f in older if os.path.islink(f)]
    if links:
        raise OutputExistsError(
            f"{links[0]} is a link, named as a file of an older DCP save in {folder}, which --overwrite would remove "
            "(found a link, expected a file): it is left alone. Remove or move it yourself, or convert into a new "
            "folder (CLI: DST).")
    return [f for f in older if not os.path.isdir(f)]


def _optimizer_status(layout: CheckpointLayout, notes: list) -> str:
    if layout.flavor == "dcp":  # what a DCP source holds beside the model, its layout names
        beside = [n for n in layout.notes if "not read" in n]
        notes += [f"not carried from the source: {n}" for n in beside]
        return "dropped" if beside else "absent"
    # Only torch files have a header that can hold one (not safetensors, nor .distcp items).
    headers = [f.path for f in layout.all_files if f.format != "safetensors"]
    if not any(state_of(read_header(p, trust_pickle=layout.trust_pickle)) is not None for p in headers):
        return "absent"
    notes.append("optimizer state dropped: the dcp output holds the model's weights; use format='torch' "
                 "(CLI: --format torch) to keep it")
    return "dropped"


def write_dcp(path: Any, dst: Any, *, model_parallel: Optional[int], shards: Optional[int], flat: Optional[bool],
              wrapping: Any, dtype: Optional[torch.dtype], qkv: str, overwrite: bool, chunk_bytes: int, jobs: int,
              progress: Any, trust_pickle: bool) -> dict:
    """(local, one process) Write checkpoint ``path`` as a DCP folder ``dst`` (module
    docstring); returns the fields of a ``ConvertReport`` but ``seconds``. ``convert`` checked
    the other options (dtype, sizes) and calls this for ``format="dcp"``.

    Raises:
        OptionError: a layout option that has no meaning for a DCP folder.
        OutputExistsError: a destination file exists (without ``overwrite``), or ``dst`` is
            the source's own folder.
    """
    layout = discover(path, trust_pickle=trust_pickle)
    folder, n = _check(layout, path, dst, model_parallel=model_parallel, shards=shards, flat=flat, wrapping=wrapping)
    targets = plan_part(layout, 1, 0, qkv=qkv, dtype=dtype)
    items = plan_items(targets, n)
    digests = WriteDigests()  # the content digest, hashed as the bytes pass (_digest_record)
    if canonical_routes(digests, plan_part(layout, 1, 0, dtype=dtype), targets):
        digests.drop_canonical()
    finals = dcp_files(folder, n)
    protected = [f.path for f in layout.all_files] + [os.path.join(layout.directory, a) for a in layout.aliases]
    outputs = OutputSet(finals, overwrite=overwrite, protected=protected, replaces=_older(folder, finals),
                        lock=os.path.join(folder, METADATA))
    notes: list = []
    optimizer = _optimizer_status(layout, notes)
    created = not os.path.isdir(folder)
    outputs.check()
    meter = shared = None
    try:
        stale = outputs.clean_stale()
        total = sum(i.nbytes for f in items for i in f)
        check_space(folder, finals, total + _ITEM_OVERHEAD * sum(map(len, items)))
        meter = Meter(progress, total, sum(map(len, items)), "convert")
        if any(f.format not in ("zip", "safetensors", "distcp") for f in layout.all_files):
            # Sources that cannot be range-read are read whole: once, through one reader.
            jobs, shared = 1, RangeReader(chunk_bytes=chunk_bytes, trust_pickle=trust_pickle)
        jobs = max(1, min(jobs, n))
        spans, written, read = _write_files(items, targets, outputs, finals, chunk_bytes, jobs, meter, shared,
                                            trust_pickle, digests.tap(0))
        metadata = _metadata(targets, items, spans, folder)
        try:
            write_new(outputs.temp(finals[-1]), pickle.dumps(metadata))
        except OSError as e:
            raise destination_error(finals[-1], e) from e
        check_signals(commit=True)  # interrupted: the old set stays whole (its .metadata included)
        if overwrite:
            # torch's loader knows no commit journal: an older .metadata left in place while
            # the .distcp files are renamed would point it at offsets of files now replaced.
            # Gone first, a cut commit leaves a folder nobody loads, never a wrong one.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(finals[-1])
        outputs.commit()
    except BaseException:
        outputs.abort()
        if created:
            with contextlib.suppress(OSError):
                os.rmdir(folder)  # only if empty: what this call created and nothing else
        raise
    finally:
        outputs.release()
        if meter is not None:
            meter.close()
        if shared is not None:
            shared.close()
    notes += outputs.notes + [f"source: {w}" for w in layout.warnings]
    if n > 1:
        notes.append(f"{n} files, each tensor split along dim 0 as FSDP2 on {n} ranks splits it")
    digest = _content_digest(digests, notes)
    return dict(
        src=layout.display_name,
        source=f"{layout.model_parallel_size}x{layout.shards_per_part} {'flat' if layout.flat else 'unflattened'}",
        dst=folder, model_parallel=1, shards=n, flat=False, format="dcp", files=tuple(finals), sidecars=(),
        optimizer=optimizer, bytes_written=written, bytes_read=read, tensors=sum(map(len, items)), jobs=jobs,
        chunk_bytes=chunk_bytes, notes=tuple(notes), removed=tuple(stale) + tuple(outputs.removed),
        digest=digest)


def _content_digest(digests: WriteDigests, notes: list) -> Optional[str]:
    """The folder's content digest hashed while writing (reported; a DCP folder has no place
    of its own for it), or None with a note."""
    try:
        content = digests.canonical_digests()
    except OneloadError as e:
        notes.append(f"no content digest: {e}")
        return None
    return content["model"] if content else None


def _write_files(items: list, targets: dict, outputs: OutputSet, finals: Sequence[str], chunk_bytes: int, jobs: int,
                 meter: Meter, shared: Optional[RangeReader], trust_pickle: bool, tap: Any = None) -> tuple:
    """(local) Every ``.distcp`` file under its temporary name, ``jobs`` at a time; the first
    failure stops the others at their next chunk. Returns ({(name, index): (file, offset,
    length)}, bytes written, bytes read)."""
    cancel = threading.Event()

    def one(r: int) -> tuple:
        if cancel.is_set():
            raise Cancelled()
        reader = shared or RangeReader(chunk_bytes=chunk_bytes, trust_pickle=trust_pickle)
        before = reader.bytes_read
        try:
            spans, n = _write_file(items[r], outputs.temp(finals[r]), finals[r], targets, reader, chunk_bytes,
                                   meter, cancel, tap)
            return spans, n, reader.bytes_read - before
        finally:
            if shared is None:
                reader.close()

    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="oneload-dcp") as pool:
        futures = [pool.submit(one, r) for r in range(len(items))]
        try:
            for f in concurrent.futures.as_completed(futures):
                if f.exception() is not None:
                    break
        finally:
            if any(f.done() and f.exception() is not None for f in futures):
                cancel.set()
            concurrent.futures.wait(futures)
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        raise next((e for e in errors if not isinstance(e, Cancelled)), errors[0])
    spans: dict = {}
    written = read = 0
    for f in futures:
        s, w, r = f.result()
        spans.update(s)
        written, read = written + w, read + r
    return spans, written, read


def _write_file(items: Sequence[DcpItem], tmp: str, final: str, targets: dict, reader, chunk_bytes: int,
                meter: Meter, cancel: threading.Event, tap: Any = None) -> tuple:
    """(local, one worker thread) One ``.distcp`` file: each item an archive of its chunk,
    streamed by the executor. Returns ({(name, index): (file name, offset, length)}, bytes)."""
    chunks = executor_chunks(targets, reader, chunk_bytes, tap=tap)
    spans, written, base = {}, 0, os.path.basename(final)
    try:
        with os.fdopen(open_for_writing(tmp), "r+b") as f:
            for it in items:
                start = -(-f.tell() // _ALIGN) * _ALIGN
                f.seek(start)
                placeholder = torch.empty(it.sizes, dtype=it.dtype)  # never touched: its bytes are streamed
                record = Record((ReadItem(it.name, it.start, it.stop),), it.dtype)
                written += append_torch(f, tmp, placeholder, {storage_key(placeholder): record}, chunks,
                                        progress=meter, cancel=cancel)
                spans[(it.name, it.index)] = (base, start, f.tell() - start)
            os.fsync(f.fileno())
    except OSError as e:
        if isinstance(e, OneloadError):
            raise
        raise destination_error(final, e) from e
    return spans, written


def _metadata(targets: dict, items: list, spans: dict, folder: str) -> Any:
    """torch's ``Metadata`` of the folder: the one file torch's loader reads first."""
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta,
                                                       TensorProperties, TensorStorageMetadata)

    chunks: dict = {}
    for f in items:
        for it in f:
            chunks.setdefault(it.name, []).append(it)
    state, planner, storage = {}, {}, {}
    for name, t in targets.items():
        own = t.alias_of or name
        pieces = sorted(chunks.get(own, ()), key=lambda i: i.index)
        state[name] = TensorStorageMetadata(
            properties=TensorProperties(dtype=t.dtype), size=torch.Size(t.shape),
            chunks=[ChunkStorageMetadata(offsets=torch.Size(i.offsets), sizes=torch.Size(i.sizes)) for i in pieces])
        planner[name] = (name,)
        for i in pieces:
            file, offset, length = spans[(own, i.index)]
            storage[MetadataIndex(name, i.offsets, i.index)] = _StorageInfo(file, offset, length)
    return Metadata(state_dict_metadata=state, planner_data=planner, storage_data=storage,
                    storage_meta=StorageMeta(checkpoint_id=folder, save_id=str(uuid.uuid4())),
                    version=CURRENT_DCP_VERSION)
