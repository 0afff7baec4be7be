"""fairseq's patch: every fairseq entry point loads any fairseq checkpoint layout onto the
run's world size, with no flag. Checked against real fairseq 0.12.2 (see docs/fairseq/).

What :func:`patch` replaces, and why:

``checkpoint_utils.load_model_ensemble_and_task`` (``fairseq-validate``, ``-eval-lm``,
``-generate``, ``-interactive``, ``hub_utils.from_pretrained``, every ``from_pretrained``)
    Any file of a set, its folder or its un-suffixed name. fairseq merges FSDP shards only
    when the caller passes ``num_shards`` (validate and eval-lm never do, and fail with
    ``Unexpected key(s) in state_dict: "flat_param_0"``) and needs this rank's ``suffix``
    for model-parallel files. Here the engine reads what the model this process builds
    holds: all shards merged (``-shardD``, ``_partK``, nested wrapping, padding), the part
    of this rank's model-parallel group, or, without a model-parallel group, a model-parallel
    checkpoint merged into its single-process counterpart (Megatron's
    ``model_parallel_transformer_lm`` becomes ``transformer_lm`` with the same weights).
``checkpoint_utils.load_checkpoint_to_cpu``
    A folder or an un-suffixed name reads as the whole checkpoint (this rank's part); a file
    that exists reads as fairseq reads it, through the safe reader. Inside
    ``Trainer.load_checkpoint`` it returns exactly what the trainer's model holds.
``checkpoint_utils.load_checkpoint``
    ``--finetune-from-model`` may name a set by its folder or un-suffixed name: fairseq
    checks that the path is a file first.
``Trainer.load_checkpoint``
    ``checkpoint_last-shard2.pt`` of a run saved on 2 ranks is the same set; the state is
    loaded for this trainer's model (its FSDP shard for ``--use-sharded-state``, else the
    full weights), the optimizer state resharded like the weights.
``distributed.utils.broadcast_object``
    fairseq's pickles the whole state (weights included) and unpickles it with
    ``torch.load``, which refuses fairseq's own config under torch >= 2.6; tensors travel
    as raw bytes here, the rest unpickled with ``weights_only`` and the allowlist.
``options.parse_args_and_arch``
    The ``+oneload=...`` tokens the start-up hook has read are taken out of the command
    line before argparse sees them.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from typing import Any, Mapping, Optional, Tuple

from .. import _reading, _storage
from .._errors import CheckpointLayoutError, CheckpointNotFoundError
from .._hydra import ENV, split_argv
from .._optim import carry_extra_state, rest_source, same_weights_layout
from .._plan import FlatStructure
from ._core import (
    OPT_KEY,
    _before_load,
    _engine_load,
    _fsdp_root,
    _locate,
    _original,
    _Patches,
    _place_optimizer_state,
    _qkv,
    _rank_in,
    _read_rest,
    _real_group,
    _rebind,
    _remote,
    _rest_file,
    _swap,
    _TrainerLoad,
    broadcast_object,
)

__all__ = ["patch"]

logger = logging.getLogger("metaseq_oneload")

# The Trainer.load_checkpoint in progress on this thread: load_checkpoint_to_cpu, which it
# calls, then loads exactly what that trainer's model holds.
_CONTEXT = threading.local()

# fairseq's model-parallel language model (its model and arch names) and criterion, and what
# builds the same network in one process: the same parameter names, which Megatron's layers
# only split; checked to give the parts' gathered logits. Other model-parallel models are
# not mapped (their single-process networks were not checked): they need their group.
_SINGLE_PROCESS_MODEL = {
    "model_parallel_transformer_lm": "transformer_lm",
    "transformer_lm_megatron": "transformer_lm",
    "transformer_lm_megatron_11b": "transformer_lm",
}
_SINGLE_PROCESS_CRITERION = {"vocab_parallel_cross_entropy": "cross_entropy"}


def patch(patches: _Patches, *, hydra_schema: bool = False) -> None:
    """(every rank, local) Replace fairseq's loading functions (see the module docstring)
    into ``patches``. ``hydra_schema`` is metaseq's: fairseq's command lines are argparse."""
    from fairseq import checkpoint_utils, options, trainer
    from fairseq.distributed import utils as distributed_utils

    _swap(patches, checkpoint_utils, "load_checkpoint_to_cpu", _load_checkpoint_to_cpu)
    _swap(patches, checkpoint_utils, "load_model_ensemble_and_task", _load_model_ensemble_and_task)
    _swap(patches, checkpoint_utils, "load_checkpoint", _load_checkpoint)
    _swap(patches, trainer.Trainer, "load_checkpoint", _trainer_load_checkpoint)
    old = _swap(patches, distributed_utils, "broadcast_object", broadcast_object)
    _rebind(patches, "fairseq", "broadcast_object", old, broadcast_object)
    _swap(patches, options, "parse_args_and_arch", _parse_args_and_arch)


# --------------------------------------------------------------------------- helpers


def _groups(trainer: Any = None) -> Tuple[Any, Any]:
    """(local) fairseq's data- and model-parallel groups; None for a group of one, or when
    torch.distributed is not initialised. Never creates a group: fairseq's
    ``get_global_group`` would, collectively, on whichever ranks happen to ask."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None, None
    from fairseq.distributed import utils as distributed_utils

    mp = None
    if getattr(distributed_utils, "_USE_MEGATRON", False):
        from fairseq.model_parallel.megatron import mpu

        mp = mpu.get_model_parallel_group()
        dp = mpu.get_data_parallel_group()
    elif trainer is not None:
        dp = trainer.data_parallel_process_group
    else:
        dp = getattr(distributed_utils.get_global_group, "_global_group", None) or dist.group.WORLD
    return _real_group(dp), _real_group(mp)


