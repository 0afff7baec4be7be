"""metaseq's patch: what :func:`metaseq_oneload.install` replaces in metaseq, so that every
checkpoint load of every metaseq script goes through the engine (the logic is :mod:`._core`'s, the same
for fairseq; this module declares what metaseq keeps where, :data:`METASEQ`).

This module imports metaseq only inside :func:`patch`.

What :func:`patch` replaces, and why:

``file_io.torch_load_cpu`` (and the names bound to it by ``from ... import``)
    ``torch.load`` under torch >= 2.6 defaults to ``weights_only=True`` and refuses the
    ``argparse.Namespace`` every metaseq checkpoint pickles; the engine's reader unpickles
    with ``weights_only`` plus an allowlist instead.
``checkpoint_utils.load_checkpoint_to_cpu``
    Any file of a set, its folder or its un-suffixed name; any saved shard count onto any
    data-parallel size (metaseq's own split ignores the last shard's padding: 3 -> 2 fails);
    any saved model-parallel size; split k/v/q singletons fused as metaseq's model wants. A
    file named outside a trainer, whose layout this process can take as it is, comes back
    as metaseq returns it: that file's content (a script reading one part gets that part).
``checkpoint_utils.load_model_ensemble_and_task``
    Builds the model first, then each rank loads exactly what that model holds: its FSDP
    shard (``local_metadata_dict``) or its model-parallel part.
``checkpoint_utils.load_checkpoint`` and ``Trainer.load_checkpoint``
    ``--restore-file`` / ``--finetune-from-model`` resolved by layout discovery, whatever
    suffix this world size would give; the state loaded for exactly this trainer's model,
    optimizer state included (resharded exactly like the weights, across data- and
    model-parallel sizes).
``hub_utils.GeneratorInterface.load_model`` and ``distributed.utils.call_main``
    The loading settings filled from the files before anything is built.
``FullyShardedDataParallel.load_state_dict`` (metaseq's wrapper)
    No pickled ``broadcast_object`` of a whole state dict; fairscale 0.4.13's
    ``load_local_state_dict`` works before the first forward.
``distributed.utils.broadcast_object``
    Tensors travel as raw bytes in bounded buckets; only the small rest is pickled, and it
    is unpickled with ``weights_only`` and the allowlist; a failure reaches every rank.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from typing import Any, Mapping, Optional, Tuple

from .. import _reading, _storage
from .._errors import CheckpointLayoutError
from .._hydra import CheckpointSettingsError, register_configs
from ._broadcast import broadcast_object, same_everywhere
from ._checkpoint import (answered_alone, before_load, exists, fsdp_load_local, fsdp_root, fuse_split_qkv, locate,
                          named_part, part_layout, rank_in, read_rest, real_group, remote, rest_file)
from ._core import (Framework, engine_load, engine_state, fill_from_checkpoint, load_checkpoint,
                    load_checkpoint_to_cpu, locate_model, parse_args_and_arch, qkv_of, read_as_saved,
                    trainer_load_checkpoint)
from ._patching import Patches, original, rebind, swap

__all__ = ["patch", "METASEQ"]

logger = logging.getLogger("metaseq_oneload")


def patch(patches: Patches, *, hydra_schema: bool = False) -> None:
    """(every rank, local) Replace metaseq's loading functions (see the module docstring)
    into ``patches``; ``hydra_schema``: also give metaseq's base_config a ``oneload`` node."""
    from metaseq import checkpoint_utils, file_io, options, trainer
    from metaseq.dataclass.configs import MetaseqConfig
    from metaseq.distributed import fully_sharded_data_parallel as fsdp_module
    from metaseq.distributed import utils as distributed_utils

    old = swap(patches, file_io, "torch_load_cpu", _torch_load_cpu)
    try:  # imports torch_load_cpu's caller by name; imported here so that it is patched too
        importlib.import_module("metaseq.distributed.stitch_fsdp_ckpt")
    except Exception as e:  # noqa: BLE001  (any import-time failure: that module stays unpatched)
        logger.debug("metaseq.distributed.stitch_fsdp_ckpt not importable: %s: %s", type(e).__name__, e)
    rebind(patches, "metaseq", "torch_load_cpu", old, _torch_load_cpu)

    swap(patches, checkpoint_utils, "load_checkpoint_to_cpu", _load_checkpoint_to_cpu)
    swap(patches, checkpoint_utils, "load_model_ensemble_and_task", _load_model_ensemble_and_task)
    swap(patches, checkpoint_utils, "load_checkpoint", _load_checkpoint)
    swap(patches, trainer.Trainer, "load_checkpoint", _trainer_load_checkpoint)
    old = swap(patches, distributed_utils, "broadcast_object", broadcast_object)
    rebind(patches, "metaseq", "broadcast_object", old, broadcast_object)
    swap(patches, distributed_utils, "call_main", _call_main)
    swap(patches, options, "parse_args_and_arch", _parse_args_and_arch)
    if getattr(fsdp_module, "has_FSDP", False):
        swap(patches, fsdp_module.FullyShardedDataParallel, "load_state_dict", _fsdp_wrapper_load_state_dict)
    try:  # needs the tokenizers package (and whatever else it imports); training does not
        hub_utils = importlib.import_module("metaseq.hub_utils")
    except Exception as e:  # noqa: BLE001  (not only ImportError: any failure of its imports)
        logger.warning("metaseq-oneload: metaseq.hub_utils cannot be imported (%s: %s); "
                       "GeneratorInterface.load_model is not patched", type(e).__name__, e)
    else:
        swap(patches, hub_utils.GeneratorInterface, "load_model", _generator_load_model)

    if hydra_schema:
        # metaseq's structured base_config gains an optional `oneload` node, so that Hydra
        # apps composing metaseq's config accept +oneload=...; metaseq's own comes back on undo.
        register_configs(MetaseqConfig, "base_config")
        patches.on_undo(lambda: _restore_base_config(MetaseqConfig))


