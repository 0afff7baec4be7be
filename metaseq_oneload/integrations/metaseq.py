"""metaseq's patch: what :func:`metaseq_oneload.install` replaces in metaseq, so that every
checkpoint load of every metaseq script goes through the engine (the bookkeeping that puts
metaseq back as it was is :mod:`._core`'s).

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
import threading
from typing import Any, Mapping, Optional, Tuple

from .. import _reading, _storage
from .._errors import CheckpointLayoutError, CheckpointNotFoundError
from .._hydra import ENV, CheckpointSettingsError, register_configs, split_argv
from .._optim import carry_extra_state, rest_source, same_weights_layout
from .._plan import FlatStructure
from ._core import (
    OPT_KEY,
    _before_load,
    _engine_load,
    _exists,
    _fsdp_load_local,
    _fsdp_root,
    _fuse_split_qkv,
    _locate,
    _named_part,
    _original,
    _part_layout,
    _Patches,
    _place_optimizer_state,
    _qkv,
    _rank_in,
    _real_group,
    _rebind,
    _remote,
    _rest_file,
    _same_everywhere,
    _swap,
    _TrainerLoad,
    broadcast_object,
    fill_from_checkpoint,
)
from ._core import _read_rest as _read_any

__all__ = ["patch"]

logger = logging.getLogger("metaseq_oneload")

# The Trainer.load_checkpoint in progress on this thread: load_checkpoint_to_cpu, which it
# calls, then loads exactly what that trainer's model holds.
_CONTEXT = threading.local()


def patch(patches: _Patches, *, hydra_schema: bool = False) -> None:
    """(every rank, local) Replace metaseq's loading functions (see the module docstring)
    into ``patches``; ``hydra_schema``: also give metaseq's base_config a ``oneload`` node."""
    from metaseq import checkpoint_utils, file_io, options, trainer
    from metaseq.dataclass.configs import MetaseqConfig
    from metaseq.distributed import fully_sharded_data_parallel as fsdp_module
    from metaseq.distributed import utils as distributed_utils

    old = _swap(patches, file_io, "torch_load_cpu", _torch_load_cpu)
    try:  # imports torch_load_cpu's caller by name; imported here so that it is patched too
        importlib.import_module("metaseq.distributed.stitch_fsdp_ckpt")
    except Exception as e:  # noqa: BLE001  (any import-time failure: that module stays unpatched)
        logger.debug("metaseq.distributed.stitch_fsdp_ckpt not importable: %s: %s", type(e).__name__, e)
    _rebind(patches, "metaseq", "torch_load_cpu", old, _torch_load_cpu)

    _swap(patches, checkpoint_utils, "load_checkpoint_to_cpu", _load_checkpoint_to_cpu)
    _swap(patches, checkpoint_utils, "load_model_ensemble_and_task", _load_model_ensemble_and_task)
    _swap(patches, checkpoint_utils, "load_checkpoint", _load_checkpoint)
    _swap(patches, trainer.Trainer, "load_checkpoint", _trainer_load_checkpoint)
    old = _swap(patches, distributed_utils, "broadcast_object", broadcast_object)
    _rebind(patches, "metaseq", "broadcast_object", old, broadcast_object)
    _swap(patches, distributed_utils, "call_main", _call_main)
    _swap(patches, options, "parse_args_and_arch", _parse_args_and_arch)
    if getattr(fsdp_module, "has_FSDP", False):
        _swap(patches, fsdp_module.FullyShardedDataParallel, "load_state_dict", _fsdp_wrapper_load_state_dict)
    try:  # needs the tokenizers package (and whatever else it imports); training does not
        hub_utils = importlib.import_module("metaseq.hub_utils")
    except Exception as e:  # noqa: BLE001  (not only ImportError: any failure of its imports)
        logger.warning("metaseq-oneload: metaseq.hub_utils cannot be imported (%s: %s); "
                       "GeneratorInterface.load_model is not patched", type(e).__name__, e)
    else:
        _swap(patches, hub_utils.GeneratorInterface, "load_model", _generator_load_model)

    if hydra_schema:
        # metaseq's structured base_config gains an optional `oneload` node, so that Hydra
        # apps composing metaseq's config accept +oneload=...; metaseq's own comes back on undo.
        register_configs(MetaseqConfig, "base_config")
        patches.on_undo(lambda: _restore_base_config(MetaseqConfig))


def _restore_base_config(base: type) -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="base_config", node=base)


