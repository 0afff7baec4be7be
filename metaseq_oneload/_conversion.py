"""What each output file of a conversion holds, decided before the first byte is written.

:class:`Conversion` plans the targets of every output part (``_plan.plan_part``), their
FSDP wrapping for flat outputs, the optimizer state laid out like the parameters
(:mod:`._optim`) and what of ``cfg``, meters and ``extra_state`` each file carries. For one
output it builds the object ``torch.save`` lays out (every large tensor an unfilled
placeholder) and, per placeholder storage, a :class:`~._writing.Record`: the read items of
the file's sources, which the one executor carries out into the file (:mod:`._writing`).

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
import contextlib
import copy
import json
import math
import os
import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch

from ._digest_record import WriteDigests, canonical_routes
from ._errors import ConversionError, OneloadError, StateDictMismatchError
from ._layout import CheckpointLayout, is_interpolation, raw_get, raw_keys
from ._optim import (OptimizerPlan, carry_extra_state, flat_record, plan_optimizer, rank_state, rest_source,
                     same_weights_layout, state_of)
from ._outputs import OutputSet, destination_error
from ._plan import FlatStructure, flat_shard_range, flat_structure, plan_part
from ._reading import RangeReader, load_object, read_header
from .formats.huggingface import SIDECAR_FORMAT as _SIDECAR_FORMAT
from ._writing import (Cancelled, Record, executor_chunks, storage_key, whole_record, write_json, write_safetensors,
                       write_torch)

__all__ = ["SAVE_KEY", "KEEP_FLAT", "Output", "Conversion", "wrapping_metadata"]

SAVE_KEY = "oneload_save"
# How a note says to keep flat optimizer state (consolidate words it its own way).
KEEP_FLAT = "keep the output flat, flat=True (CLI: --flat), to carry it"


def _checkpoint_suffix(model_parallel: int, shards: int, flat: bool, part: int) -> str:
    return "" if (not flat and model_parallel == 1) else f"-model_part-{part}"


# --------------------------------------------------------------------------- structure


def wrapping_metadata(wrapping: Any, trust_pickle: bool) -> Optional[Mapping]:
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
class Output:
    part: int
    shard: int
    path: str
    sidecar: Optional[str]


class Conversion:
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
        self.read_whole = any(f.format not in ("zip", "safetensors", "distcp") for f in layout.all_files)
        self.shared_reader: Optional[RangeReader] = None
        self.targets = [plan_part(layout, model_parallel, m, qkv=qkv, dtype=dtype) for m in range(model_parallel)]
        buffers = set(layout.parts[0].buffer_names)
        self.structures: list = []
        if flat:
            for t in self.targets:
                s = flat_structure(layout, t, wrapping, assume_metaseq=True)
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
        self.optimizer: Optional[OptimizerPlan] = None
        self.params: list = []
        self.optimizer_status = self._plan_optimizer(drop_optimizer, qkv, buffers)
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
        self.digests = self._plan_digests(dtype)
        self.sidecars: dict = {}  # sidecar path -> its JSON, written once every output is (digests)

    def _plan_digests(self, dtype: Optional[torch.dtype]) -> WriteDigests:
        """What the writers hash as the bytes pass (:mod:`._digest_record`): every output
        part's stored tensors (a tied name its source's bytes) and, for a one-part output, the
        set's canonical tensors (what an MP=1 ``load_state_dict`` of it returns)."""
        d = WriteDigests()
        # A flat set's tensors outside its flat parameters (buffers) are whole in every shard file.
        once = [set(t) - {x for g in self.structures[m].groups for x in g.names} if self.flat else set()
                for m, t in enumerate(self.targets)]
        for m, targets in enumerate(self.targets):
            for n, t in targets.items():
                d.route(m, t.alias_of or n, d.stored(m, n, t.dtype, t.shape, multi_part=self.M > 1),
                        shard=0 if (t.alias_of or n) in once[m] else None)
        if self.M > 1:
            self.notes.append(f"content digest not recorded for {self.M} model parts (a row-parallel weight's rows "
                              "span every part's file; the stored digests are recorded): `metaseq-oneload digest "
                              "DST` computes it")
        else:
            uncovered = canonical_routes(d, plan_part(self.layout, 1, 0, dtype=dtype), self.targets[0], once=once[0])
            if uncovered:
                d.drop_canonical()
                self.notes.append(f"no content digest recorded: the output does not hold {uncovered[0]} as an "
                                  "MP=1 load returns it; `metaseq-oneload digest` computes it by reading the output")
        return d

    def _plan_optimizer(self, drop_optimizer: bool, qkv: str, buffers: set) -> str:
        """Whether the optimizer state is "carried" (then ``self.optimizer`` and
        ``self.params`` say how), "dropped" (a note says why) or "absent"."""
        layout, flat = self.layout, self.flat
        if not any(state_of(read_header(f.path)) is not None for f in layout.all_files):
            return "absent"
        if drop_optimizer:
            self.notes.append("optimizer state dropped (drop_optimizer); resume with --reset-optimizer")
            return "dropped"
        if self.fmt == "safetensors":
            self.notes.append("optimizer state dropped: the safetensors output holds weights and metadata; "
                              "use format='torch' (CLI: --format torch) to keep it")
            return "dropped"
        if layout.flat and not flat:
            self.notes.append("optimizer state dropped: flat FSDP optimizer state cannot be mapped onto "
                              "unflattened parameters (the flat shards do not record the module's parameter "
                              "order); " + KEEP_FLAT)
            return "dropped"
        if flat:
            self.params = [[n for g in s.groups for n in g.names] for s in self.structures]
        else:
            self.params = [[n for n, t in tg.items() if t.alias_of is None and n not in buffers] for tg in self.targets]
        self.optimizer, reason = plan_optimizer(layout, self.M, qkv, self.params, self.targets)
        if self.optimizer is None:
            self.notes.append(f"optimizer state dropped: {reason}")
            return "dropped"
        self.notes.append(f"optimizer state carried ({', '.join(map(str, sorted(self.optimizer.aligned, key=str)))} "
                          "resharded exactly like the weights)")
        return "carried"

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
                    add(n, t.shape, t.dtype, whole_record(n, t))
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
            rec, size = flat_record(g, d, self.N, dtype)
            items.append((g.key, (size,), dtype, rec))
        for n, t in targets.items():
            if n in covered or t.alias_of is not None:
                continue
            items.append((n, t.shape, t.dtype, whole_record(n, t)))
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

        def make(rec: Record, shape: tuple) -> torch.Tensor:
            t = torch.empty(shape, dtype=rec.dtype)
            records[storage_key(t)] = rec
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

    def write_sidecars(self, outputs: OutputSet, digests: Optional[Mapping]) -> None:
        """(local) The JSON sidecars of a safetensors output, once every file is written:
        each with ``oneload_digest`` (its part's stored digests, the set's content digests)."""
        for path, doc in self.sidecars.items():
            if digests is not None:
                part = doc["model_part"]
                doc = {**doc, "oneload_digest": {
                    "stored": {n: v for (m, n), v in sorted(digests["stored"].items())
                               if m == part and n not in doc["tied"]},  # the file's own tensors
                    **({"content": digests["content"]} if digests.get("content") else {})}}
            try:
                write_json(outputs.temp(path), doc)
            except OSError as e:
                if isinstance(e, OneloadError):
                    raise
                raise destination_error(path, e) from e

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

    def sources(self, m: int) -> dict:
        """What the read items of part ``m``'s records name: its weights by name, its
        optimizer values by :func:`._optim.state_source`."""
        return {**self.targets[m], **(self.optimizer.sources(m) if self.optimizer is not None else {})}

    def write(self, out: Output, outputs: OutputSet, chunk_bytes: int, meter, cancel) -> tuple:
        """(local, one worker thread) Write output ``out`` under its temporary name: the
        executor streams each record's read items into the file. Returns (bytes written,
        bytes read)."""
        if cancel.is_set():
            raise Cancelled()
        shared = self.shared_reader is not None
        reader = self.shared_reader if shared else RangeReader(chunk_bytes=chunk_bytes, trust_pickle=self.trust_pickle)
        before = reader.bytes_read
        with contextlib.nullcontext(reader) if shared else reader:
            obj, records, entries, tied, meta = self.build(out.part, out.shard)
            chunks = executor_chunks(self.sources(out.part), reader, chunk_bytes, tap=self.digests.tap(out.part, out.shard))
            tmp = outputs.temp(out.path)  # a ConversionError of its own if the folder refuses
            try:
                if self.fmt == "torch":
                    n = write_torch(tmp, obj, records, chunks, progress=meter, cancel=cancel,
                                    trust_pickle=self.trust_pickle)
                else:
                    metadata = {"format": "pt", "metaseq_oneload": os.path.basename(out.sidecar),
                                SAVE_KEY: json.dumps(self.save, sort_keys=True)}
                    n = write_safetensors(tmp, entries, metadata, chunks, progress=meter, cancel=cancel)
                    with self._lock:  # written by write_sidecars, with the digests of every file
                        self.sidecars[out.sidecar] = self.sidecar(out.part, out.shard, obj, tied, out.path)
            except OSError as e:
                if isinstance(e, OneloadError):
                    raise
                raise destination_error(out.path, e) from e
            return n, reader.bytes_read - before
