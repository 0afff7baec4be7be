"""Offline conversion: any checkpoint layout to any other, on disk, in bounded memory.

Three verbs (the command line in :mod:`.cli` runs them):

``convert(src, dst_prefix, model_parallel=M, shards=N)``
    Rewrites a checkpoint as M model-parallel parts x N FSDP shards, with metaseq's file
    names, a ``cfg`` that tells the truth about the new layout and, for flat shards, the
    ``shard_metadata`` fairscale writes (zero padding at the tail). The optimizer state
    (Adam's ``exp_avg``/``exp_avg_sq`` ...) is resharded exactly like the weights when its
    shapes allow, or dropped with a note.
``consolidate(src, dst)``
    The same, into one unflattened file (M = N = 1).
``verify(a, b)``
    Compares two checkpoints of any layouts tensor by tensor, streaming both (:mod:`._verify`).

The optimizer state is mapped onto the parameters in :mod:`._optim`, bytes are written in
:mod:`._writing`; this module decides what each output file holds. Nothing holds the model: each output storage is produced chunk by chunk (``_execute.fill``
reads exactly the byte ranges a chunk needs from whichever source files hold them) and
written in place into a file that ``torch.save`` laid out with holes (:mod:`._writing`). Peak
memory is about ``3 x chunk`` per parallel job, whatever the model size. Outputs appear
under their final names only when all of them are complete.

File names (``P`` the destination prefix)::

    flat (FSDP shards, any M x N)      P-model_part-{m}-shard{d}.pt   what metaseq writes and loads
    unflattened, M > 1                 P-model_part-{m}.pt           metaseq's model-parallel parts
    unflattened, 1 x 1                 P.pt                          a consolidated checkpoint

Every file of one output set carries the same save identity, so that files of two saves at
the same step cannot be mixed into one load unnoticed: a top-level key of the checkpoint dict
(``SAVE_KEY``)::

    "oneload_save": {"save_id": "<uuid4 hex, one per output set>", "parts": M, "shards": N}

(safetensors outputs: in the JSON sidecar, and as a JSON string under the same key in the
file's ``__metadata__``). An unflattened output of a bare state dict stays bare and carries
none (its report's notes say so).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import copy
import dataclasses
import json
import math
import os
import re
import shutil
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from ._errors import OneloadError, StateDictMismatchError
from ._layout import CheckpointLayout, FileName, is_interpolation, raw_get, raw_keys
from .formats import discover
from ._execute import fill as fill_target
from ._loading import OptionError, check_option
from ._optim import (OptimizerPlan, carry_extra_state, flat_pieces, plan_optimizer, rank_state, rest_source,
                     same_weights_layout, state_of)
from ._plan import FlatGroup, FlatStructure, TargetTensor, flat_shard_range, plan_part
from ._reading import RangeReader, load_object, read_header
from ._verify import TensorDiff, VerifyReport, verify
from ._writing import (Cancelled, ConversionError, OutputExistsError, OutputSet, Piece, Record, destination_error,
                       progress_bar, storage_key, write_json, write_safetensors, write_torch)

__all__ = [
    "ConvertReport",
    "TensorDiff",
    "VerifyReport",
    "convert",
    "consolidate",
    "verify",
    "output_paths",
    "ConversionError",
    "OutputExistsError",
]

FORMATS = ("torch", "safetensors")
_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16,
           "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
_LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")
_SIDECAR_FORMAT = "metaseq-oneload/safetensors-sidecar/1"
SAVE_KEY = "oneload_save"
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
    dst_prefix: str
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

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------- names


def output_paths(dst_prefix: str, model_parallel: int, shards: int, flat: bool, format: str = "torch") -> list:
    """The files a conversion writes, ``[part][shard]`` (see the module docstring)."""
    ext = ".pt" if format == "torch" else ".safetensors"
    if flat:
        return [[f"{dst_prefix}-model_part-{m}-shard{d}{ext}" for d in range(shards)] for m in range(model_parallel)]
    if shards != 1:
        raise ValueError(f"unflattened outputs hold one file per model part, not {shards} shards.")
    if model_parallel == 1:
        return [[f"{dst_prefix}{ext}"]]
    return [[f"{dst_prefix}-model_part-{m}{ext}"] for m in range(model_parallel)]


def _sidecar(path: str) -> str:
    return path[: -len(".safetensors")] + ".json"


def _checkpoint_suffix(model_parallel: int, shards: int, flat: bool, part: int) -> str:
    return "" if (not flat and model_parallel == 1) else f"-model_part-{part}"


def _resolve_dst(dst_prefix: "str | os.PathLike", layout: CheckpointLayout) -> str:
    p = os.fspath(dst_prefix)
    if p.endswith(os.sep) or os.path.isdir(p):
        p = os.path.join(p, os.path.basename(layout.prefix))
    for ext in (".pt", ".safetensors"):
        if p.endswith(ext):
            p = p[: -len(ext)]
    if not os.path.basename(p):
        raise ValueError(f"{dst_prefix!r}: expected a destination prefix such as /out/checkpoint_last.")
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


# --------------------------------------------------------------------------- structure


def _metaseq_wrapping(targets: Mapping[str, TargetTensor], buffers: set) -> FlatStructure:
    """metaseq's FSDP wrapping for an unflattened source: every ``*.layers.{i}`` module is
    its own FSDP instance, the rest (embeddings, final layer norm) is the root's flat param;
    a tied weight is recorded in the ``shared_param_info`` of the instance holding its source."""
    root: list = []
    nested: "OrderedDict[str, list]" = OrderedDict()
    shared: dict = {}
    for n, t in targets.items():
        if t.alias_of is not None:
            m = _LAYER.match(t.alias_of)
            shared.setdefault(m.group(1) if m else "", []).append((t.alias_of, n))
            continue
        if n in buffers:
            continue
        m = _LAYER.match(n)
        (nested.setdefault(m.group(1), []) if m else root).append(n)
    groups = []
    if root:
        groups.append(FlatGroup("", "flat_param_0", tuple(root), tuple(targets[n].shape for n in root),
                                tuple(shared.get("", ()))))
    for path, names in nested.items():
        groups.append(FlatGroup(path, "flat_param_0", tuple(names), tuple(targets[n].shape for n in names),
                                tuple(shared.get(path, ()))))
    return FlatStructure(tuple(groups), tuple(n for n in targets if n in buffers))


def _wrapping_metadata(wrapping: Any, trust_pickle: bool) -> Optional[Mapping]:
    if wrapping is None or isinstance(wrapping, Mapping):
        return wrapping
    header = read_header(os.fspath(wrapping), trust_pickle=trust_pickle)
    md = header.get("shard_metadata") if isinstance(header, Mapping) else None
    if not isinstance(md, Mapping) or "param_metadata" not in md:
        raise ConversionError(
            f"{wrapping}: holds no shard_metadata; expected a flat FSDP shard whose wrapping the output "
            "should follow (any shard of a metaseq checkpoint written with use_sharded_state)."
        )
    return md


# --------------------------------------------------------------------------- cfg


def _put(container: Any, key: str, value: Any, *, add: bool) -> None:
    if container is None:
        return
    if isinstance(container, argparse.Namespace):
        if hasattr(container, key):
            setattr(container, key, value)
        return
    try:
        from omegaconf import DictConfig, open_dict

        if isinstance(container, DictConfig):
            if add or key in raw_keys(container):  # (``in`` on a DictConfig resolves the value)
                with open_dict(container):
                    container[key] = value
            return
    except ImportError:
        pass
    if isinstance(container, dict) and (add or key in container):
        container[key] = value


def _section(cfg: Any, name: str) -> Any:
    """A cfg section as stored, never resolved; None where it is an interpolation."""
    section = raw_get(cfg, name)
    return None if is_interpolation(section) else section


def _truthful(obj: dict, *, model_parallel: int, shards: int, flat: bool, part: int, shard: int) -> None:
    """Update, in place, what a checkpoint's ``cfg`` (and old ``args``) says about its layout."""
    world = model_parallel * shards
    for cfg in (obj.get("cfg"), ):
        if cfg is None:
            continue
        common, ckpt, dist = _section(cfg, "common"), _section(cfg, "checkpoint"), _section(cfg, "distributed_training")
        _put(common, "model_parallel_size", model_parallel, add=True)
        _put(ckpt, "model_parallel_size", model_parallel, add=False)
        _put(ckpt, "checkpoint_shard_count", 1, add=True)
        _put(ckpt, "checkpoint_suffix", _checkpoint_suffix(model_parallel, shards, flat, part), add=False)
        _put(dist, "use_sharded_state", flat, add=True)
        _put(dist, "distributed_world_size", world, add=True)
        _put(dist, "distributed_rank", shard * model_parallel + part, add=False)
        if flat:
            _put(dist, "ddp_backend", "fully_sharded", add=True)
    for ns in (_section(obj.get("cfg"), "model"), obj.get("args")):
        _put(ns, "model_parallel_size", model_parallel, add=False)
        _put(ns, "use_sharded_state", flat, add=False)
        _put(ns, "checkpoint_shard_count", 1, add=False)
        if flat:
            _put(ns, "ddp_backend", "fully_sharded", add=False)
    # metaseq's cfg.model keeps distributed_world_size=1 whatever the world (it is not read
    # from there); old fairseq ``args`` is the only place it lives.
    _put(obj.get("args"), "distributed_world_size", world, add=False)