def _groups() -> Tuple[Any, Any]:
    """(local) metaseq's data- and model-parallel groups; None for a group of one, or when
    torch.distributed is not initialised."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None, None
    from metaseq.distributed import utils as distributed_utils

    dp = distributed_utils.get_data_parallel_group()
    # Without Megatron metaseq has no model-parallel group (its world-size helper would
    # then answer with the global world size).
    mp = distributed_utils.get_model_parallel_group() if getattr(distributed_utils, "_USE_MEGATRON", False) else None
    return _real_group(dp), _real_group(mp)


def _cast_cfg(state: dict) -> None:
    from metaseq import file_io

    if isinstance(state, dict) and state.get("cfg") is not None:
        state["cfg"] = file_io.recursively_cast_dictconfigs(state["cfg"])

def _read_rest(path: str, *, skip_optimizer: bool) -> dict:
    """(local) :func:`._core._read_rest` with metaseq's cfg cast (DictConfigs as metaseq keeps them)."""
    return _read_any(path, skip_optimizer=skip_optimizer, cast=_cast_cfg)


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


# --------------------------------------------------------------------------- torch_load_cpu


def _torch_load_cpu(path):
    """(local) metaseq's ``file_io.torch_load_cpu`` through the engine's safe reader:
    ``weights_only`` with the allowlist of classes metaseq/fairseq checkpoints carry."""
    if not isinstance(path, (str, os.PathLike)) or _remote(os.fspath(path)):
        return _original("metaseq.file_io.torch_load_cpu")(path)
    # Not memory-mapped: training may overwrite a file it loaded from while the tensors live.
    state = _reading.load_object(os.fspath(path), mmap=False)
    _cast_cfg(state)
    return state


# --------------------------------------------------------------------------- checkpoint_utils


def _load_checkpoint_to_cpu(path, arg_overrides=None, load_on_all_ranks=False):
    """(all ranks of metaseq's model-parallel group, and of the data-parallel group where
    every data-parallel rank loads: an FSDP trainer, or any FSDP-sharded checkpoint;
    collective) metaseq's ``load_checkpoint_to_cpu`` through the engine.

    In a trainer's ``load_checkpoint``, ``state["model"]`` is exactly what that trainer's
    model holds: its FSDP shard with the matching ``shard_metadata``, or its model-parallel
    part, unflattened, named as the model names its attention projections.

    Outside a trainer, ``path`` naming one existing file of the set reads as metaseq reads
    it: the file as it is when this process's layout takes it so (no model-parallel group,
    or one of the saved size; unflattened, or as many data-parallel ranks as saved shards),
    else that file's model part with its flat shards merged or split for this data-parallel
    size. A folder or an un-suffixed name gives this rank's part of the whole checkpoint.
    """
    if _remote(path):
        return _original("metaseq.checkpoint_utils.load_checkpoint_to_cpu")(path, arg_overrides, load_on_all_ranks)
    ctx: Optional[_TrainerLoad] = getattr(_CONTEXT, "load", None)
    dp, mp = _groups()
    if ctx is not None and ctx.layout is not None:
        return _engine_state(ctx.layout, ctx, dp, mp, arg_overrides)
    # Discovery on this rank before the collective load: its failure stops the others now.
    with _before_load(dp, mp):
        layout = _locate(path)
    part = _named_part(path, layout) if ctx is None else None
    if part is not None and (mp is None or _rank_in(mp)[1] == layout.model_parallel_size):
        if not layout.flat or layout.shards_per_part == _rank_in(dp)[1]:
            return _as_saved(path, layout, arg_overrides)
        layout, mp = _part_layout(layout, part), None
    return _engine_state(layout, ctx, dp, mp, arg_overrides)


def _as_saved(path, layout, arg_overrides) -> dict:
    """(local) The file ``path`` as metaseq's own ``load_checkpoint_to_cpu`` returns it,
    read through the safe reader (not memory-mapped). Split ``k_proj``/``v_proj``/``q_proj``
    of a metaseq checkpoint (its consolidated singletons) come fused into ``qkv_proj``: no
    metaseq model has split projections, and metaseq's reshard scripts read both."""
    state = _torch_load_cpu(path)
    if not isinstance(state, dict):
        raise CheckpointLayoutError(f"{path}: expected a metaseq checkpoint (a dict), found {type(state).__name__}.")
    if layout.flavor == "metaseq" and isinstance(state.get("model"), Mapping) and not layout.flat:
        state["model"] = _fuse_split_qkv(state["model"])
    return _finish_state(state, arg_overrides)