# --------------------------------------------------------------------------- what metaseq keeps where


def _groups(trainer: Any = None) -> Tuple[Any, Any]:
    """(local) metaseq's data- and model-parallel groups; None for a group of one, or when
    torch.distributed is not initialised. The same for every trainer."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None, None
    from metaseq.distributed import utils as distributed_utils

    dp = distributed_utils.get_data_parallel_group()
    # Without Megatron metaseq has no model-parallel group (its world-size helper would
    # then answer with the global world size).
    mp = distributed_utils.get_model_parallel_group() if getattr(distributed_utils, "_USE_MEGATRON", False) else None
    return real_group(dp), real_group(mp)


def _restore_base_config(base: type) -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="base_config", node=base)


def _cast_cfg(state: dict) -> None:
    from metaseq import file_io

    if isinstance(state, dict) and state.get("cfg") is not None:
        state["cfg"] = file_io.recursively_cast_dictconfigs(state["cfg"])


def _finish_state(state: dict, arg_overrides: Optional[Mapping]) -> dict:
    """metaseq's tail of load_checkpoint_to_cpu: cfg as a struct DictConfig that may hold
    argparse.Namespace values (made from an old-style ``args`` where cfg is None), the
    caller's overrides, the old-format upgrades."""
    from metaseq import checkpoint_utils
    from metaseq.dataclass.utils import overwrite_args_by_name, overwrite_keys_not_present
    from omegaconf import OmegaConf

    if state.get("cfg") is None and isinstance(state.get("args"), argparse.Namespace):
        # Older metaseq and fairseq saved their settings as one flat Namespace in "args";
        # metaseq f7ffa5f dropped the conversion fairseq still does here, and then refuses
        # the file for its missing cfg.
        from metaseq.dataclass.utils import convert_namespace_to_omegaconf

        state["cfg"] = convert_namespace_to_omegaconf(state["args"])
    if state.get("cfg") is not None:
        # allow_objects is OmegaConf's own switch (2.1 and later) for what metaseq does by
        # swapping out omegaconf._utils.is_primitive_type, which omegaconf 2.2 renamed.
        cfg = OmegaConf.create(state["cfg"], flags={"allow_objects": True})
        OmegaConf.set_struct(cfg, True)
        if arg_overrides is not None:
            overwrite_args_by_name(cfg, arg_overrides)
            # Only nested overrides ({"model": {...}}) can add keys; metaseq-validate passes flat
            # ones ({"task": "dummy_lm"}), on which metaseq's helper fails ('str' has no .items).
            overwrite_keys_not_present(cfg, {k: v for k, v in arg_overrides.items() if isinstance(v, Mapping)})
        state["cfg"] = cfg
    return checkpoint_utils._upgrade_state_dict(state)