def _finish_state(state: dict, arg_overrides: Optional[Mapping]) -> dict:
    """fairseq's tail of ``load_checkpoint_to_cpu``: the caller's overrides on ``args`` or
    ``cfg`` (an OmegaConf config that may hold argparse.Namespace values), the upgrades."""
    from fairseq import checkpoint_utils
    from fairseq.dataclass.utils import overwrite_args_by_name
    from omegaconf import OmegaConf

    if state.get("args") is not None and arg_overrides is not None:
        for name, value in arg_overrides.items():
            setattr(state["args"], name, value)
    if state.get("cfg") is not None:
        state["cfg"] = OmegaConf.create(state["cfg"], flags={"allow_objects": True})
        if arg_overrides is not None:
            overwrite_args_by_name(state["cfg"], arg_overrides)
    return checkpoint_utils._upgrade_state_dict(state)


def _as_saved(path: str, arg_overrides) -> dict:
    """(local) The file ``path`` as fairseq's own ``load_checkpoint_to_cpu`` returns it,
    read through the safe reader (not memory-mapped: training may overwrite the file)."""
    state = _reading.load_object(os.fspath(path), mmap=False)
    if not isinstance(state, dict):
        raise CheckpointLayoutError(f"{path}: expected a fairseq checkpoint (a dict), found {type(state).__name__}.")
    return _finish_state(state, arg_overrides)


def _get(node: Any, key: str) -> Any:
    return node.get(key) if isinstance(node, Mapping) else getattr(node, key, None)


def _set(node: Any, key: str, value: Any) -> None:
    if isinstance(node, dict):
        node[key] = value
    elif isinstance(node, argparse.Namespace) or hasattr(node, key):
        setattr(node, key, value)


def _single_process(state: dict, layout) -> list:
    """(local) Make the saved config of a model-parallel checkpoint build its single-process
    counterpart (a process without a model-parallel group cannot build Megatron's layers);
    returns what changed, as (key, old, new). The weights are the merged parts, so the
    network computes what the parts computed together."""
    changes = []
    cfg = state.get("cfg")
    if not isinstance(cfg, Mapping):
        return changes
    model, criterion = cfg.get("model"), cfg.get("criterion")
    for key in ("_name", "arch"):
        old = _get(model, key)
        if isinstance(old, str) and old in _SINGLE_PROCESS_MODEL:
            _set(model, key, _SINGLE_PROCESS_MODEL[old])
            changes.append((f"model.{key}", old, _SINGLE_PROCESS_MODEL[old]))
    # fairseq's registry reads an argparse.Namespace by its field name ("criterion"), a
    # config by "_name"; an old checkpoint's cfg nodes are Namespaces of all the arguments.
    for node, key in ((criterion, "_name"), (criterion, "criterion"), (model, "criterion")):
        old = _get(node, key)
        if isinstance(old, str) and old in _SINGLE_PROCESS_CRITERION:
            _set(node, key, _SINGLE_PROCESS_CRITERION[old])
            if node is criterion:
                changes.append((f"criterion.{key}", old, _SINGLE_PROCESS_CRITERION[old]))
    for node in (cfg.get("common"), model):
        if node is not None and _get(node, "model_parallel_size") not in (None, 1):
            _set(node, "model_parallel_size", 1)
    return changes


