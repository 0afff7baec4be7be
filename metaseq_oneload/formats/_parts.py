"""Model parts from the tensors of a ``torch.save`` set (:class:`._torchsave.TorchSet`):
FSDP flat parameters unflattened into runs of bytes across their shards, ordinary tensors
where they lie, and the flat metadata checked against both.

The tensors are believed first: a part is flat only when its files hold the flat parameters
their ``shard_metadata``/``fsdp_metadata`` lists; unflattened weights that still carry the
metadata of the FSDP run they came from (metaseq's ``reshard_fsdp --unflatten-weights``, the
OPT release layout) are unflattened weights, and the metadata is reported as stale.
"""

from __future__ import annotations

import math
import os
import re
from typing import Mapping, Optional, Sequence

from .._errors import CheckpointLayoutError, cap_list as _cap
from .._layout import CheckpointFile, FileName, FlatParam, ModelPart, StoredTensor
from .._reading import Extent, storage_byte_offset
from ._torchsave import TorchSet, check_tensor, container, direct_extent, model_dict, model_key

__all__ = ["build_parts"]

# Buffers that metaseq/fairseq models register; everything else in an unflattened state
# dict is a parameter as far as the parameter count is concerned.
_BUFFER_SUFFIXES = (".version", "._float_tensor")


_FLAT_NAME_RE = re.compile(r"(?:^|\.)flat_param(?:_\d+)?$")


def _flat_metadata(header: Mapping) -> tuple:
    for key in ("shard_metadata", "fsdp_metadata"):
        md = header.get(key)
        if isinstance(md, Mapping) and "param_metadata" in md:
            return key, md
    return None, None


def _metadata_structure(md: Mapping) -> list:
    """(fsdp_path, flat name, member names, shapes, numels) per flat parameter."""
    return [(pm.get("fsdp_path", "") or "", k, list(v["names"]), [tuple(s) for s in v["shapes"]], list(v["numels"]))
            for pm in md["param_metadata"] for k, v in pm["params"].items()]


def _joined(fsdp_path: str, name: str) -> str:
    return f"{fsdp_path}.{name}" if fsdp_path else name


def _flat_reading(index: int, files: Sequence[CheckpointFile], headers: Mapping) -> tuple:
    """Which reading of one model part's files the tensors support: ("flat", key) when the
    files hold the flat parameters their metadata lists, ("unflattened", key-or-None) when
    they hold ordinary tensors (any metadata beside them is stale), or raise when no
    reading is consistent."""
    label = lambda f: os.path.basename(f.path)  # noqa: E731
    models = [model_dict(headers[f.path]) for f in files]
    metas = [_flat_metadata(headers[f.path]) for f in files]
    flat_like = [sorted(n for n in m if _FLAT_NAME_RE.search(n)) for m in models]
    declared = []
    for key, md in metas:
        declared.append(None if md is None else [_joined(p, k) for p, k, *_ in _metadata_structure(md)])
    holds_flat = []
    for f, model, names, flat in zip(files, models, declared, flat_like):
        present = [k for k in (names or ()) if k in model]
        if names and present and len(present) != len(names):
            missing = [k for k in names if k not in model]
            raise CheckpointLayoutError(
                f"{f.path}: its shard_metadata lists flat parameters {_cap(names)} but the file holds only "
                f"{_cap(present)} of them (missing {_cap(missing)}): neither a flat FSDP shard nor an "
                "unflattened file. The file was edited or damaged; copy it again from its source."
            )
        holds_flat.append(bool(present) or (bool(flat) and names is None))
    if any(holds_flat) and not all(holds_flat):
        flat_files = [label(f) for f, h in zip(files, holds_flat) if h]
        other = [label(f) for f, h in zip(files, holds_flat) if not h]
        raise CheckpointLayoutError(
            f"model part {index}: {_cap(flat_files)} hold flat FSDP parameters but {_cap(other)} hold "
            "unflattened weights: files of different saves or writers are mixed in one set. Keep only "
            "the files written by one save."
        )
    if all(holds_flat):
        no_md = [label(f) for f, (k, _) in zip(files, metas) if k is None]
        if no_md:
            raise CheckpointLayoutError(
                f"{files[0].path}: {_cap(no_md)} hold{'s' * (len(no_md) == 1)} flat FSDP parameters "
                f"({_cap(flat_like[0])}) but no shard_metadata or fsdp_metadata, so how they unflatten "
                "cannot be known. Expected FSDP local_state_dict shards saved with their shard_metadata "
                "(use_sharded_state); re-save them, or consolidate them with the tool that wrote them."
            )
        keys = {k for k, _ in metas}
        if len(keys) > 1:
            raise CheckpointLayoutError(
                f"model part {index}: some shards carry shard_metadata and some fsdp_metadata: files of "
                "different writers are mixed. Keep only the files written by one save."
            )
        return "flat", keys.pop()
    if len(files) > 1:
        raise CheckpointLayoutError(
            f"{files[0].path}: {len(files)} files are named as FSDP shards of model part {index} "
            f"({label(files[0])} .. {label(files[-1])}) but each holds unflattened weights, so how they "
            "split the model cannot be known (copies of one file?). Expected flat FSDP shards with "
            "shard_metadata; keep one file, or pass the one you mean."
        )
    return "unflattened", metas[0][0]