def _read_file(path, arg_overrides) -> dict:
    """(all ranks of metaseq's model-parallel group, and of the data-parallel group for an
    FSDP-sharded checkpoint; collective) ``load_checkpoint_to_cpu`` outside a trainer.

    ``path`` naming one existing file of the set reads as metaseq reads it: the file as it
    is when this process's layout takes it so (no model-parallel group, or one of the saved
    size; unflattened, or as many data-parallel ranks as saved shards), else that file's
    model part with its flat shards merged or split for this data-parallel size. A folder or
    an un-suffixed name gives this rank's part of the whole checkpoint."""
    dp, mp = _groups()
    # Discovery on this rank before the collective load: its failure stops the others now.
    with before_load(dp, mp):
        layout = locate(path)
    part = named_part(path, layout)
    if part is not None and (mp is None or rank_in(mp)[1] == layout.model_parallel_size):
        if not layout.flat or layout.shards_per_part == rank_in(dp)[1]:
            answered_alone(dp, mp)
            return _as_saved(path, layout, arg_overrides)
        layout, mp = part_layout(layout, part), None
    return engine_state(METASEQ, layout, None, dp, mp, arg_overrides)


def _as_saved(path, layout, arg_overrides) -> dict:
    """(local) The file ``path`` as metaseq's own ``load_checkpoint_to_cpu`` returns it,
    read through the safe reader. Split ``k_proj``/``v_proj``/``q_proj`` of a metaseq
    checkpoint (its consolidated singletons) come fused into ``qkv_proj``: no metaseq model
    has split projections, and metaseq's reshard scripts read both."""
    state = read_as_saved(METASEQ, path)
    if layout.flavor == "metaseq" and isinstance(state.get("model"), Mapping) and not layout.flat:
        state["model"] = fuse_split_qkv(state["model"])
    return _finish_state(state, arg_overrides)


def _finetune_path(cfg, finetune: str) -> Any:
    """(all ranks; this rank's discovery tells the others of its failure) What metaseq's
    ``load_checkpoint`` gets for ``--finetune-from-model``: None where a restart resumes from
    an existing ``checkpoint_last`` set (seen as such even when this rank's suffixed file is
    not in it), as metaseq intends; the file that goes with this rank where the name is a
    set's folder or un-suffixed name, whatever this world size's suffix."""
    if cfg.reset_optimizer or cfg.reset_lr_scheduler or cfg.reset_meters or cfg.reset_dataloader:
        return finetune
    dp, mp = _groups()
    with before_load(dp, mp):  # the trainer's collective load follows: its ranks must not wait
        if cfg.restore_file == "checkpoint_last.pt" and exists(os.path.join(cfg.save_dir, "checkpoint_last.pt")):
            return None
        if not _storage.exists(finetune):
            return rest_file(locate(finetune), dp, mp)
    return finetune


METASEQ = Framework(
    name="metaseq", groups=_groups, finish_state=_finish_state, read_file=_read_file, finetune_path=_finetune_path,
    sharded_state="use_sharded_state", flat_needs_sharded_state=False, as_saved_outside_trainer=True,
    qkv_from_model=True, keeps_shard_metadata=True, cast_cfg=_cast_cfg)


# --------------------------------------------------------------------------- the patched functions


def _torch_load_cpu(path):
    """(local) metaseq's ``file_io.torch_load_cpu`` through the engine's safe reader:
    ``weights_only`` with the allowlist of classes metaseq/fairseq checkpoints carry."""
    if not isinstance(path, (str, os.PathLike)) or remote(os.fspath(path)):
        return original("metaseq.file_io.torch_load_cpu")(path)
    # Not memory-mapped: training may overwrite a file it loaded from while the tensors live.
    state = _reading.load_object(os.fspath(path), mmap=False)
    _cast_cfg(state)
    return state