def _pad_dictionaries(task: Any, multiple: int) -> None:
    """Pad the task's dictionaries as Megatron's build did (``pad_to_multiple_``), so that
    the single-process model has the saved vocabulary rows."""
    seen = set()
    for name in ("source_dictionary", "target_dictionary"):
        try:
            d = getattr(task, name, None)
        except (AttributeError, NotImplementedError):
            d = None
        if d is not None and id(d) not in seen and hasattr(d, "pad_to_multiple_"):
            seen.add(id(d))
            d.pad_to_multiple_(multiple)


# --------------------------------------------------------------------------- checkpoint_utils


def _load_checkpoint_to_cpu(path, arg_overrides=None, load_on_all_ranks=False):
    """(all ranks that load; collective over the groups the load uses) fairseq's
    ``load_checkpoint_to_cpu`` through the engine.

    In a trainer's ``load_checkpoint``, ``state["model"]`` is exactly what that trainer's
    model holds. Elsewhere a file that exists reads as fairseq reads it (fairseq's own
    scripts read shards one by one); a folder or an un-suffixed name gives the whole
    checkpoint, merged for this process (its model-parallel part where it has a group).
    """
    if _remote(path):
        return _original("fairseq.checkpoint_utils.load_checkpoint_to_cpu")(path, arg_overrides, load_on_all_ranks)
    ctx: Optional[_TrainerLoad] = getattr(_CONTEXT, "load", None)
    if ctx is not None and ctx.layout is not None:
        dp, mp = _CONTEXT.groups
        return _engine_state(ctx.layout, ctx, dp, mp, arg_overrides)
    if _storage.isfile(os.fspath(path)):
        return _as_saved(path, arg_overrides)
    dp, mp = _groups()
    with _before_load(None, mp):  # discovery on this rank before the collective load over mp
        layout = _locate(path)
    return _engine_state(layout, None, None, mp, arg_overrides)


def _engine_state(layout, ctx: Optional[_TrainerLoad], dp: Any, mp: Any, arg_overrides) -> dict:
    """(collective over the groups it loads with) A whole checkpoint state for this rank:
    weights through the engine, the rest from the file that goes with this rank, the
    optimizer state resharded like the weights, layout-specific extra_state dropped.

    fairseq's trainer reads on every data-parallel rank only for ``--use-sharded-state``
    (each its own flat shard); otherwise data-parallel rank 0 reads the full weights alone
    and broadcasts them, so that load must not wait for the other ranks."""
    model_fsdp = _fsdp_root(ctx.model) if ctx is not None else None
    flat = model_fsdp is not None and ctx.use_sharded_state
    group = _real_group(model_fsdp.process_group) if flat else None
    metadata = model_fsdp.local_metadata_dict() if flat else None
    # fairseq's attention keeps split k/v/q_proj. Only the local metadata is asked: a full
    # FSDP state_dict() is collective, and here data-parallel rank 0 may be reading alone.
    qkv = _qkv(None, metadata) if flat else "keep"
    lc = _engine_load(layout, process_group=group, model_parallel_group=mp, flat=flat, shard_metadata=metadata,
                      qkv=qkv)
    mp_rank, mp_size = _rank_in(mp)
    dp_rank, dp_size = _rank_in(group)
    skip = ctx is None or ctx.reset_optimizer
    state = _read_rest(rest_source(layout, mp_rank, mp_size, dp_rank, dp_size), skip_optimizer=skip)
    state["model"] = lc.model
    state.pop("fsdp_metadata", None)
    state.pop("shard_metadata", None)
    structure = FlatStructure.from_metadata(lc.shard_metadata) if flat else None
    if ctx is None:
        state.pop(OPT_KEY, None)  # a model to evaluate: fairseq reads no optimizer state there
    elif skip:
        state[OPT_KEY] = None
    else:
        _place_optimizer_state(state, layout, flat=flat, model_fsdp=model_fsdp, part=mp_rank, parts=mp_size,
                               shard=dp_rank, shards=dp_size, ctx=ctx, qkv=qkv, structure=structure)
    if "extra_state" in state and isinstance(state["extra_state"], Mapping):
        same = same_weights_layout(layout, parts=mp_size, shards=dp_size, flat=flat, structure=structure)
        state["extra_state"], notes = carry_extra_state(
            state["extra_state"], same_parts=layout.model_parallel_size == mp_size, same_weights=same)
        for note in notes:
            logger.warning("metaseq-oneload: %s: %s", layout.display_name, note)
    if layout.model_parallel_size > 1 and mp is None:
        for key, old, new in _single_process(state, layout):
            logger.info("metaseq-oneload: %s=%s (was %s): %s has %d model-parallel parts and this process has no "
                        "model-parallel group; its single-process counterpart gets the merged weights",
                        key, new, old, layout.display_name, layout.model_parallel_size)
    return _finish_state(state, arg_overrides)