def _build_part(index: int, files: Sequence[CheckpointFile], headers: Mapping, stale: list) -> tuple:
    """One model part from its files' tensors; returns (part, metadata key or None).

    Appends ``(metadata key, warning)`` to ``stale`` for metadata that does not describe the
    tensors."""
    reading, metadata_key = _flat_reading(index, files, headers)
    if reading == "unflattened":
        return _unflattened_part(index, files[0], headers[files[0].path], metadata_key, stale), None
    return _flat_part(index, files, headers, metadata_key), metadata_key


def _unflattened_part(index: int, f: CheckpointFile, header: Mapping, metadata_key: Optional[str],
                      stale: list) -> ModelPart:
    """One file's ordinary tensors; FSDP metadata beside them is stale, but the ties it
    records still hold where the tensors agree."""
    model = model_dict(header)
    tensors = {name: StoredTensor(name, index, t.dtype, tuple(t.shape),
                                  (direct_extent(f.path, f.format, header, name, t),))
               for name, t in model.items()}
    buffers = tuple(n for n in tensors if n.endswith(_BUFFER_SUFFIXES))
    shared: list = []
    if metadata_key is not None:
        md = header[metadata_key]
        stale.append((metadata_key, _stale_metadata_note(f, metadata_key, md, model)))
        # The writer dropped the alias (reshard_fsdp --unflatten-weights does) but the model
        # expects it.
        for src, dst in _shared_pairs(md):
            if src in tensors and (dst not in tensors or tensors[dst].shape == tensors[src].shape):
                shared.append((src, dst))
        buffers = tuple(dict.fromkeys(buffers + tuple(
            n for n in (md.get("buffer_names", ()) or ()) if n in tensors)))
    return ModelPart(index, tensors, (), buffers, tuple(shared))


def _shared_pairs(md: Mapping) -> list:
    """The (source, tied alias) full names the metadata's ``shared_param_info`` records."""
    out = []
    for pm in md["param_metadata"]:
        fsdp_path = pm.get("fsdp_path", "") or ""
        for pair in pm.get("shared_param_info", ()) or ():
            out.append((_joined(fsdp_path, pair[0]), _joined(fsdp_path, pair[1])))
    return out