def _load_checkpoint_to_cpu(path, arg_overrides=None, load_on_all_ranks=False):
    """(all ranks of metaseq's model-parallel group, and of the data-parallel group where
    every data-parallel rank loads: an FSDP trainer, or any FSDP-sharded checkpoint;
    collective) metaseq's ``load_checkpoint_to_cpu`` through the engine.

    In a trainer's ``load_checkpoint``, ``state["model"]`` is exactly what that trainer's
    model holds: its FSDP shard with the matching ``shard_metadata``, or its model-parallel
    part, unflattened, named as the model names its attention projections. Outside a
    trainer, see :func:`_read_file`.
    """
    return load_checkpoint_to_cpu(METASEQ, path, arg_overrides, load_on_all_ranks)


def _load_checkpoint(cfg, trainer, **passthrough_args):
    """(all ranks; collective, as metaseq's) metaseq's ``checkpoint_utils.load_checkpoint``
    with ``--finetune-from-model`` resolved by layout discovery (:func:`_finetune_path`)."""
    return load_checkpoint(METASEQ, cfg, trainer, **passthrough_args)


def _trainer_load_checkpoint(self, filename, reset_optimizer=False, reset_lr_scheduler=False,
                             optimizer_overrides=None, reset_meters=False):
    """(all ranks of the trainer; collective, as metaseq's) metaseq's
    ``Trainer.load_checkpoint`` through the engine for exactly this trainer's model: its
    FSDP shard (any saved shard count, padding included) or its model-parallel part; the
    optimizer state resharded like the weights (data- and model-parallel sizes)."""
    return trainer_load_checkpoint(METASEQ, self, filename, reset_optimizer, reset_lr_scheduler,
                                   optimizer_overrides, reset_meters)


def _parse_args_and_arch(parser, input_args=None, *args, **kwargs):
    """(local) metaseq's ``options.parse_args_and_arch`` without the ``oneload`` overrides."""
    return parse_args_and_arch(METASEQ, parser, input_args, *args, **kwargs)


def _load_weights(model: Any, layout, *, strict: bool = True) -> Any:
    """(all ranks of metaseq's data- and model-parallel groups; collective) Fill ``model``
    with exactly what it holds: its FSDP shard for a fairscale FSDP model, else its
    model-parallel part. Returns the engine's LoadReport."""
    dp, mp = _groups()
    fsdp = fsdp_root(model)
    if fsdp is not None:
        metadata = fsdp.local_metadata_dict()
        lc = engine_load(layout, process_group=real_group(fsdp.process_group), model_parallel_group=mp, flat=True,
                         shard_metadata=metadata, qkv=qkv_of(fsdp, metadata))
        fsdp_load_local(fsdp, lc.model, strict=strict)
    else:
        lc = engine_load(layout, process_group=dp, model_parallel_group=mp, flat=False, qkv=qkv_of(model))
        model.load_state_dict(lc.model, strict=strict)
    return lc.report


def _load_model_ensemble_and_task(filenames, arg_overrides=None, task=None, strict=True, suffix="", num_shards=1,
                                  state=None, build_model_hook=None):
    """(all ranks of metaseq's data- and model-parallel groups; collective) metaseq's
    ``load_model_ensemble_and_task`` through the engine: each model is built first, then
    every rank loads exactly what it holds (its FSDP shard, or its model-parallel part).

    ``filenames`` may name any file of each checkpoint, its folder or its un-suffixed name.
    ``num_shards`` (fairseq-style ``_partK`` files) is checked against the files, not needed.
    """
    if state is not None or any(remote(f) for f in filenames):
        return original("metaseq.checkpoint_utils.load_model_ensemble_and_task")(
            filenames, arg_overrides, task, strict, suffix, num_shards, state, build_model_hook)
    from metaseq import tasks

    ensemble, cfg = [], None
    for filename in filenames:
        layout = locate_model(filename, suffix, num_shards)
        dp, mp = _groups()
        rest = _finish_state(read_rest(rest_file(layout, None, mp), skip_optimizer=True, cast=_cast_cfg),
                             arg_overrides)
        cfg = rest.get("cfg")
        if cfg is None:
            raise CheckpointLayoutError(f"{layout.display_name}: no cfg in the checkpoint; expected a metaseq checkpoint.")
        if task is None:
            task = tasks.setup_task(cfg.task)
        if "task_state" in rest:
            task.load_state_dict(rest["task_state"])
        model = build_model_hook(cfg, task) if build_model_hook is not None else task.build_model(cfg.model)
        _load_weights(model, layout, strict=strict)
        logger.info("Done loading state dict")
        ensemble.append(model)
    return ensemble, cfg, task