def _engine_state(layout, ctx: Optional[_TrainerLoad], dp: Any, mp: Any, arg_overrides) -> dict:
    """(collective over the groups it loads with) A whole checkpoint state for this rank:
    weights through the engine, the rest from the file that goes with this rank, the
    optimizer state resharded like the weights, layout-specific extra_state dropped."""
    model_fsdp = _fsdp_root(ctx.model) if ctx is not None else None
    if ctx is not None:
        flat = model_fsdp is not None
        # metaseq's trainer loads on every data-parallel rank only with FSDP.
        group = (_real_group(model_fsdp.process_group) if model_fsdp is not None else dp) if ctx.is_fsdp else None
    else:
        flat = layout.flat
        group = dp if flat else None
    metadata = model_fsdp.local_metadata_dict() if model_fsdp is not None else None
    qkv = _qkv(ctx.model, metadata) if ctx is not None else "auto"
    lc = _engine_load(layout, process_group=group, model_parallel_group=mp, flat=flat, shard_metadata=metadata,
                      qkv=qkv)
    mp_rank, mp_size = _rank_in(mp)
    dp_rank, dp_size = _rank_in(group)
    skip = bool(ctx is not None and ctx.reset_optimizer)
    state = _read_rest(rest_source(layout, mp_rank, mp_size, dp_rank, dp_size), skip_optimizer=skip)
    state["model"] = lc.model
    state.pop("fsdp_metadata", None)
    structure = FlatStructure.from_metadata(lc.shard_metadata) if flat else None
    if flat:
        state["shard_metadata"] = lc.shard_metadata
    else:
        state.pop("shard_metadata", None)
    if skip:
        state[OPT_KEY] = None
    else:
        _place_optimizer_state(state, layout, flat=flat, model_fsdp=model_fsdp, part=mp_rank, parts=mp_size,
                               shard=dp_rank, shards=dp_size, ctx=ctx, qkv=qkv, structure=structure)
    if "extra_state" in state:
        same = same_weights_layout(layout, parts=mp_size, shards=dp_size, flat=flat, structure=structure)
        state["extra_state"], notes = carry_extra_state(
            state["extra_state"], same_parts=layout.model_parallel_size == mp_size, same_weights=same)
        for note in notes:
            logger.warning("metaseq-oneload: %s: %s", layout.display_name, note)
    return _finish_state(state, arg_overrides)


def _load_weights(model: Any, layout, *, strict: bool = True) -> Any:
    """(all ranks of metaseq's data- and model-parallel groups; collective) Fill ``model``
    with exactly what it holds: its FSDP shard for a fairscale FSDP model, else its
    model-parallel part. Returns the engine's LoadReport."""
    dp, mp = _groups()
    fsdp = _fsdp_root(model)
    if fsdp is not None:
        metadata = fsdp.local_metadata_dict()
        lc = _engine_load(layout, process_group=_real_group(fsdp.process_group), model_parallel_group=mp, flat=True,
                          shard_metadata=metadata, qkv=_qkv(fsdp, metadata))
        _fsdp_load_local(fsdp, lc.model, strict=strict)
    else:
        lc = _engine_load(layout, process_group=dp, model_parallel_group=mp, flat=False, qkv=_qkv(model))
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
    if state is not None or any(_remote(f) for f in filenames):
        return _original("metaseq.checkpoint_utils.load_model_ensemble_and_task")(
            filenames, arg_overrides, task, strict, suffix, num_shards, state, build_model_hook)
    from metaseq import tasks

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
        rest = _finish_state(_read_rest(_rest_file(layout, None, mp), skip_optimizer=True), arg_overrides)
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