def _flat_part(index: int, files: Sequence[CheckpointFile], headers: Mapping, metadata_key: str) -> ModelPart:
    """The FSDP shards of one part: each flat parameter unflattened into runs of bytes
    across the shards, the other tensors read from the first shard."""
    first = headers[files[0].path]
    metas = [headers[f.path][metadata_key] for f in files]
    models = [model_dict(headers[f.path]) for f in files]
    _check_shards_agree(files, metas, models, metadata_key)
    flat_params = []
    tensors: dict = {}
    for pm in metas[0]["param_metadata"]:
        fsdp_path = pm.get("fsdp_path", "") or ""
        for flat_name, v in pm["params"].items():
            fp = _flat_param(fsdp_path, flat_name, v, files, metas, models, metadata_key)
            _check_flat(fp, files)
            flat_params.append(fp)
            tensors.update(_unflatten(fp, index, files, headers))
    flat_keys = {fp.key for fp in flat_params}
    for name, t in models[0].items():
        if name not in flat_keys:
            tensors[name] = StoredTensor(name, index, t.dtype, tuple(t.shape),
                                         (direct_extent(files[0].path, files[0].format, first, name, t),))
    buffer_names = tuple(metas[0].get("buffer_names", ()) or ())
    return ModelPart(index, tensors, tuple(flat_params), buffer_names, tuple(_shared_pairs(metas[0])))


def _check_shards_agree(files: Sequence[CheckpointFile], metas: Sequence[Mapping], models: Sequence[Mapping],
                        metadata_key: str) -> None:
    """Every shard of one part lists the same flat parameters and holds the same tensors in
    the same dtypes as the first."""
    label = lambda f: os.path.basename(f.path)  # noqa: E731
    ref = _metadata_structure(metas[0])
    for f, md, model in zip(files, metas, models):
        if _metadata_structure(md) != ref:
            raise CheckpointLayoutError(
                f"{f.path}: its {metadata_key} differs from {label(files[0])}'s (other parameter "
                "names, shapes or grouping): shards of different checkpoints are mixed in one set. "
                "Keep only the shards written by one save."
            )
        if set(model) != set(models[0]):
            raise CheckpointLayoutError(
                f"{f.path}: holds tensors {_cap(sorted(set(model) ^ set(models[0])))} that "
                f"{label(files[0])} does not (or the reverse): shards of different checkpoints are mixed."
            )
        for name, t in model.items():
            t0 = models[0][name]
            if t.dtype != t0.dtype:
                raise CheckpointLayoutError(
                    f"{f.path}: {name} is stored as {str(t.dtype).replace('torch.', '')} but "
                    f"{label(files[0])} stores it as {str(t0.dtype).replace('torch.', '')}: every shard "
                    "of one save has one dtype per tensor, so shards of different saves (or a shard "
                    "converted on its own) are mixed. Keep only the files written by one save, or "
                    "convert all of them."
                )


def _flat_param(fsdp_path: str, flat_name: str, v: Mapping, files: Sequence[CheckpointFile],
                metas: Sequence[Mapping], models: Sequence[Mapping], metadata_key: str) -> FlatParam:
    """One flat parameter as its shards hold it and the metadata (entry ``v``) lists it;
    raise where the tensors or the metadata do not hold together."""
    key = _joined(fsdp_path, flat_name)
    shard_numels, paddings = [], []
    for f, md, model in zip(files, metas, models):
        if model[key].dim() != 1:
            raise CheckpointLayoutError(
                f"{f.path}: flat parameter {key} has shape {tuple(model[key].shape)}; FSDP flat "
                "parameters are 1-D. The file was edited or damaged."
            )
        padding = next(p["params"][flat_name].get("padding", 0) for p in md["param_metadata"]
                       if (p.get("fsdp_path", "") or "") == fsdp_path)
        shard_numels.append(model[key].numel())
        paddings.append(int(padding or 0))
    names = tuple(_joined(fsdp_path, n) for n in v["names"])
    fp = FlatParam(key, fsdp_path, names, tuple(tuple(int(x) for x in s) for s in v["shapes"]),
                   tuple(int(x) for x in v["numels"]), tuple(shard_numels), tuple(paddings),
                   models[0][key].dtype)
    bad = [(n, s, k) for n, s, k in zip(fp.names, fp.shapes, fp.numels) if math.prod(s) != k]
    if bad or not len(fp.names) == len(fp.shapes) == len(fp.numels):
        raise CheckpointLayoutError(
            f"{files[0].path}: {metadata_key} of {key} is inconsistent: "
            + (f"{bad[0][0]} has shape {bad[0][1]} but numel {bad[0][2]}" if bad else
               f"{len(fp.names)} names, {len(fp.shapes)} shapes, {len(fp.numels)} numels")
            + ". The metadata was edited or damaged."
        )
    return fp


