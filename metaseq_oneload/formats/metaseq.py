"""metaseq and fairseq checkpoints: training dicts (``model``, ``cfg`` or old ``args``,
``optimizer_history``, ``extra_state``, ``shard_metadata``/``fsdp_metadata``) in ``.pt``
files named by the metaseq/fairseq grammar (see :mod:`metaseq_oneload._layout`).

What this module knows that the shared torch machinery does not: what the ``cfg`` says
(and that it is stale in consolidated and resharded files: the files win, the cfg becomes a
note of inspect's report, not a warning: every such writer leaves it), which saves the files belong to, and which of the two libraries wrote them.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Mapping, Sequence

import torch

from .. import _storage
from .._errors import CheckpointLayoutError, cap_list
from .._layout import (CheckpointFile, CheckpointLayout, CheckpointSettings, FileName, known_get,
                       model_args_of, raw_get, raw_keys)
from .._reading import storage_byte_offset
from . import _index, _parts, _torchsave

NAME = "metaseq"


def detect(path: str) -> bool:
    """Every path the ``.pt`` grammar can name: this family is the registry's last resort, so
    its describer is what says "no such file" or "not a checkpoint"."""
    return True


def describe(path: str, *, trust_pickle: bool = False) -> CheckpointLayout:
    """(any rank, local) The layout of the metaseq/fairseq set ``path`` belongs to: from the
    index our writers leave beside a set when it agrees with the files, else from the
    headers."""
    resolved = _torchsave.resolve_grid(path)
    fs, _, grid = resolved
    indexed, stale_index = _index.load(fs.directory, fs.prefix, grid, trust_pickle=trust_pickle)
    skipped = _torchsave.skipped_note(fs)
    if indexed is not None:
        return dataclasses.replace(indexed, aliases=fs.aliases, notes=indexed.notes + skipped)
    layout = _from_headers(_torchsave.read_set(path, trust_pickle=trust_pickle, resolved=resolved), trust_pickle)
    if stale_index:  # an index that no longer describes its files is wrong, not normal: a warning
        layout = dataclasses.replace(layout, warnings=layout.warnings + (stale_index,))
    return dataclasses.replace(layout, notes=layout.notes + skipped) if skipped else layout


def _from_headers(ts: "_torchsave.TorchSet", trust_pickle: bool) -> CheckpointLayout:
    files = ts.files
    # Mixed saves: every file of one save carries the same update count and position.
    run_ids = {f.path: _run_id(ts.headers[f.path]) for row in files for f in row}
    if len(set(run_ids.values())) > 1:
        groups: dict = {}
        for p, r in run_ids.items():
            groups.setdefault(r, []).append(os.path.basename(p))
        # The update count and position always; the save identity and world size where
        # they are what tells the groups apart.
        differs = [len({r[i] for r in groups}) > 1 for i in range(len(next(iter(groups))))]
        desc = "; ".join(
            f"num_updates={r[0]}, epoch={r[1]}, iterations_in_epoch={r[2]}"
            + (f", save {r[3]}" if differs[3] else "") + (f", world size {r[4]}" if differs[4] else "")
            + f": {cap_list(v)}"
            for r, v in list(groups.items())[:5])
        raise CheckpointLayoutError(
            f"{ts.label}: files of different saves are mixed in one set ({desc}). "
            "Keep only the files written by one save."
        )
    _check_one_save(ts, run_ids)
    parts, metadata_key, stale = _parts.build_parts(ts)
    settings = _settings(ts.first)
    name = ts.name
    if (name.part is not None and settings.model_parallel_size and settings.model_parallel_size > len(files)
            and not _complete(parts, model_args_of(ts.first).get("decoder_ffn_embed_dim"))):
        missing = cap_list(range(len(files), settings.model_parallel_size),
                           fmt=lambda m: name.format(part=m, shard=0 if name.shard is not None else None))
        raise CheckpointLayoutError(
            f"{ts.label}: found model parts 0..{len(files) - 1} but cfg "
            f"common.model_parallel_size={settings.model_parallel_size} (missing {missing}). "
            "Copy the missing part(s) next to the others."
        )
    stale_cfg = _cfg_warnings(files, settings, bool(parts[0].flat_params), name)
    first = ts.first
    cfg = raw_get(first, "cfg") if isinstance(raw_get(first, "cfg"), Mapping) else None
    # metaseq's config has a "reshard" section fairseq's lacks; flattened into old-style
    # args it leaves its keys there.
    args = raw_get(first, "args")
    if ((cfg is not None and "reshard" in raw_keys(cfg)) or any(".qkv_proj." in n for n in parts[0].tensors)
            or (args is not None and known_get(args, "target_world_size") is not None
                and known_get(args, "do_pad") is not None)):
        flavor = "metaseq"
    elif raw_get(first, "cfg") is not None or args is not None:
        flavor = "fairseq"
    else:
        flavor = "pytorch"
    return CheckpointLayout(
        directory=ts.fileset.directory,
        prefix=ts.fileset.prefix,
        name=name,
        files=files,
        parts=parts,
        cfg=settings,
        metadata_key=metadata_key,
        aliases=ts.fileset.aliases,
        num_updates=run_ids[files[0][0].path][0],
        flavor=flavor,
        # What every consolidating or resharding writer leaves (and fairseq's FSDP without
        # use_sharded_state): the tensors settle it, so it is reported, not warned about.
        notes=tuple(w for _, w in stale + stale_cfg),
        stale_metadata=tuple(dict.fromkeys(k for k, _ in stale + stale_cfg)),
        trust_pickle=trust_pickle,
    )


def _cfg_value(header: Any, section: str, key: str) -> Any:
    if not isinstance(header, Mapping):
        return None
    value = known_get(known_get(known_get(header, "cfg"), section), key)
    if value is None:
        value = known_get(known_get(known_get(header, "cfg"), "model"), key)
    if value is None:
        value = known_get(known_get(header, "args"), key)
    return value


def _settings(header: Any) -> CheckpointSettings:
    def as_int(v):
        # A hint the files are checked against: a value that is not an integer (an
        # interpolation's text in a plain-dict cfg, a crafted string) is unknown, not an error.
        if isinstance(v, bool) or not isinstance(v, (int, float, str)):
            return None
        try:
            return int(v)
        except (ValueError, OverflowError):
            return None

    usv = _cfg_value(header, "distributed_training", "use_sharded_state")
    ddp = _cfg_value(header, "distributed_training", "ddp_backend")
    return CheckpointSettings(
        model_parallel_size=as_int(_cfg_value(header, "common", "model_parallel_size")),
        checkpoint_shard_count=as_int(_cfg_value(header, "checkpoint", "checkpoint_shard_count")),
        use_sharded_state=None if usv is None else bool(usv),
        ddp_backend=None if ddp is None else str(ddp),
        distributed_world_size=as_int(_cfg_value(header, "distributed_training", "distributed_world_size")),
    )


def _complete(parts: Sequence, ffn: Any) -> bool:
    """Whether the parts on disk already hold the whole model, by their tensors: their
    column-parallel ``fc1`` rows add up to the model's ffn width. Then a cfg that claims
    more parts is stale (``reshard_mp.py`` updates ``cfg.model`` but not ``cfg.common``),
    not evidence of missing files."""
    if not isinstance(ffn, int) or ffn <= 0:
        return False
    rows = [sum(t.shape[0] for n, t in p.tensors.items() if n.endswith(".layers.0.fc1.weight")) for p in parts]
    return bool(rows) and sum(rows) == ffn


def _run_id(header: Any) -> tuple:
    """What every file of one save shares: the update count and training position."""
    if not isinstance(header, Mapping):
        return ()
    updates = None
    hist = raw_get(header, "optimizer_history")
    if isinstance(hist, (list, tuple)) and hist and isinstance(hist[-1], Mapping):
        updates = known_get(hist[-1], "num_updates")
    it = known_get(known_get(header, "extra_state"), "train_iterator")
    # The identity this package's own writers (convert, consolidate) put in every file of
    # one output set tells two sets apart even at the same step.
    save_id = known_get(known_get(header, "oneload_save"), "save_id")
    world = _cfg_value(header, "distributed_training", "distributed_world_size")
    return (updates, known_get(it, "epoch"), known_get(it, "iterations_in_epoch"), save_id, world)

# --------------------------------------------------------------------------- one save
# metaseq and fairseq files carry no save identity, and two runs of one config stop at the
# same update count with the same data position. What the ranks of one save share beyond
# that are values they all-reduced: ``previous_training_time`` (averaged over the data
# parallel ranks: equal across the shards of a model part, not across parts), and the train
# ``loss`` meter (every rank of the save logs the same aggregate) and ``ewm_loss``. Two runs
# have the same wall-clock time to the last bit only by accident.
# Within a part's shards previous_training_time is compared exactly. Across parts the loss
# values come from all-reduces over different data-parallel groups, which may round apart:
# equal to a relative 1e-6 (a few float32 ulps; two runs differ in the 3rd or 4th digit).
_ACROSS_PARTS = 1e-6


def _scalar(path: str, value: Any) -> Any:
    """A number from a header: a Python number as is, a one-element tensor's value read from
    its record (headers hold tensors on ``meta``: a few bytes at the offset the header read
    checked); None where there is no number to read."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if not isinstance(value, torch.Tensor) or value.numel() != 1 or value.is_complex():
        return None
    if value.device.type != "meta":
        return float(value.item())
    offset = storage_byte_offset(value)
    if offset is None:  # (a legacy or compressed file: its bytes are not in place)
        return None
    size = value.element_size()
    try:
        fd = _storage.open_ro(path)
        try:
            data = _storage.pread(fd, size, offset)
        finally:
            _storage.close(fd)
    except (OSError, ValueError):  # evidence we cannot read is no evidence; the load reports the file
        return None
    if len(data) != size:
        return None
    return float(torch.frombuffer(bytearray(data), dtype=value.dtype)[0])