def _load_model_ensemble_and_task(filenames, arg_overrides=None, task=None, strict=True, suffix="", num_shards=1,
                                  state=None, *args, **kwargs):
    """(all ranks of fairseq's model-parallel group, where there is one; collective there)
    fairseq's ``load_model_ensemble_and_task`` with the weights read by the engine for the
    model this process builds; fairseq then builds and fills it as usual.

    ``filenames`` may name any file of each checkpoint, its folder or its un-suffixed name;
    ``suffix`` and ``num_shards`` are not needed (``num_shards`` is checked against the
    ``_partK`` files). Without a model-parallel group a model-parallel checkpoint is loaded
    into its single-process counterpart (see the module docstring).
    """
    original = _original("fairseq.checkpoint_utils.load_model_ensemble_and_task")
    if state is not None or any(_remote(f) for f in filenames):
        return original(filenames, arg_overrides, task, strict, suffix, num_shards, state, *args, **kwargs)
    ensemble, cfg = [], None
    for filename in filenames:
        layout = _locate(filename, suffix)
        k = layout.shards_per_part if layout.name.shard_style == "_part" and layout.name.shard is not None else 1
        if num_shards not in (1, k):
            raise CheckpointLayoutError(
                f"checkpoint_shard_count={num_shards} but {layout.display_name} has {k} _part file(s). "
                "Drop --checkpoint-shard-count (the files tell) or point at the right checkpoint."
            )
        dp, mp = _groups()
        mp_size = _rank_in(mp)[1]
        if mp is not None and mp_size != layout.model_parallel_size:
            raise CheckpointLayoutError(
                f"{layout.display_name}: saved with model-parallel size {layout.model_parallel_size}; this run has "
                f"--model-parallel-size {mp_size}. Run with --model-parallel-size {layout.model_parallel_size}, or "
                "with 1 (the parts are then merged into one model)."
            )
        loaded = _engine_state(layout, None, None, mp, arg_overrides)
        if layout.model_parallel_size > 1 and mp is None:
            model_cfg = loaded["cfg"].get("model") if loaded.get("cfg") is not None else None
            name = _get(model_cfg, "_name") or _get(model_cfg, "arch")
            if name not in _SINGLE_PROCESS_MODEL.values():
                raise CheckpointLayoutError(
                    f"{layout.display_name}: saved with model-parallel size {layout.model_parallel_size} (model "
                    f"{name}) and this process has no model-parallel group; only "
                    f"{', '.join(sorted(_SINGLE_PROCESS_MODEL))} have a checked single-process counterpart. "
                    "Run it with --model-parallel-size "
                    f"{layout.model_parallel_size} on {layout.model_parallel_size} ranks."
                )
            if task is None:
                from fairseq import tasks

                task = tasks.setup_task(loaded["cfg"].task)
            # Megatron's build padded the dictionary to a multiple of 8 x the saved size.
            _pad_dictionaries(task, 8 * layout.model_parallel_size)
        # Any existing file of the set: fairseq only checks that it exists, the state is ours.
        first = _rest_file(layout, None, mp)
        models, cfg, task = original([first], arg_overrides, task, strict, "", 1, loaded, *args, **kwargs)
        ensemble += models
    return ensemble, cfg, task


# --------------------------------------------------------------------------- trainer


def _load_checkpoint(cfg, trainer, **passthrough_args):
    """(all ranks; collective, as fairseq's) fairseq's ``checkpoint_utils.load_checkpoint``
    with ``--finetune-from-model`` naming a set by its folder or un-suffixed name (fairseq
    checks that the path exists as a file: ``... does not exist``); the trainer then loads
    the whole set, whatever file of it the name becomes."""
    original = _original("fairseq.checkpoint_utils.load_checkpoint")
    finetune = cfg.finetune_from_model
    if finetune is None or _remote(finetune) or _storage.isfile(finetune):
        return original(cfg, trainer, **passthrough_args)
    try:
        layout = _locate(finetune)
    except CheckpointNotFoundError:
        return original(cfg, trainer, **passthrough_args)  # fairseq says it does not exist
    cfg.finetune_from_model = layout.all_files[0].path
    try:
        return original(cfg, trainer, **passthrough_args)
    finally:
        cfg.finetune_from_model = finetune