def _stale_metadata_note(f: CheckpointFile, key: str, md: Mapping, model: Mapping) -> str:
    """The warning for FSDP metadata kept beside unflattened weights, saying whether it
    still describes them (same names and shapes) or another model."""
    listed = {}
    for fsdp_path, _, names, shapes, _ in _metadata_structure(md):
        for n, s in zip(names, shapes):
            listed[_joined(fsdp_path, n)] = tuple(int(x) for x in s)
    disagree = [n for n, s in listed.items() if n in model and tuple(model[n].shape) != s]
    absent = [n for n in listed if n not in model]
    # No writer is named: metaseq's reshard_fsdp, reshard_mp and convert_to_singleton leave
    # such a file, and so does fairseq-train's FSDP without use_sharded_state.
    note = (f"{os.path.basename(f.path)}: holds unflattened weights beside the {key} of the FSDP run they "
            "came from; the tensors are used and the metadata is ignored")
    said = ([f"{len(disagree)} shape(s) differ ({_cap(disagree, 3)})"] if disagree else []) + (
        [f"{len(absent)} listed tensor(s) absent ({_cap(absent, 3)})"] if absent else [])
    if said:
        note += "; it does not describe them: " + ", ".join(said)
    return note + "."


def _check_flat(fp: FlatParam, files: Sequence[CheckpointFile]) -> None:
    where = f"{os.path.basename(files[0].path)}..{os.path.basename(files[-1].path)}"
    if len(set(fp.shard_numels)) > 1:
        sizes = ", ".join(f"{os.path.basename(f.path)}: {n}" for f, n in zip(files, fp.shard_numels))
        raise CheckpointLayoutError(
            f"{where}: {fp.key} has a different size in each shard ({sizes}); every shard of one save "
            "has the same size (the last one padded). Shards of different saves are mixed: keep only "
            "the files written by one save."
        )
    if any(p < 0 or p > n for n, p in zip(fp.shard_numels, fp.paddings)):
        raise CheckpointLayoutError(
            f"{where}: {fp.key}: padding {list(fp.paddings)} does not fit shard sizes "
            f"{list(fp.shard_numels)}: the shard_metadata is inconsistent with the tensors."
        )
    seen_padding = False
    for f, real in zip(files, fp.real_numels):
        if seen_padding and real > 0:
            raise CheckpointLayoutError(
                f"{f.path}: {fp.key}: holds {real} elements after an earlier shard ended in padding "
                f"(paddings {list(fp.paddings)}): inconsistent padding across shards; expected padding "
                "only at the end, as fairscale writes it. The shards come from different saves or were edited."
            )
        seen_padding = seen_padding or real < (fp.shard_numels[0] if fp.shard_numels else 0)
    held = sum(fp.real_numels)
    per_shard = fp.shard_numels[0] if fp.shard_numels else 0
    needed = -(-fp.total_numel // per_shard) if per_shard else 0
    name = FileName.parse(os.path.basename(files[-1].path))
    if held < fp.total_numel and needed > len(files) and name is not None and name.shard is not None:
        # Every shard but the last is full: the count the set needs follows from the size.
        missing = [os.path.join(os.path.dirname(files[-1].path), name.format(shard=d))
                   for d in range(len(files), needed)]
        raise CheckpointLayoutError(
            f"{where}: {fp.key}: the {len(files)} shard(s) hold {held} of the {fp.total_numel} elements its "
            f"metadata lists, {per_shard} per shard, so the set has {needed} shards and "
            f"{_cap(missing, fmt=os.path.basename)} {'is' if len(missing) == 1 else 'are'} missing (in "
            f"{os.path.dirname(files[-1].path)}). Copy the missing shard(s) next to the others."
        )
    if held != fp.total_numel:
        raise CheckpointLayoutError(
            f"{where}: {fp.key}: the {len(files)} shard(s) hold {held} elements but its metadata "
            f"lists {fp.total_numel} ({len(fp.names)} tensors): "
            + ("a shard is missing (the set ends early) or " if held < fp.total_numel else "")
            + "the padding recorded in shard_metadata is wrong. Expected one complete set written by one save."
        )


def _unflatten(fp: FlatParam, part: int, files: Sequence[CheckpointFile], headers: Mapping) -> dict:
    """Member tensors of a flat parameter as runs of bytes across the shard files."""
    starts, pos = [], 0
    for real in fp.real_numels:
        starts.append(pos)
        pos += real
    out = {}
    offset = 0
    for name, shape, numel in zip(fp.names, fp.shapes, fp.numels):
        extents = []
        lo, hi = offset, offset + numel
        for f, start, real in zip(files, starts, fp.real_numels):
            a, b = max(lo, start), min(hi, start + real)
            if a >= b:
                continue
            obj = headers[f.path]
            t = model_dict(obj)[fp.key]
            base = storage_byte_offset(t) if f.format == "zip" else None
            itemsize = t.element_size()
            extents.append(Extent(f.path, model_key(obj, fp.key), a - start, b - a,
                                  None if base is None else base + (a - start) * itemsize))
        out[name] = StoredTensor(name, part, fp.dtype, shape, tuple(extents))
        offset = hi
    return out


def _check_loadable(f: CheckpointFile, header: Mapping) -> None:
    """(local) Every model tensor of a file can be loaded for what its record holds (see
    :func:`check_tensor`); the expanded views of one file share one budget."""
    prefix = container(header)
    expanded = [0]
    for name, t in model_dict(header).items():
        check_tensor(f.path, f.format, f"{prefix}.{name}" if prefix else name, t, expanded)


def build_parts(ts: TorchSet) -> tuple:
    """(parts, metadata key or None, stale notes) of a set, from its tensors; raise where
    the parts cannot be one model."""
    stale: list = []
    for row in ts.files:
        for f in row:
            _check_loadable(f, ts.headers[f.path])
    built = [_build_part(m, row, ts.headers, stale) for m, row in enumerate(ts.files)]
    parts = tuple(p for p, _ in built)
    if len({bool(p.flat_params) for p in parts}) > 1:
        flat = [str(p.index) for p in parts if p.flat_params]
        raise CheckpointLayoutError(
            f"{ts.label}: model part(s) {_cap(flat)} hold flat FSDP shards but the others hold unflattened "
            "weights: files of different saves are mixed. Keep only the files written by one save."
        )
    names0 = list(parts[0].tensors)
    for p in parts[1:]:
        if list(p.tensors) != names0 and set(p.tensors) != set(names0):
            diff = sorted(set(p.tensors) ^ set(names0))
            raise CheckpointLayoutError(
                f"{ts.files[p.index][0].path}: model part {p.index} holds other tensors than part 0 "
                f"(e.g. {_cap(diff)}): parts of different models are mixed. Keep only one save's parts."
            )
        for n, t in p.tensors.items():
            t0 = parts[0].tensors[n]
            if t.dtype != t0.dtype:
                raise CheckpointLayoutError(
                    f"{ts.files[p.index][0].path}: {n} is stored as {str(t.dtype).replace('torch.', '')} in "
                    f"model part {p.index} but as {str(t0.dtype).replace('torch.', '')} in part 0: parts of "
                    "different saves (or a part converted on its own) are mixed. Keep only one save's parts, "
                    "or convert all of them."
                )
    return parts, built[0][1], stale