# What one cfg/meters value may expand to in the JSON we write: real meters and cfgs are a
# few thousand values; a crafted one is bounded by this and by writing each shared
# container once (a 60-level DAG of shared lists pickles in a few hundred bytes and has
# 2**60 paths).
_JSON_MAX_VALUES = 200_000
_JSON_MAX_DEPTH = 64


def _jsonable(x: Any, *, max_values: int = _JSON_MAX_VALUES, max_depth: int = _JSON_MAX_DEPTH) -> Any:
    """cfg, meters and metadata as plain JSON (Namespace and DictConfig become objects), read
    raw: an interpolation stays its ``${...}`` text, never resolved. A container met again
    (shared, or a cycle) is written as a note naming where it was written first; past
    ``max_values`` values, or deeper than ``max_depth``, a value is a note saying so."""
    try:
        from omegaconf import DictConfig, ListConfig
    except ImportError:
        DictConfig = ListConfig = ()  # type: ignore[assignment,misc]
    budget = [max_values]
    # id -> (the container, kept alive so that its id is not reused, where it was written)
    seen: dict = {}

    def walk(x: Any, depth: int, path: tuple) -> Any:
        budget[0] -= 1
        if budget[0] < 0:
            return f"<left out: more than {max_values} values>"
        if depth > max_depth:
            return f"<left out: nested more than {max_depth} deep>"
        if x is None or isinstance(x, (bool, int, str)):
            return x
        if isinstance(x, float):
            return x if math.isfinite(x) else str(x)
        if isinstance(x, (DictConfig, ListConfig)) and x._is_interpolation():
            return x._value()
        if isinstance(x, (ListConfig, DictConfig, argparse.Namespace, Mapping, list, tuple, set, frozenset)):
            if id(x) in seen:
                where = ".".join(map(str, seen[id(x)][1]))[:200]
                return f"<the same object as {where or 'the top'}>"
            seen[id(x)] = (x, path)
            if isinstance(x, ListConfig):
                return [walk(raw_get(x, i), depth + 1, path + (i,)) for i in range(len(x._content or ()))]
            if isinstance(x, (DictConfig, argparse.Namespace, Mapping)):
                return {str(k): walk(raw_get(x, k), depth + 1, path + (k,)) for k in raw_keys(x)}
            return [walk(v, depth + 1, path + (i,)) for i, v in enumerate(x)]
        if torch.is_tensor(x):
            if x.numel() > 4096 or x.device.type == "meta":
                return {"tensor": list(x.shape), "dtype": str(x.dtype)}
            return walk(x.tolist(), depth + 1, path)
        if isinstance(x, torch.dtype):
            return str(x)
        if hasattr(x, "tolist"):  # numpy scalars and arrays
            if getattr(x, "size", 1) > 4096:
                return {"array": list(getattr(x, "shape", ())), "dtype": str(getattr(x, "dtype", ""))}
            return walk(x.tolist(), depth + 1, path)
        if hasattr(x, "value") and hasattr(x, "name"):  # enums
            return walk(x.value, depth + 1, path)
        return repr(x)[:1000]

    return walk(x, 0, ())


