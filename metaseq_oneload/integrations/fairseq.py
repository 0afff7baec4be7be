"""fairseq's patch: every fairseq entry point loads any fairseq checkpoint layout onto the
run's world size, with no flag. Checked against real fairseq 0.12.2 (see docs/fairseq/). The
logic is :mod:`._core`'s, the same for metaseq; this module declares what fairseq keeps where
(:data:`FAIRSEQ`) and the one thing only fairseq does: a model-parallel checkpoint merged
into its single-process counterpart.

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
from typing import Any, Mapping, Optional, Tuple

from .. import _storage
from .._errors import CheckpointLayoutError, CheckpointNotFoundError
from ._broadcast import broadcast_object
from ._checkpoint import before_load, locate, rank_in, real_group, remote, rest_file
from ._core import (Framework, engine_state, load_checkpoint, load_checkpoint_to_cpu, locate_model,
                    parse_args_and_arch, read_as_saved, trainer_load_checkpoint)
from ._patching import Patches, original, rebind, swap

__all__ = ["patch", "FAIRSEQ"]

logger = logging.getLogger("metaseq_oneload")

_SINGLE_PROCESS_MODEL = {
    "model_parallel_transformer_lm": "transformer_lm",
    "transformer_lm_megatron": "transformer_lm",
    "transformer_lm_megatron_11b": "transformer_lm",
}


_SINGLE_PROCESS_CRITERION = {"vocab_parallel_cross_entropy": "cross_entropy"}


def patch(patches: Patches, *, hydra_schema: bool = False) -> None:
    """(every rank, local) Replace fairseq's loading functions (see the module docstring)
    into ``patches``. ``hydra_schema`` is metaseq's: fairseq's command lines are argparse."""
    from fairseq import checkpoint_utils, options, trainer
    from fairseq.distributed import utils as distributed_utils

    swap(patches, checkpoint_utils, "load_checkpoint_to_cpu", _load_checkpoint_to_cpu)
    swap(patches, checkpoint_utils, "load_model_ensemble_and_task", _load_model_ensemble_and_task)
    swap(patches, checkpoint_utils, "load_checkpoint", _load_checkpoint)
    swap(patches, trainer.Trainer, "load_checkpoint", _trainer_load_checkpoint)
    old = swap(patches, distributed_utils, "broadcast_object", broadcast_object)
    rebind(patches, "fairseq", "broadcast_object", old, broadcast_object)
    swap(patches, options, "parse_args_and_arch", _parse_args_and_arch)


# --------------------------------------------------------------------------- what fairseq keeps where


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
    return real_group(dp), real_group(mp)


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


def _read_file(path, arg_overrides) -> dict:
    """(all ranks of fairseq's model-parallel group, where there is one; collective there)
    ``load_checkpoint_to_cpu`` outside a trainer: a file that exists reads as fairseq reads
    it (fairseq's own scripts read shards one by one); a folder or an un-suffixed name gives
    the whole checkpoint, merged for this process (its model-parallel part where it has a
    group)."""
    if _storage.isfile(os.fspath(path)):
        return _finish_state(read_as_saved(FAIRSEQ, path), arg_overrides)
    dp, mp = _groups()
    with before_load(None, mp):  # discovery on this rank before the collective load over mp
        layout = locate(path)
    return engine_state(FAIRSEQ, layout, None, None, mp, arg_overrides)


def _finetune_path(cfg, finetune: str) -> Any:
    """(local) What fairseq's ``load_checkpoint`` gets for ``--finetune-from-model``: a
    set's first file where the name is its folder or un-suffixed name (fairseq checks that
    the path exists as a file: ``... does not exist``); the trainer then loads the whole set,
    whatever file of it the name becomes."""
    if _storage.isfile(finetune):
        return finetune
    try:
        return locate(finetune).all_files[0].path
    except CheckpointNotFoundError:
        return finetune  # fairseq says it does not exist


def _merge_parts(state: dict, layout, mp: Any) -> None:
    """(local) A model-parallel checkpoint read by a process without a model-parallel group
    (its parts merged): its config made to build the single-process counterpart."""
    if layout.model_parallel_size > 1 and mp is None:
        for key, old, new in _single_process(state, layout):
            logger.info("metaseq-oneload: %s=%s (was %s): %s has %d model-parallel parts and this process has no "
                        "model-parallel group; its single-process counterpart gets the merged weights",
                        key, new, old, layout.display_name, layout.model_parallel_size)


FAIRSEQ = Framework(
    name="fairseq", groups=_groups, finish_state=_finish_state, read_file=_read_file, finetune_path=_finetune_path,
    sharded_state="cfg.distributed_training.use_sharded_state", flat_needs_sharded_state=True,
    as_saved_outside_trainer=False, qkv_from_model=False, keeps_shard_metadata=False, adapt_state=_merge_parts)


# --------------------------------------------------------------------------- the patched functions


def _load_checkpoint_to_cpu(path, arg_overrides=None, load_on_all_ranks=False):
    """(all ranks that load; collective over the groups the load uses) fairseq's
    ``load_checkpoint_to_cpu`` through the engine. In a trainer's ``load_checkpoint``,
    ``state["model"]`` is exactly what that trainer's model holds; elsewhere see
    :func:`_read_file`."""
    return load_checkpoint_to_cpu(FAIRSEQ, path, arg_overrides, load_on_all_ranks)


def _load_checkpoint(cfg, trainer, **passthrough_args):
    """(all ranks; collective, as fairseq's) fairseq's ``checkpoint_utils.load_checkpoint``
    with ``--finetune-from-model`` naming a set by its folder or un-suffixed name."""
    return load_checkpoint(FAIRSEQ, cfg, trainer, **passthrough_args)


def _trainer_load_checkpoint(self, filename, reset_optimizer=False, reset_lr_scheduler=False,
                             optimizer_overrides=None, reset_meters=False):
    """(all ranks of the trainer; collective, as fairseq's) fairseq's
    ``Trainer.load_checkpoint`` through the engine for exactly this trainer's model: its FSDP
    shard under ``--use-sharded-state`` (any saved shard count, padding included), else the
    full weights (data-parallel rank 0 reads, fairseq broadcasts); the optimizer state
    resharded like the weights."""
    return trainer_load_checkpoint(FAIRSEQ, self, filename, reset_optimizer, reset_lr_scheduler,
                                   optimizer_overrides, reset_meters)


def _parse_args_and_arch(parser, input_args=None, *args, **kwargs):
    """(local) fairseq's ``options.parse_args_and_arch`` without the ``oneload`` overrides."""
    return parse_args_and_arch(FAIRSEQ, parser, input_args, *args, **kwargs)


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
    library = original("fairseq.checkpoint_utils.load_model_ensemble_and_task")
    if state is not None or any(remote(f) for f in filenames):
        return library(filenames, arg_overrides, task, strict, suffix, num_shards, state, *args, **kwargs)
    ensemble, cfg = [], None
    for filename in filenames:
        layout = locate_model(filename, suffix, num_shards)
        dp, mp = _groups()
        mp_size = rank_in(mp)[1]
        if mp is not None and mp_size != layout.model_parallel_size:
            raise CheckpointLayoutError(
                f"{layout.display_name}: saved with model-parallel size {layout.model_parallel_size}; this run has "
                f"--model-parallel-size {mp_size}. Run with --model-parallel-size {layout.model_parallel_size}, or "
                "with 1 (the parts are then merged into one model)."
            )
        loaded = engine_state(FAIRSEQ, layout, None, None, mp, arg_overrides)
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
        first = rest_file(layout, None, mp)
        models, cfg, task = library([first], arg_overrides, task, strict, "", 1, loaded, *args, **kwargs)
        ensemble += models
    return ensemble, cfg, task