def _train_loss(extra: Any) -> Any:
    """The train ``loss`` meter's state: metaseq/fairseq keep meters as (priority, name,
    class, state) entries."""
    metrics = known_get(extra, "metrics")
    group = known_get(metrics, "train")
    if not isinstance(group, (list, tuple)):
        return None
    for entry in group[:1000]:
        if (isinstance(entry, (list, tuple)) and len(entry) == 4 and entry[1] == "loss"
                and isinstance(entry[3], Mapping)):
            return entry[3]
    return None


def _check_one_save(ts: "_torchsave.TorchSet", run_ids: Mapping) -> None:
    """(any rank, local) Refuse a set whose files' all-reduced values disagree (see above);
    files without a value are not compared. A set this package wrote carries its own save
    identity, already compared (its outputs may take their meters from different sources)."""
    paths = [f.path for row in ts.files for f in row]
    if len(paths) < 2 or all(run_ids[p][3] is not None for p in paths):
        return
    extra = {p: known_get(ts.headers[p], "extra_state") for p in paths}

    def refuse(what: str, values: Mapping, rel_tol: float) -> None:
        groups: dict = {}
        for p, v in values.items():
            groups.setdefault(v, []).append(os.path.basename(p))
        desc = "; ".join(f"{what}={v!r}: {cap_list(names)}" for v, names in list(groups.items())[:5])
        how = ("to the last bit (one all-reduce gives every rank of a part's data-parallel group the same bits)"
               if not rel_tol else f"to a relative {rel_tol:g} (each part all-reduces it over its own group, "
               "which may round apart by less)")
        raise CheckpointLayoutError(
            f"{ts.label}: files of different saves are mixed in one set ({desc}). They agree on the update count "
            f"({run_ids[paths[0]][0]}) and data position, but every rank of one save writes the same {what} "
            f"(an all-reduced value), {how}, so these files come from different runs that stopped at the same "
            "step. Keep only the files written by one save: move the other run's files out of this folder (no "
            "option loads files whose all-reduced values disagree as one set).")

    def agree(a: Any, b: Any, rel_tol: float) -> bool:
        if isinstance(a, tuple):
            return all(agree(x, y, rel_tol) for x, y in zip(a, b))
        return a == b if not rel_tol else math.isclose(a, b, rel_tol=rel_tol, abs_tol=0.0)

    def compare(what: str, files: Sequence[str], read, rel_tol: float = 0.0) -> None:
        values = {}
        for p in files:
            v = read(p)
            if v is not None and v == v:  # (NaN is no evidence)
                values[p] = v
        first = next(iter(values.values()), None)
        if any(not agree(first, v, rel_tol) for v in values.values()):
            refuse(what, values, rel_tol)

    for row in ts.files:  # averaged over the data-parallel ranks of one model part
        if len(row) > 1:
            compare("previous_training_time", [f.path for f in row],
                    lambda p: _scalar(p, known_get(extra[p], "previous_training_time")))
    # The same for every rank of the save: one file per part is enough.
    heads = [row[0].path for row in ts.files]
    if len(heads) > 1:
        compare("ewm_loss", heads, lambda p: _scalar(p, known_get(extra[p], "ewm_loss")), _ACROSS_PARTS)

        def loss(p: str) -> Any:
            meter = _train_loss(extra[p])
            if meter is None:
                return None
            total, count = _scalar(p, known_get(meter, "sum")), _scalar(p, known_get(meter, "count"))
            return None if total is None or count is None else (total, count)

        compare("train loss meter (sum, count)", heads, loss, _ACROSS_PARTS)