def _trainer_load_checkpoint(self, filename, reset_optimizer=False, reset_lr_scheduler=False,
                             optimizer_overrides=None, reset_meters=False):
    """(all ranks of the trainer; collective, as fairseq's) fairseq's
    ``Trainer.load_checkpoint`` with ``filename`` resolved by layout discovery (this world
    size's ``-shardN`` need not exist) and the state loaded through the engine for exactly
    this trainer's model: its FSDP shard under ``--use-sharded-state`` (any saved shard
    count, padding included), else the full weights; the optimizer state resharded like
    the weights."""
    original = _original("fairseq.trainer.Trainer.load_checkpoint")
    if _remote(filename):
        return original(self, filename, reset_optimizer, reset_lr_scheduler, optimizer_overrides, reset_meters)
    model = self.model
    fsdp = _fsdp_root(model)
    sharded = fsdp is not None and bool(self.cfg.distributed_training.use_sharded_state)
    dp, mp = _groups(self)
    group = _real_group(fsdp.process_group) if sharded else dp
    try:
        # Discovery on this rank before the collective load: its failure stops the others now.
        with _before_load(group, mp, unless=CheckpointNotFoundError):
            layout = _locate(filename, self.checkpoint_suffix)
    except CheckpointNotFoundError:  # fairseq logs "No existing checkpoint found"
        return original(self, filename, reset_optimizer, reset_lr_scheduler, optimizer_overrides, reset_meters)
    if fsdp is not None and not sharded and not reset_optimizer:
        with _before_load(group, mp):
            _refuse_unless_full_fsdp_optimizer(layout)
    inner = getattr(self, "_model", None) or model
    names = tuple(n for n, p in inner.named_parameters() if p.requires_grad) if fsdp is None else None
    ctx = _TrainerLoad(model=model, is_fsdp=bool(self.is_fsdp), use_sharded_state=sharded,
                       reset_optimizer=bool(reset_optimizer), layout=layout, param_names=names)
    previous = getattr(_CONTEXT, "load", None), getattr(_CONTEXT, "groups", (None, None))
    _CONTEXT.load, _CONTEXT.groups = ctx, (dp, mp)
    try:
        return original(self, _rest_file(layout, group, mp), reset_optimizer, reset_lr_scheduler,
                        optimizer_overrides, reset_meters)
    finally:
        _CONTEXT.load, _CONTEXT.groups = previous


def _refuse_unless_full_fsdp_optimizer(layout) -> None:
    """(every rank, local) FSDP without sharded state takes only fairscale's full optimizer
    state (indexed by its ``param_id_map``); only data-parallel rank 0 reads the checkpoint,
    so a refusal there would leave the other ranks waiting for its broadcast. Every rank
    checks the saved format first and raises the same error."""
    if layout.flat:
        saved = "FSDP flat shards"
    else:
        opt = _reading.load_object(layout.all_files[0].path, mmap=True).get(OPT_KEY)
        if not isinstance(opt, Mapping) or "param_id_map" in opt:
            return  # fairscale's format, or nothing to restore: fairseq's own path
        saved = "an unsharded optimizer state"
    raise CheckpointLayoutError(
        f"{layout.display_name}: its optimizer state cannot be restored here: it holds {saved} and this run's "
        "optimizer (FSDP without --use-sharded-state) expects a full FSDP optimizer state. Pass "
        "--use-sharded-state to have it resharded, or --reset-optimizer to start from fresh optimizer state "
        "(the weights load either way).")


# --------------------------------------------------------------------------- command line


def _parse_args_and_arch(parser, input_args=None, *args, **kwargs):
    """(local) fairseq's ``options.parse_args_and_arch`` without the ``oneload`` overrides
    that the start-up hook has already composed (they are in ``METASEQ_ONELOAD`` then):
    argparse would reject ``+oneload=auto``."""
    if os.environ.get(ENV, "").strip():
        if input_args is None:
            sys.argv[1:] = split_argv(sys.argv[1:])[0]
        else:
            input_args = split_argv(input_args)[0]
    return _original("fairseq.options.parse_args_and_arch")(parser, input_args, *args, **kwargs)