# --------------------------------------------------------------------------- settings


def _call_main(cfg, main, **kwargs):
    """(every launched process, before distributed init) metaseq's ``call_main`` after
    filling the config's loading settings from the checkpoint the run will load, so that
    the model-parallel groups and the FSDP wrapping match the files (or the sizes the run
    chose: the engine reshards onto them). A setting that cannot be loaded onto stops the
    process with its message, on every rank alike (each fills on its own): exit code 2."""
    try:
        fill_from_checkpoint(cfg, requires=_model_requires(cfg), world_size=_run_world_size(cfg))
    except CheckpointSettingsError as e:
        sys.stderr.write(f"metaseq-oneload: {e}\n")
        sys.stderr.flush()
        raise SystemExit(2) from None
    return original("metaseq.distributed.utils.call_main")(cfg, main, **kwargs)


def _run_world_size(cfg: Any) -> Optional[int]:
    """(local) The ranks the run will have, as metaseq's ``infer_init_method`` finds them
    after this point; None where Slurm decides (metaseq reads its environment later)."""
    try:
        dt = cfg.distributed_training
        if dt.distributed_init_method is not None:
            return int(dt.distributed_world_size)
        if dt.distributed_port > 0:
            return None
        if all(k in os.environ for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK")):
            return int(os.environ["WORLD_SIZE"])
        return int(dt.distributed_world_size)  # one process, or metaseq's spawn over this node's devices
    except (AttributeError, KeyError, TypeError, ValueError):
        return None


def _model_requires(cfg: Any) -> dict:
    """(local) The loading settings the run's model needs to be built, as name -> (value,
    why): metaseq's model-parallel transformer asserts ``use_sharded_state`` whatever the
    backend and model-parallel size (under pytorch_ddp it changes nothing on disk)."""
    model = cfg.get("model") if isinstance(cfg, Mapping) else getattr(cfg, "model", None)
    arch = None
    for name in ("arch", "_name"):
        arch = arch or (model.get(name) if isinstance(model, Mapping) else getattr(model, name, None))
    if not isinstance(arch, str):
        return {}
    try:
        from metaseq.models import ARCH_MODEL_REGISTRY, MODEL_REGISTRY
        from metaseq.models.transformer_lm import ModelParallelTransformerLanguageModel
    except Exception:  # noqa: BLE001  (another metaseq: nothing known about its models)
        return {}
    cls = ARCH_MODEL_REGISTRY.get(arch) or MODEL_REGISTRY.get(arch)
    if isinstance(cls, type) and issubclass(cls, ModelParallelTransformerLanguageModel):
        return {"use_sharded_state": (True, f"metaseq's model-parallel transformer (arch {arch}) asserts it when built")}
    return {}


def _generator_load_model(self):
    """(all ranks; collective, as metaseq's) ``GeneratorInterface.load_model`` with the
    loading settings filled from ``common_eval.path`` first; its
    ``load_model_ensemble_and_task`` then goes through the engine."""
    fill_from_checkpoint(self.cfg)
    return original("metaseq.hub_utils.GeneratorInterface.load_model")(self)


# --------------------------------------------------------------------------- FSDP


def _fsdp_wrapper_load_state_dict(self, state_dict, strict=True):
    """(all ranks of the FSDP group; collective) metaseq's FSDP wrapper ``load_state_dict``:
    a local (flat) state dict goes to fairscale's local load, usable before the first
    forward; a full one reaches every rank without pickling it (not at all when every rank
    holds the same already)."""
    from fairscale.nn.data_parallel import FullyShardedDataParallel

    if self.use_sharded_state or getattr(state_dict, "shard_metadata", None) is not None:
        return fsdp_load_local(self, state_dict, strict)
    group = real_group(self.process_group)
    if group is not None:
        state_dict = same_everywhere(state_dict, group)
    return FullyShardedDataParallel.load_state_dict(self, state_dict, strict)