def _load_checkpoint(cfg, trainer, **passthrough_args):
    """(all ranks; collective, as metaseq's) metaseq's ``checkpoint_utils.load_checkpoint``
    with ``--finetune-from-model`` resolved by layout discovery (a folder, any file, the
    un-suffixed name, whatever this world size's suffix) and an existing
    ``checkpoint_last`` set seen as such even when this rank's suffixed file is not in it."""
    original = _original("metaseq.checkpoint_utils.load_checkpoint")
    finetune = cfg.finetune_from_model
    resets = cfg.reset_optimizer or cfg.reset_lr_scheduler or cfg.reset_meters or cfg.reset_dataloader
    if finetune is None or _remote(finetune) or resets:
        return original(cfg, trainer, **passthrough_args)
    try:
        dp, mp = _groups()
        with _before_load(dp, mp):  # the trainer's collective load follows: its ranks must not wait
            if cfg.restore_file == "checkpoint_last.pt" and _exists(os.path.join(cfg.save_dir, "checkpoint_last.pt")):
                cfg.finetune_from_model = None  # a restart resumes from checkpoint_last, as metaseq intends
            elif not _storage.exists(finetune):
                cfg.finetune_from_model = _rest_file(_locate(finetune), dp, mp)
        return original(cfg, trainer, **passthrough_args)
    finally:
        cfg.finetune_from_model = finetune
def _trainer_load_checkpoint(self, filename, reset_optimizer=False, reset_lr_scheduler=False,
                             optimizer_overrides=None, reset_meters=False):
    """(all ranks of the trainer; collective, as metaseq's) metaseq's
    ``Trainer.load_checkpoint`` with ``filename`` resolved by layout discovery and the state
    loaded through the engine for exactly this trainer's model: its FSDP shard (any saved
    shard count, padding included) or its model-parallel part; the optimizer state
    resharded like the weights (data- and model-parallel sizes)."""
    original = _original("metaseq.trainer.Trainer.load_checkpoint")
    if _remote(filename):
        return original(self, filename, reset_optimizer, reset_lr_scheduler, optimizer_overrides, reset_meters)
    model = self.model
    fsdp = _fsdp_root(model)
    dp, mp = _groups()
    group = _real_group(fsdp.process_group) if fsdp is not None else dp
    try:
        # Discovery on this rank before the collective load: its failure stops the others now.
        with _before_load(group, mp, unless=CheckpointNotFoundError):
            layout = _locate(filename, self.checkpoint_suffix)
    except CheckpointNotFoundError:  # metaseq logs "No existing checkpoint found"
        return original(self, filename, reset_optimizer, reset_lr_scheduler, optimizer_overrides, reset_meters)
    inner = getattr(self, "_model", None) or model
    names = tuple(n for n, p in inner.named_parameters() if p.requires_grad) if fsdp is None else None
    ctx = _TrainerLoad(model=model, is_fsdp=bool(self.is_fsdp), use_sharded_state=bool(self.use_sharded_state),
                       reset_optimizer=bool(reset_optimizer), layout=layout, param_names=names)
    previous = getattr(_CONTEXT, "load", None)
    _CONTEXT.load = ctx
    try:
        return original(self, _rest_file(layout, group, mp), reset_optimizer, reset_lr_scheduler,
                        optimizer_overrides, reset_meters)
    finally:
        _CONTEXT.load = previous

# --------------------------------------------------------------------------- settings


def _parse_args_and_arch(parser, input_args=None, *args, **kwargs):
    """(local) metaseq's ``options.parse_args_and_arch`` without the ``oneload`` overrides
    that the start-up hook has already composed (they are in ``METASEQ_ONELOAD`` then):
    argparse would reject them, e.g. from a program the hook did not know to be metaseq's."""
    if os.environ.get(ENV, "").strip():
        if input_args is None:
            kept, tokens = split_argv(sys.argv[1:])
            sys.argv[1:] = kept
        else:
            input_args = split_argv(input_args)[0]
    return _original("metaseq.options.parse_args_and_arch")(parser, input_args, *args, **kwargs)


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
    return _original("metaseq.distributed.utils.call_main")(cfg, main, **kwargs)


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
    return _original("metaseq.hub_utils.GeneratorInterface.load_model")(self)

# --------------------------------------------------------------------------- FSDP


def _fsdp_wrapper_load_state_dict(self, state_dict, strict=True):
    """(all ranks of the FSDP group; collective) metaseq's FSDP wrapper ``load_state_dict``:
    a local (flat) state dict goes to fairscale's local load, usable before the first
    forward; a full one reaches every rank without pickling it (not at all when every rank
    holds the same already)."""
    from fairscale.nn.data_parallel import FullyShardedDataParallel

    if self.use_sharded_state or getattr(state_dict, "shard_metadata", None) is not None:
        return _fsdp_load_local(self, state_dict, strict)
    group = _real_group(self.process_group)
    if group is not None:
        state_dict = _same_everywhere(state_dict, group)
    return FullyShardedDataParallel.load_state_dict(self, state_dict, strict)