def _cfg_warnings(files: Sequence[Sequence[CheckpointFile]], settings: CheckpointSettings, flat: bool,
                  name: FileName) -> list:
    out = []
    n_parts, n_shards = len(files), len(files[0])
    sharded = flat or n_shards > 1

    def warn(field_name: str, value: Any, files_say: Any) -> None:
        out.append((f"cfg.{field_name}",
                    f"cfg {field_name}={value} but the files hold {files_say}; the files are used "
                    "(a consolidated or resharded checkpoint keeps the cfg of the run it came from)."))

    if settings.model_parallel_size is not None and settings.model_parallel_size != n_parts:
        warn("common.model_parallel_size", settings.model_parallel_size, f"{n_parts} model-parallel part(s)")
    # use_sharded_state=True beside unflattened files is what a non-FSDP run saves (metaseq's
    # model-parallel transformer asserts it under pytorch_ddp): stale only under FSDP.
    ddp_saved = settings.ddp_backend is not None and settings.ddp_backend != "fully_sharded"
    if settings.use_sharded_state is not None and settings.use_sharded_state != sharded and not (
            settings.use_sharded_state and not sharded and ddp_saved):
        warn("distributed_training.use_sharded_state", settings.use_sharded_state,
             "FSDP-sharded parts" if sharded else "unsharded weights")
    if settings.distributed_world_size is not None and sharded and settings.distributed_world_size != n_parts * n_shards:
        warn("distributed_training.distributed_world_size", settings.distributed_world_size,
             f"{n_parts} part(s) x {n_shards} shard(s) = {n_parts * n_shards} ranks")
    k_parts = n_shards if name.shard_style == "_part" and name.shard is not None else 1
    if settings.checkpoint_shard_count is not None and settings.checkpoint_shard_count != k_parts:
        warn("checkpoint.checkpoint_shard_count", settings.checkpoint_shard_count, f"{k_parts} _part file(s)")
    return out
