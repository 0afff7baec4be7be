"""metaseq and fairseq checkpoints: training dicts (``model``, ``cfg`` or old ``args``,
``optimizer_history``, ``extra_state``, ``shard_metadata``/``fsdp_metadata``) in ``.pt``
files named by the metaseq/fairseq grammar (see :mod:`metaseq_oneload._layout`).

What this module knows that the shared torch machinery does not: what the ``cfg`` says
(and that it is stale in consolidated and resharded files: the files win, the cfg becomes a
warning), which saves the files belong to, and which of the two libraries wrote them.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Sequence

from .._errors import CheckpointLayoutError, cap_list
from .._layout import CheckpointFile, CheckpointLayout, CheckpointSettings, FileName, _get, model_args_of
from . import _index, _torchsave

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
    if indexed is not None:
        return dataclasses.replace(indexed, aliases=fs.aliases)
    layout = _from_headers(_torchsave.read_set(path, trust_pickle=trust_pickle, resolved=resolved), trust_pickle)
    if stale_index:
        layout = dataclasses.replace(layout, warnings=layout.warnings + (stale_index,))
    return layout


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
    parts, metadata_key, stale = _torchsave.build_parts(ts)
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
    cfg = first.get("cfg") if isinstance(first.get("cfg"), Mapping) else None
    # metaseq's config has a "reshard" section fairseq's lacks; flattened into old-style
    # args it leaves its keys there.
    args = first.get("args")
    if ((cfg is not None and "reshard" in cfg) or any(".qkv_proj." in n for n in parts[0].tensors)
            or (args is not None and _get(args, "target_world_size") is not None and _get(args, "do_pad") is not None)):
        flavor = "metaseq"
    elif first.get("cfg") is not None or first.get("args") is not None:
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
        warnings=tuple(w for _, w in stale + stale_cfg),
        stale_metadata=tuple(dict.fromkeys(k for k, _ in stale + stale_cfg)),
        trust_pickle=trust_pickle,
    )


def _cfg_value(header: Any, section: str, key: str) -> Any:
    if not isinstance(header, Mapping):
        return None
    value = _get(_get(header.get("cfg"), section), key)
    if value is None:
        value = _get(_get(header.get("cfg"), "model"), key)
    if value is None:
        value = _get(header.get("args"), key)
    return value

def _settings(header: Any) -> CheckpointSettings:
    def as_int(v):
        return None if v is None else int(v)

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
    hist = header.get("optimizer_history")
    if isinstance(hist, (list, tuple)) and hist and isinstance(hist[-1], Mapping):
        updates = hist[-1].get("num_updates")
    it = _get(header.get("extra_state"), "train_iterator")
    # The identity this package's own writers (convert, consolidate) put in every file of
    # one output set tells two sets apart even at the same step.
    save_id = _get(header.get("oneload_save"), "save_id")
    world = _cfg_value(header, "distributed_training", "distributed_world_size")
    return (updates, _get(it, "epoch"), _get(it, "iterations_in_epoch"), save_id, world)

def _cfg_warnings(files: Sequence[Sequence[CheckpointFile]], settings: CheckpointSettings, flat: bool,
                  name: FileName) -> list:
    out = []
    n_parts, n_shards = len(files), len(files[0])
    sharded = flat or n_shards > 1

    def warn(field_name: str, value: Any, files_say: Any) -> None:
        out.append((f"cfg.{field_name}",
                    f"cfg {field_name}={value} but the files hold {files_say}; using the files "
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
