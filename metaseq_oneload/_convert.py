"""Offline conversion: any checkpoint layout to any other, on disk, in bounded memory.

Three verbs (the command line in :mod:`.cli` runs them):

``convert(path, dst, model_parallel=M, shards=N)``
    Rewrites a checkpoint as M model-parallel parts x N FSDP shards, with metaseq's file
    names, a ``cfg`` that tells the truth about the new layout and, for flat shards, the
    ``shard_metadata`` fairscale writes (zero padding at the tail). The optimizer state
    (Adam's ``exp_avg``/``exp_avg_sq`` ...) is resharded exactly like the weights when its
    shapes allow, or dropped with a note.
``consolidate(path, dst)``
    The same, into one unflattened file (M = N = 1).
``verify(path, other)``
    Compares two checkpoints of any layouts tensor by tensor, streaming both (:mod:`._verify`).

What each output file holds is decided in :mod:`._conversion` (the optimizer state mapped
onto the parameters in :mod:`._optim`); this module runs the verb: options, destination,
jobs, commit. Nothing holds the model: each output storage is a list of read items that the
one executor (``_execute.stream``: exactly the byte ranges a chunk needs, from whichever
source files hold them) carries out chunk by chunk into a file that ``torch.save`` laid out
with holes (:mod:`._writing`). Peak memory is about ``3 x chunk`` per parallel job, whatever
the model size. Outputs appear under their final names only when all of them are complete
(:mod:`._outputs`).

File names (``P`` the destination prefix)::

    flat (FSDP shards, any M x N)      P-model_part-{m}-shard{d}.pt   what metaseq writes and loads
    unflattened, M > 1                 P-model_part-{m}.pt           metaseq's model-parallel parts
    unflattened, 1 x 1                 P.pt                          a consolidated checkpoint

Every file of one output set carries the same save identity (:data:`._conversion.SAVE_KEY`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from ._conversion import KEEP_FLAT, Conversion, Output, wrapping_metadata
from ._digest_record import with_stored_digests
from ._dcp_write import write_dcp
from ._errors import ConversionError, DigestError, OptionError, OutputExistsError
from ._layout import CheckpointLayout, FileName
from ._options import check_option
from ._outputs import OutputSet, check_space, local_destination
from ._plan import plan_part
from ._reading import RangeReader, read_header
from ._verify import TensorDiff, VerifyReport, verify
from ._writing import Cancelled, Meter
from .formats import discover

__all__ = [
    "ConvertReport",
    "TensorDiff",
    "VerifyReport",
    "convert",
    "consolidate",
    "verify",
    "output_paths",
    "DTYPE_BY_NAME",
    "ConversionError",
    "OutputExistsError",
]

FORMATS = ("torch", "safetensors", "dcp")
DTYPE_BY_NAME = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16,
                 "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
_MiB = 1 << 20
# One job holds its write buffer, the reader's dtype staging and a row block of a
# row-parallel weight: three chunks at most.
_CHUNKS_PER_JOB = 3


# --------------------------------------------------------------------------- reports


@dataclass(frozen=True)
class ConvertReport:
    """What :func:`convert` wrote, for logs, the CLI table and ``--json``."""

    src: str
    source: str  # e.g. "1x3 flat"
    dst: str  # the destination prefix
    model_parallel: int
    shards: int
    flat: bool
    format: str
    files: tuple  # final paths, [part][shard] flattened in that order
    sidecars: tuple  # the JSON metadata next to each safetensors file
    optimizer: str  # "carried", "dropped" or "absent"
    bytes_written: int
    bytes_read: int
    tensors: int
    seconds: float
    jobs: int
    chunk_bytes: int
    notes: tuple = field(default=())
    removed: tuple = field(default=())  # stale temporary files and replaced files of an older set
    # The output's content (model) digest as recorded beside it (docs/digest.md), hashed while
    # writing; None where not recorded (outputs of several model parts: see the notes).
    digest: Optional[str] = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)



# --------------------------------------------------------------------------- names


def output_paths(dst: str, model_parallel: int, shards: int, flat: bool, format: str = "torch") -> list:
    """The files a conversion writes, ``[part][shard]`` (see the module docstring)."""
    ext = ".pt" if format == "torch" else ".safetensors"
    if flat:
        return [[f"{dst}-model_part-{m}-shard{d}{ext}" for d in range(shards)] for m in range(model_parallel)]
    if shards != 1:
        raise ValueError(f"unflattened outputs hold one file per model part, not {shards} shards.")
    if model_parallel == 1:
        return [[f"{dst}{ext}"]]
    return [[f"{dst}-model_part-{m}{ext}"] for m in range(model_parallel)]


def _sidecar(path: str) -> str:
    return path[: -len(".safetensors")] + ".json"


def _resolve_dst(dst: "str | os.PathLike", layout: CheckpointLayout) -> str:
    p = local_destination(dst)
    if p.endswith(os.sep) or os.path.isdir(p):
        p = os.path.join(p, os.path.basename(layout.prefix))
    for ext in (".pt", ".safetensors"):
        if p.endswith(ext):
            p = p[: -len(ext)]
    if not os.path.basename(p):
        raise ValueError(f"{dst!r}: expected a destination prefix such as /out/checkpoint_last.")
    return os.path.abspath(p)


def _older_members(prefix: str, finals: Sequence[str]) -> list:
    """Files of an earlier checkpoint under the same prefix that the new set does not
    overwrite (another layout): left in place they would mix with the new files."""
    directory, base = os.path.split(prefix)
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    out = []
    for n in names:
        stem = n
        for ext in (".safetensors", ".json"):
            if n.endswith(ext):
                stem = n[: -len(ext)] + ".pt"
        parsed = FileName.parse(stem)
        full = os.path.join(directory, n)
        if parsed is not None and parsed.prefix == base and full not in finals and not os.path.isdir(full):
            out.append(full)
    return out



# --------------------------------------------------------------------------- the verb


# consolidate has no flat option: the way there is convert.
_KEEP_FLAT_CONSOLIDATE = ("convert(path, dst, flat=True) (CLI: metaseq-oneload convert SRC DST --flat) keeps the "
                          "output flat and carries it")


def _parse_budget(value: Any) -> Optional[int]:
    """Bytes from an int or a size such as "512M", "2G", "1.5GiB"."""
    if value is None or isinstance(value, int):
        return value
    s = str(value).strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    try:
        if s and s[-1] in mult:
            return int(float(s[:-1]) * mult[s[-1]])
        return int(float(s))
    except ValueError:
        raise OptionError(f"memory_budget={value!r} (CLI: --memory-budget {value}): expected a number of bytes or a "
                          "size such as 512M or 2G.") from None




def convert(
    path: "str | os.PathLike",
    dst: "str | os.PathLike",
    *,
    model_parallel: Optional[int] = None,
    shards: Optional[int] = None,
    flat: Optional[bool] = None,
    format: str = "torch",
    drop_optimizer: bool = False,
    overwrite: bool = False,
    jobs: Optional[int] = None,
    memory_budget: "int | str | None" = None,
    chunk_mb: float = 64,
    dtype: "torch.dtype | str | None" = None,
    qkv: str = "auto",
    wrapping: "Mapping | str | os.PathLike | None" = None,
    trust_pickle: bool = False,
    progress: "Optional[bool] | Callable[[int, int], None]" = None,
) -> ConvertReport:
    """(local, one process; no process group) Rewrite a checkpoint in another layout.

    Args:
        path: any file of the source checkpoint, its folder, its un-suffixed name or a glob.
        dst: the destination prefix (``/out/checkpoint_last``; a trailing ``.pt`` is
            dropped; an existing folder means "the source's prefix inside it").
        model_parallel: model-parallel parts M of the output (default: the source's).
        shards: FSDP shards N per part (default: the source's).
        flat: write fairscale flat-parameter shards with ``shard_metadata``. Default: flat
            when N > 1, or when the source is flat with the same N; unflattened otherwise.
            Unflattened outputs have one file per part (N must be 1).
        format: "torch" (metaseq's files), "safetensors" (weights as safetensors plus a
            JSON sidecar of everything else; the optimizer state is dropped) or "dcp" (a
            ``torch.distributed.checkpoint`` folder ``dst`` of the model's weights, ``shards``
            files split along dim 0, default 1: :mod:`._dcp_write`).
        drop_optimizer: leave ``last_optimizer_state`` out.
        overwrite: replace existing destination files (and remove other files of an older
            checkpoint under the same prefix). A source file is never written over.
        jobs: output files written concurrently (default: the CPU count, bounded by the
            file count and ``memory_budget``).
        memory_budget: bytes (or "2G", "512M") that all jobs together may hold for
            buffers (default 1 GiB). Each job holds about three ``chunk_mb`` chunks.
        chunk_mb: the I/O chunk.
        dtype: cast the weights (``torch.float16``, "bf16", ...); the optimizer state keeps its dtype.
        qkv: "auto" (metaseq's fused ``qkv_proj``), "fused" or "split" (k/v/q_proj,
            unflattened outputs only).
        wrapping: for a flat output from an unflattened source, the FSDP wrapping to follow:
            fairscale's ``local_metadata_dict()`` or a flat shard file that carries one.
            Default: metaseq's (each ``*.layers.N`` its own FSDP instance).
        trust_pickle: unpickle the source without the allowlist (unsafe).
        progress: a progress bar (default: when stderr is a terminal), or a callable that
            receives (bytes written so far, bytes in all), called from the writer threads.

    Returns:
        A :class:`ConvertReport`.

    Raises:
        OutputExistsError: a destination file exists (without ``overwrite``) or is a source file.
        CheckpointLayoutError: the source is incomplete or cannot be split as asked.
        ConversionError, ValueError: the request itself is inconsistent.

    Example::

        convert("/ckpt/checkpoint_last.pt", "/out/checkpoint_last", model_parallel=2, shards=4)
    """
    t0 = time.perf_counter()
    budget, dtype = _check_options(model_parallel=model_parallel, shards=shards, jobs=jobs, chunk_mb=chunk_mb,
                                   memory_budget=memory_budget, format=format, dtype=dtype)
    if format == "dcp":  # a torch.distributed.checkpoint folder at dst (_dcp_write)
        chunk, n_jobs = _sizes(budget, chunk_mb, jobs, shards or 1)
        return ConvertReport(**write_dcp(path, dst, model_parallel=model_parallel, shards=shards, flat=flat,
                                         wrapping=wrapping, dtype=dtype, qkv=qkv, overwrite=overwrite,
                                         chunk_bytes=chunk, jobs=n_jobs, progress=progress, trust_pickle=trust_pickle),
                             seconds=time.perf_counter() - t0)
    layout = discover(path, trust_pickle=trust_pickle)
    M, N, flat = _output_layout(layout, model_parallel, shards, flat, qkv, wrapping)
    prefix = _resolve_dst(dst, layout)
    _refuse_own_prefix(prefix, layout, M, N)
    grid = output_paths(prefix, M, N, flat, format)
    outs = [Output(m, d, p, _sidecar(p) if format == "safetensors" else None)
            for m, row in enumerate(grid) for d, p in enumerate(row)]
    finals = [o.path for o in outs] + [o.sidecar for o in outs if o.sidecar]
    protected = [f.path for f in layout.all_files] + [os.path.join(layout.directory, a) for a in layout.aliases]
    outputs = OutputSet(finals, overwrite=overwrite, protected=protected,
                        replaces=_older_members(prefix, finals), lock=prefix)
    conv = Conversion(layout, model_parallel=M, shards=N, flat=flat, fmt=format, drop_optimizer=drop_optimizer,
                      dtype=dtype, qkv=qkv, wrapping=wrapping_metadata(wrapping, trust_pickle),
                      trust_pickle=trust_pickle)
    meter = None
    # After planning: a request that cannot be met leaves no empty folder behind. From here
    # to the commit the destination's lock is held (abort lets it go).
    outputs.check()
    try:
        chunk, n_jobs = _sizes(budget, chunk_mb, jobs, len(outs))
        if conv.read_whole:
            # One job and one reader for all outputs: each whole-read source file is loaded once.
            n_jobs = 1
            conv.shared_reader = RangeReader(chunk_bytes=chunk, trust_pickle=trust_pickle)
            if not any("read whole" in n for n in conv.notes):
                conv.notes.append("source files that cannot be range-read (legacy or compressed format) are read "
                                  "whole, once: one job")
        stale = outputs.clean_stale()
        total_bytes, total_tensors = conv.total_bytes(), conv.total_tensors()
        check_space(os.path.dirname(prefix), finals, total_bytes)
        meter = Meter(progress, total_bytes, total_tensors, "convert")
        written, read = _write_all(conv, outs, outputs, chunk, n_jobs, meter)
        recorded = _recorded_digests(conv)
        if format == "safetensors":
            conv.write_sidecars(outputs, recorded)
        outputs.commit()
        index_problem = _write_index([o.path for o in outs], format, conv, recorded)  # still under the lock
    except BaseException:
        outputs.abort()
        raise
    finally:
        outputs.release()
        if meter is not None:
            meter.close()
        if conv.shared_reader is not None:
            conv.shared_reader.close()
    notes = list(conv.notes) + list(outputs.notes) + [f"source: {w}" for w in layout.warnings]
    if index_problem:
        notes.append(index_problem)
    return ConvertReport(
        src=layout.display_name,
        source=f"{layout.model_parallel_size}x{layout.shards_per_part} {'flat' if layout.flat else 'unflattened'}",
        dst=prefix, model_parallel=M, shards=N, flat=flat, format=format,
        files=tuple(o.path for o in outs), sidecars=tuple(o.sidecar for o in outs if o.sidecar),
        optimizer=conv.optimizer_status, bytes_written=written, bytes_read=read, tensors=total_tensors,
        seconds=time.perf_counter() - t0, jobs=n_jobs, chunk_bytes=chunk, notes=tuple(notes),
        removed=tuple(stale) + tuple(outputs.removed),
        digest=(recorded.get("content") or {}).get("model") if recorded else None,
    )


def _check_options(*, model_parallel, shards, jobs, chunk_mb, memory_budget, format, dtype) -> tuple:
    """(memory budget in bytes, dtype): the options checked before anything is read."""
    for name, value in (("model_parallel", model_parallel), ("shards", shards), ("jobs", jobs), ("chunk_mb", chunk_mb)):
        check_option(name, value)
    budget = _parse_budget(memory_budget)
    if budget is not None and budget <= 0:
        raise OptionError(f"memory_budget={memory_budget!r} (CLI: --memory-budget {memory_budget}): expected a "
                          "positive size such as 512M or 2G. Nothing was read or written.")
    if format not in FORMATS:
        raise OptionError(f"format={format!r}: expected one of {', '.join(FORMATS)}.")
    if isinstance(dtype, str):
        if dtype.lower() not in DTYPE_BY_NAME:
            raise OptionError(f"dtype={dtype!r}: expected one of {', '.join(sorted(DTYPE_BY_NAME))}.")
        dtype = DTYPE_BY_NAME[dtype.lower()]
    return budget or (1 << 30), dtype


def _output_layout(layout: CheckpointLayout, model_parallel, shards, flat, qkv: str, wrapping) -> tuple:
    """(M, N, flat) of the output, or the reason the request cannot be met."""
    M = layout.model_parallel_size if model_parallel is None else int(model_parallel)
    N = layout.shards_per_part if shards is None else int(shards)
    if M < 1 or N < 1:
        raise OptionError(f"model_parallel={M}, shards={N}: both must be at least 1.")
    if flat is None:
        flat = N > 1 or (layout.flat and N == layout.shards_per_part)
    if not flat and N > 1:
        raise OptionError(
            f"shards={N} with flat=False: metaseq's sharded state is FSDP flat parameters, and unflattened "
            "weights are not split into shards. Use flat=True (CLI: --flat) or shards=1 (CLI: --shards 1)."
        )
    if flat and qkv == "split":
        raise OptionError("qkv='split' applies to unflattened outputs; flat parameters keep metaseq's fused qkv_proj.")
    if flat and layout.flavor == "pytorch" and not layout.flat and wrapping is None:
        raise ConversionError(
            f"{layout.display_name}: a bare state dict carries no FSDP wrapping; pass wrapping=SHARD.pt (CLI: "
            "--wrapping SHARD.pt), a flat shard (or, in Python, fairscale's local_metadata_dict()) to follow, or "
            "write unflattened weights: flat=False (CLI: --unflat)."
        )
    return M, N, flat


def _refuse_own_prefix(prefix: str, layout: CheckpointLayout, M: int, N: int) -> None:
    if os.path.join(os.path.realpath(os.path.dirname(prefix)), os.path.basename(prefix)) == os.path.join(
            os.path.realpath(layout.directory), os.path.basename(layout.prefix)):
        raise OutputExistsError(
            f"{prefix}: the destination prefix is the source checkpoint's own; a conversion never writes over "
            "or beside its source under the same name. Choose another prefix (e.g. "
            f"{prefix}_mp{M}x{N}) or another folder."
        )


def _sizes(budget: int, chunk_mb: float, jobs: Optional[int], files: int) -> tuple:
    """(chunk bytes, jobs): each job holds about three chunks, all together ``budget``."""
    chunk = max(1 << 20, int(chunk_mb * _MiB))
    if budget < _CHUNKS_PER_JOB * chunk:
        chunk = max(1 << 16, budget // _CHUNKS_PER_JOB)
    n_jobs = max(1, min(int(jobs) if jobs else (os.cpu_count() or 1), files, budget // (_CHUNKS_PER_JOB * chunk)))
    return chunk, n_jobs


def _write_all(conv: Conversion, outs: Sequence[Output], outputs: OutputSet, chunk: int, n_jobs: int,
               meter: Meter) -> tuple:
    """(local) Every output under its temporary name, ``n_jobs`` at a time; the first
    failure cancels the others (they stop at their next chunk). Returns (written, read)."""
    cancel = threading.Event()
    futures: list = []
    pending: set = set()
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=n_jobs, thread_name_prefix="oneload-convert") as pool:
            try:
                futures = [pool.submit(conv.write, o, outputs, chunk, meter, cancel) for o in outs]
                pending = set(futures)
                while pending:
                    done, pending = concurrent.futures.wait(pending, timeout=0.5,
                                                            return_when=concurrent.futures.FIRST_EXCEPTION)
                    if any(f.exception() is not None for f in done):
                        break
            finally:
                if any(f.done() and f.exception() is not None for f in futures) or pending:
                    cancel.set()
                concurrent.futures.wait(futures)
    except BaseException:
        cancel.set()
        raise
    errors = [f.exception() for f in futures if f.exception() is not None]
    real = [e for e in errors if not isinstance(e, Cancelled)]
    if real or errors:
        raise (real or errors)[0]
    results = [f.result() for f in futures]
    return sum(w for w, _ in results), sum(r for _, r in results)


def _recorded_digests(conv: Conversion) -> Optional[dict]:
    """(local) ``{"stored": {(part, name): digest}, "content": {...} or None}`` hashed while
    the outputs were written, or None (and a note) if a tensor's bytes did not all pass."""
    try:
        content = conv.digests.canonical_digests()
        if content is not None:
            content["by"] = "metaseq-oneload convert"
        return {"stored": conv.digests.stored_digests(), "content": content}
    except DigestError as e:  # never a wrong claim: record none
        conv.notes.append(f"no digests recorded: {e}")
        return None


def _write_index(files: Sequence[str], format: str, conv: Optional[Conversion] = None,
                 recorded: Optional[dict] = None) -> Optional[str]:
    """Leave the index of a torch-format output beside it (formats/_index), so that loads
    of it read no header, with the digests hashed while writing; None when written, else why
    not (the output is complete without one)."""
    if format != "torch" or not files:
        return None
    from .formats import _index

    try:
        written = discover(files[0])
        save = read_header(files[0]).get("oneload_save")
        content = None
        if recorded is not None and conv is not None:
            written = with_stored_digests(written, recorded["stored"], conv.digests)
            content = recorded["content"]
            why = conv.digests.mismatch(plan_part(written, 1, 0)) if content else None
            if why:  # recorded only where it describes what a load of the output returns
                conv.notes.append(f"no content digest recorded: {why}")
                content = recorded["content"] = None
        _index.write(written, save_id=save.get("save_id") if isinstance(save, Mapping) else None, content=content)
    except Exception as e:  # the checkpoint itself is written and complete
        return f"no index written beside the output ({type(e).__name__}: {e}); loads read the headers instead"
    return None


def consolidate(path: "str | os.PathLike", dst: "str | os.PathLike", **kwargs) -> ConvertReport:
    """(local, one process) Write ``path`` as one unflattened checkpoint file ``dst``
    (``X.pt``; ``X.safetensors`` and ``X.json`` with ``format="safetensors"``): :func:`convert` with
    ``model_parallel=1, shards=1, flat=False``. Other keyword arguments as there.

    Flat FSDP optimizer state cannot follow into unflattened parameters and is dropped
    (metaseq's ``consolidate_fsdp_shards`` drops it too).
    """
    for k in ("model_parallel", "shards", "flat"):
        if k in kwargs:
            raise TypeError(f"consolidate() sets {k} itself; use convert() for other layouts.")
    dst = os.fspath(dst)
    if not dst.endswith((".pt", ".safetensors")) and not (dst.endswith(os.sep) or os.path.isdir(dst)):
        raise OptionError(f"{dst}: expected a file name ending in .pt (or .safetensors), or an existing folder.")
    r = convert(path, dst, model_parallel=1, shards=1, flat=False, **kwargs)
    return dataclasses.replace(r, notes=type(r.notes)(n.replace(KEEP_FLAT, _KEEP_FLAT_CONSOLIDATE) for n in r.notes))