# --------------------------------------------------------------------------- the conversion


@dataclass(frozen=True)
class _Output:
    part: int
    shard: int
    path: str
    sidecar: Optional[str]


class _Conversion:
    """(local) Everything decided before the first byte is written, and the writer of one
    output file (called from worker threads, one file each)."""

    def __init__(self, layout: CheckpointLayout, *, model_parallel: int, shards: int, flat: bool, fmt: str,
                 drop_optimizer: bool, dtype: Optional[torch.dtype], qkv: str, wrapping: Optional[Mapping],
                 trust_pickle: bool):
        self.layout = layout
        self.M, self.N, self.flat, self.fmt = model_parallel, shards, flat, fmt
        self.trust_pickle = trust_pickle
        self.notes: list = []
        # One identity for every file of this output set, so that discovery can tell it from
        # files of another save at the same step (SAVE_KEY in the module docstring).
        self.save = {"save_id": uuid.uuid4().hex, "parts": model_parallel, "shards": shards}
        self._lock = threading.Lock()
        self._objects: dict = {}
        # Sources that cannot be range-read (legacy, compressed) are read whole: through one
        # reader shared by all outputs (one job), so each is loaded once, not once per output.
        self.read_whole = any(f.format not in ("zip", "safetensors") for f in layout.all_files)
        self.shared_reader: Optional[RangeReader] = None
        self.targets = [plan_part(layout, model_parallel, m, qkv=qkv, dtype=dtype) for m in range(model_parallel)]
        buffers = set(layout.parts[0].buffer_names)
        self.structures: list = []
        if flat:
            for t in self.targets:
                if wrapping is not None:
                    s = FlatStructure.from_metadata(wrapping)
                    s.check_against(t)
                elif layout.flat:
                    s = FlatStructure.from_layout(layout, t)
                else:
                    s = _metaseq_wrapping(t, buffers)
                for g in s.groups:
                    dts = {t[n].dtype for n in g.names}
                    if len(dts) > 1:
                        raise StateDictMismatchError(f"{g.key}: members have mixed dtypes {sorted(map(str, dts))}; "
                                                     "a flat parameter holds one dtype. Pass dtype= to cast.")
                self.structures.append(s)
            if wrapping is None and not layout.flat:
                self.notes.append("flat parameters follow metaseq's FSDP wrapping (each *.layers.N its own "
                                  "instance, the rest in the root's flat_param_0); pass wrapping=SHARD.pt "
                                  "(CLI: --wrapping SHARD.pt) to follow another model's")
        # Optimizer state.
        self.optimizer: Optional[OptimizerPlan] = None
        self.params: list = []
        has_state = any(state_of(read_header(f.path)) is not None for f in layout.all_files)
        if not has_state:
            self.optimizer_status = "absent"
        elif drop_optimizer:
            self.optimizer_status = "dropped"
            self.notes.append("optimizer state dropped (drop_optimizer); resume with --reset-optimizer")
        elif fmt == "safetensors":
            self.optimizer_status = "dropped"
            self.notes.append("optimizer state dropped: the safetensors output holds weights and metadata; "
                              "use format='torch' (CLI: --format torch) to keep it")
        elif layout.flat and not flat:
            self.optimizer_status = "dropped"
            self.notes.append("optimizer state dropped: flat FSDP optimizer state cannot be mapped onto "
                              "unflattened parameters (the flat shards do not record the module's parameter "
                              "order); " + _KEEP_FLAT)
        else:
            if flat:
                params = [[n for g in s.groups for n in g.names] for s in self.structures]
            else:
                params = [[n for n, t in tg.items() if t.alias_of is None and n not in buffers] for tg in self.targets]
            self.params = params
            self.optimizer, reason = plan_optimizer(layout, model_parallel, qkv, params, self.targets)
            if self.optimizer is None:
                self.optimizer_status = "dropped"
                self.notes.append(f"optimizer state dropped: {reason}")
            else:
                self.optimizer_status = "carried"
                self.notes.append(f"optimizer state carried ({', '.join(map(str, sorted(self.optimizer.aligned, key=str)))} "
                                  "resharded exactly like the weights)")
        # What of extra_state belongs to the saved layout only (the same rule as install()'s).
        self.same_parts = layout.model_parallel_size == model_parallel
        self.same_weights = [
            wrapping is None and same_weights_layout(layout, parts=model_parallel, shards=shards, flat=flat,
                                    structure=self.structures[m] if flat else None)
            for m in range(model_parallel)]
        header = read_header(layout.files[0][0].path, trust_pickle=trust_pickle)
        extra = header.get("extra_state") if isinstance(header, Mapping) else None
        for m in range(model_parallel):
            self.notes += [n for n in carry_extra_state(extra, same_parts=self.same_parts,
                                                        same_weights=self.same_weights[m])[1] if n not in self.notes]

    # -- which source file supplies cfg, meters and the rest
    def _extras_source(self, m: int, d: int) -> str:
        return rest_source(self.layout, m, self.M, d, self.N)

    def _source_object(self, path: str) -> Any:
        """The source file's object, loaded once for all outputs that take their cfg and
        meters from it: memory-mapped (tensor pages are read only if touched), or read whole
        where the format cannot be mapped. Shared between threads read-only: what an output
        changes (cfg, extra_state) is copied first."""
        with self._lock:
            obj = self._objects.get(path)
            if obj is None:
                obj = self._objects[path] = load_object(path, trust_pickle=self.trust_pickle, mmap=True)
            return obj

    def _model(self, m: int, d: int) -> tuple:
        """(model dict of placeholders, records, safetensors entries, tied aliases)."""
        targets = self.targets[m]
        model: "OrderedDict[str, torch.Tensor]" = OrderedDict()
        records: dict = {}
        entries: list = []
        tied = {}

        def add(name, shape, dtype, rec):
            t = torch.empty(shape, dtype=dtype)
            model[name] = t
            records[storage_key(t)] = rec
            entries.append((name, tuple(shape), dtype, rec))

        if not self.flat:
            for n, t in targets.items():
                if t.alias_of is None:
                    add(n, t.shape, t.dtype, Record((Piece(t, 0, t.numel, t.dtype),)))
            for n, t in targets.items():
                if t.alias_of is not None:
                    tied[n] = t.alias_of
            out = OrderedDict((n, model[n] if n in model else model[targets[n].alias_of]) for n in targets)
            return out, records, entries, tied
        s = self.structures[m]
        covered = {n for g in s.groups for n in g.names}
        items = []
        for g in s.groups:
            dtype = targets[g.names[0]].dtype if g.names else torch.float32
            pieces, size = flat_pieces(g, targets, d, self.N, dtype)
            items.append((g.key, (size,), dtype, Record(pieces)))
        for n, t in targets.items():
            if n in covered or t.alias_of is not None:
                continue
            items.append((n, t.shape, t.dtype, Record((Piece(t, 0, t.numel, t.dtype),))))
        for g in s.groups:
            for a, b in g.shared:
                tied[b] = a
        order = self._flat_order([i[0] for i in items], s)
        by_name = {i[0]: i for i in items}
        for name in order:
            add(*by_name[name])
        return model, records, entries, tied

    def _flat_order(self, names: Sequence[str], s: FlatStructure) -> list:
        """The source's key order where it has the same keys (fairscale's local_state_dict
        order: root flat params, root buffers, nested instances), else that order rebuilt."""
        L = self.layout
        if L.flat:
            header = read_header(L.files[0][0].path)
            src = list(header["model"] if isinstance(header.get("model"), Mapping) else header)
            rank = {n: i for i, n in enumerate(src)}
            known = [n for n in names if n in rank]
            if len(known) == len(names):
                return sorted(names, key=lambda n: rank[n])
        roots = [g.key for g in s.groups if not g.fsdp_path]
        rest = [n for n in names if n not in roots and n not in {g.key for g in s.groups}]
        return roots + rest + [g.key for g in s.groups if g.fsdp_path]

    def _optimizer_state(self, m: int, d: int, src_state: Mapping, records: dict) -> dict:
        """Output (m, d)'s ``last_optimizer_state`` (:func:`._optim.rank_state`, the layout
        install() materialises too): placeholders whose records stream the values."""

        def make(pieces: tuple, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
            t = torch.empty(shape, dtype=dtype)
            records[storage_key(t)] = Record(tuple(pieces))
            return t

        return rank_state(self.optimizer, m, src_state, make=make,
                          structure=self.structures[m] if self.flat else None, shard=d, shards=self.N,
                          params=None if self.flat else self.params[m])

    def build(self, m: int, d: int) -> tuple:
        """(object to save, records, safetensors entries, tied aliases) of output (m, d)."""
        src = self._source_object(self._extras_source(m, d))
        model, records, entries, tied = self._model(m, d)
        meta = self.structures[m].shard_metadata(d, self.N) if self.flat else None
        if not isinstance(src, Mapping) or not isinstance(src.get("model"), Mapping):
            if not self.flat:  # a bare state dict stays bare: no key of its own to carry the identity
                self._note(f"the output is a bare state dict, as its source: it carries no {SAVE_KEY} save identity")
                return model, records, entries, tied, meta
            return {"model": model, "shard_metadata": meta, SAVE_KEY: dict(self.save)}, records, entries, tied, meta
        obj: dict = {}
        for k, v in src.items():
            if k == "model":
                obj[k] = model
            elif k in ("shard_metadata", "fsdp_metadata"):
                continue
            elif k == "last_optimizer_state":
                if self.optimizer is not None and isinstance(v, Mapping):
                    obj[k] = self._optimizer_state(m, d, v, records)
            elif k in ("cfg", "args"):
                obj[k] = copy.deepcopy(v)  # updated below; the source object is shared
            elif k == "extra_state":
                obj[k] = carry_extra_state(v, same_parts=self.same_parts, same_weights=self.same_weights[m])[0]
            else:
                obj[k] = v
        if self.flat:
            obj["shard_metadata"] = meta
        obj[SAVE_KEY] = dict(self.save)  # this set's, never the source's (a source we wrote has one)
        _truthful(obj, model_parallel=self.M, shards=self.N, flat=self.flat, part=m, shard=d)
        return obj, records, entries, tied, meta

    def _note(self, note: str) -> None:
        with self._lock:
            if note not in self.notes:
                self.notes.append(note)

    def sidecar(self, m: int, d: int, obj: Any, tied: Mapping, path: str) -> dict:
        """The JSON written next to a safetensors file: which file, ties, and every other key."""
        rest = {k: v for k, v in obj.items() if k not in ("model", "last_optimizer_state")} if (
            isinstance(obj, Mapping) and isinstance(obj.get("model"), Mapping)) else {}
        return {
            "format": _SIDECAR_FORMAT,
            "weights": os.path.basename(path),
            "model_part": m,
            "shard": d,
            "model_parallel_size": self.M,
            "shards": self.N,
            "flat": self.flat,
            "tied": dict(tied),
            **{k: _jsonable(v) for k, v in rest.items()},
            SAVE_KEY: dict(self.save),  # also for a bare state dict, which cannot carry it itself
        }

    def total_bytes(self) -> int:
        """Tensor bytes all outputs will hold (the progress bar's total, the disk check)."""
        total = 0
        for m, t in enumerate(self.targets):
            if self.flat:
                for g in self.structures[m].groups:
                    if not g.names:
                        continue
                    item = torch.empty((), dtype=t[g.names[0]].dtype).element_size()
                    total += flat_shard_range(g.total_numel, 0, self.N)[2] * item * self.N
                covered = {n for g in self.structures[m].groups for n in g.names}
                total += sum(x.nbytes for n, x in t.items() if n not in covered and x.alias_of is None) * self.N
            else:
                total += sum(x.nbytes for x in t.values() if x.alias_of is None)
            if self.optimizer is not None:
                for k, planned in self.optimizer.targets[m].items():
                    item = torch.empty((), dtype=self.optimizer.dtypes[k]).element_size()
                    if self.flat:
                        total += sum(flat_shard_range(g.total_numel, 0, self.N)[2]
                                     for g in self.structures[m].groups) * item * self.N
                    else:
                        total += sum(planned[n].numel for n in self.params[m]) * item
        return total

    def total_tensors(self) -> int:
        """Storages all outputs will hold (the progress bar's tensor count)."""
        n = 0
        for m, t in enumerate(self.targets):
            if self.flat:
                covered = {x for g in self.structures[m].groups for x in g.names}
                per = len(self.structures[m].groups) + sum(1 for k, x in t.items() if k not in covered and x.alias_of is None)
                n += per * self.N
                if self.optimizer is not None:
                    n += len(self.optimizer.aligned) * len(self.structures[m].groups) * self.N
            else:
                n += sum(1 for x in t.values() if x.alias_of is None)
                if self.optimizer is not None:
                    n += len(self.optimizer.aligned) * len(self.params[m])
        return n

    def write(self, out: _Output, outputs: OutputSet, chunk_bytes: int, progress, cancel) -> tuple:
        """(local, one worker thread) Write output ``out`` under its temporary name.
        Returns (bytes written, bytes read)."""
        if cancel.is_set():
            raise Cancelled()
        shared = self.shared_reader is not None
        reader = self.shared_reader if shared else RangeReader(chunk_bytes=chunk_bytes, trust_pickle=self.trust_pickle)
        before = reader.bytes_read
        with contextlib.nullcontext(reader) if shared else reader:
            def fill(target, buf, start):
                fill_target(target, buf, start, reader)

            obj, records, entries, tied, meta = self.build(out.part, out.shard)
            tmp = outputs.temp(out.path)  # a ConversionError of its own if the folder refuses
            try:
                if self.fmt == "torch":
                    n = write_torch(tmp, obj, records, fill, chunk_bytes=chunk_bytes, progress=progress,
                                    cancel=cancel, trust_pickle=self.trust_pickle)
                else:
                    metadata = {"format": "pt", "metaseq_oneload": os.path.basename(out.sidecar),
                                SAVE_KEY: json.dumps(self.save, sort_keys=True)}
                    n = write_safetensors(tmp, entries, metadata, fill, chunk_bytes=chunk_bytes, progress=progress,
                                          cancel=cancel)
                    write_json(outputs.temp(out.sidecar), self.sidecar(out.part, out.shard, obj, tied, out.path))
            except OSError as e:
                if isinstance(e, OneloadError):
                    raise
                raise destination_error(out.path, e) from e
            return n, reader.bytes_read - before


# How a note says to keep flat optimizer state: convert's words, and consolidate's (which
# has no flat option: the way there is convert).
_KEEP_FLAT = "keep the output flat, flat=True (CLI: --flat), to carry it"
_KEEP_FLAT_CONSOLIDATE = ("convert(src, dst, flat=True) (CLI: metaseq-oneload convert SRC DST --flat) keeps the "
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
    src: "str | os.PathLike",
    dst_prefix: "str | os.PathLike",
    *,
    model_parallel: Optional[int] = None,
    shards: Optional[int] = None,
    flat: Optional[bool] = None,
    format: str = "torch",
    drop_optimizer: bool = False,
    overwrite: bool = False,
    jobs: Optional[int] = None,
    memory_budget: "int | str | None" = None,
    chunk_mb: float = 32,
    dtype: "torch.dtype | str | None" = None,
    qkv: str = "auto",
    wrapping: "Mapping | str | os.PathLike | None" = None,
    trust_pickle: bool = False,
    progress: "Optional[bool] | Callable[[int, int], None]" = None,
) -> ConvertReport:
    """(local, one process; no process group) Rewrite a checkpoint in another layout.

    Args:
        src: any file of the source checkpoint, its folder, its un-suffixed name or a glob.
        dst_prefix: the destination prefix (``/out/checkpoint_last``; a trailing ``.pt`` is
            dropped; an existing folder means "the source's prefix inside it").
        model_parallel: model-parallel parts M of the output (default: the source's).
        shards: FSDP shards N per part (default: the source's).
        flat: write fairscale flat-parameter shards with ``shard_metadata``. Default: flat
            when N > 1, or when the source is flat with the same N; unflattened otherwise.
            Unflattened outputs have one file per part (N must be 1).
        format: "torch" (metaseq's files) or "safetensors" (weights as safetensors plus a
            JSON sidecar of everything else; the optimizer state is dropped).
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
            receives (bytes written since the last call, tensors completed), called from
            the writer threads.

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
    for name, value in (("model_parallel", model_parallel), ("shards", shards), ("jobs", jobs), ("chunk_mb", chunk_mb)):
        check_option(name, value)
    if _parse_budget(memory_budget) is not None and _parse_budget(memory_budget) <= 0:
        raise OptionError(f"memory_budget={memory_budget!r} (CLI: --memory-budget {memory_budget}): expected a "
                          "positive size such as 512M or 2G. Nothing was read or written.")
    if format not in FORMATS:
        raise OptionError(f"format={format!r}: expected one of {', '.join(FORMATS)}.")
    if isinstance(dtype, str):
        if dtype.lower() not in _DTYPES:
            raise OptionError(f"dtype={dtype!r}: expected one of {', '.join(sorted(_DTYPES))}.")
        dtype = _DTYPES[dtype.lower()]
    layout = discover(src, trust_pickle=trust_pickle)
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
    prefix = _resolve_dst(dst_prefix, layout)
    if os.path.join(os.path.realpath(os.path.dirname(prefix)), os.path.basename(prefix)) == os.path.join(
            os.path.realpath(layout.directory), os.path.basename(layout.prefix)):
        raise OutputExistsError(
            f"{prefix}: the destination prefix is the source checkpoint's own; a conversion never writes over "
            "or beside its source under the same name. Choose another prefix (e.g. "
            f"{prefix}_mp{M}x{N}) or another folder."
        )
    grid = output_paths(prefix, M, N, flat, format)
    outs = [_Output(m, d, p, _sidecar(p) if format == "safetensors" else None)
            for m, row in enumerate(grid) for d, p in enumerate(row)]
    finals = [o.path for o in outs] + [o.sidecar for o in outs if o.sidecar]
    protected = [f.path for f in layout.all_files] + [os.path.join(layout.directory, a) for a in layout.aliases]
    outputs = OutputSet(finals, overwrite=overwrite, protected=protected,
                        replaces=_older_members(prefix, finals), lock=prefix)
    conv = _Conversion(layout, model_parallel=M, shards=N, flat=flat, fmt=format, drop_optimizer=drop_optimizer,
                       dtype=dtype, qkv=qkv, wrapping=_wrapping_metadata(wrapping, trust_pickle),
                       trust_pickle=trust_pickle)
    written = read = 0
    cancel = threading.Event()
    futures: list = []
    pending: set = set()
    close_bar = lambda: None  # noqa: E731
    budget = _parse_budget(memory_budget) or (1 << 30)
    # After planning: a request that cannot be met leaves no empty folder behind. From here
    # to the commit the destination's lock is held (abort lets it go).
    outputs.check()
    try:
        chunk = max(1 << 20, int(chunk_mb * _MiB))
        if budget < _CHUNKS_PER_JOB * chunk:
            chunk = max(1 << 16, budget // _CHUNKS_PER_JOB)
        n_jobs = max(1, min(int(jobs) if jobs else (os.cpu_count() or 1), len(outs),
                            budget // (_CHUNKS_PER_JOB * chunk)))
        if conv.read_whole:
            # One job and one reader for all outputs: each whole-read source file is loaded once.
            n_jobs = 1
            conv.shared_reader = RangeReader(chunk_bytes=chunk, trust_pickle=trust_pickle)
            if not any("read whole" in n for n in conv.notes):
                conv.notes.append("source files that cannot be range-read (legacy or compressed format) are read "
                                  "whole, once: one job")
        stale = outputs.clean_stale()
        total_bytes, total_tensors = conv.total_bytes(), conv.total_tensors()
        reclaimed = sum(os.path.getsize(f) for f in finals if os.path.isfile(f))
        free = shutil.disk_usage(os.path.dirname(prefix)).free
        if total_bytes - reclaimed > free:
            raise ConversionError(
                f"{os.path.dirname(prefix)}: the output needs about {total_bytes / (1 << 30):.2f} GiB and the disk has "
                f"{free / (1 << 30):.2f} GiB free; nothing was written. Free space or choose another folder."
            )
        callback, close_bar = progress_bar(progress, total_bytes, total_tensors, "convert")
        with concurrent.futures.ThreadPoolExecutor(max_workers=n_jobs, thread_name_prefix="oneload-convert") as pool:
            try:
                futures = [pool.submit(conv.write, o, outputs, chunk, callback, cancel) for o in outs]
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
            errors = [f.exception() for f in futures if f.exception() is not None]
            real = [e for e in errors if not isinstance(e, Cancelled)]
            if real or errors:
                raise (real or errors)[0]
            for f in futures:
                w, r = f.result()
                written += w
                read += r
        outputs.commit()
        index_problem = _write_index([o.path for o in outs], format)  # still under the destination's lock
    except BaseException:
        cancel.set()
        outputs.abort()
        raise
    finally:
        outputs.release()
        close_bar()
        if conv.shared_reader is not None:
            conv.shared_reader.close()
    notes = list(conv.notes) + list(outputs.notes) + [f"source: {w}" for w in layout.warnings]
    if index_problem:
        notes.append(index_problem)
    return ConvertReport(
        src=layout.display_name,
        source=f"{layout.model_parallel_size}x{layout.shards_per_part} {'flat' if layout.flat else 'unflattened'}",
        dst_prefix=prefix,
        model_parallel=M,
        shards=N,
        flat=flat,
        format=format,
        files=tuple(o.path for o in outs),
        sidecars=tuple(o.sidecar for o in outs if o.sidecar),
        optimizer=conv.optimizer_status,
        bytes_written=written,
        bytes_read=read,
        tensors=total_tensors,
        seconds=time.perf_counter() - t0,
        jobs=n_jobs,
        chunk_bytes=chunk,
        notes=tuple(notes),
        removed=tuple(stale) + tuple(outputs.removed),
    )


def _write_index(files: Sequence[str], format: str) -> Optional[str]:
    """Leave the index of a torch-format output beside it (formats/_index), so that loads
    of it read no header; None when written, else why not (the output is complete without
    one)."""
    if format != "torch" or not files:
        return None
    from .formats import _index

    try:
        written = discover(files[0])
        save = read_header(files[0]).get("oneload_save")
        _index.write(written, save_id=save.get("save_id") if isinstance(save, Mapping) else None)
    except Exception as e:  # the checkpoint itself is written and complete
        return f"no index written beside the output ({type(e).__name__}: {e}); loads read the headers instead"
    return None


def consolidate(src: "str | os.PathLike", dst: "str | os.PathLike", **kwargs) -> ConvertReport:
    """(local, one process) Write ``src`` as one unflattened checkpoint file ``dst``
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
    r = convert(src, dst, model_parallel=1, shards=1, flat=False, **kwargs)
    return dataclasses.replace(r, notes=type(r.notes)(n.replace(_KEEP_FLAT, _KEEP_FLAT_CONSOLIDATE) for n in r.notes))
