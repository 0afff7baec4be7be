"""One integration core: the logic of metaseq's patch and of fairseq's, written once.

Each library's module (``metaseq.py``, ``fairseq.py``) declares a :class:`Framework` (where
the library keeps what, and the few steps it does its own way) and replaces the library's
functions with thin wrappers over the functions here:

- :func:`load_checkpoint_to_cpu`: a whole checkpoint state; inside ``Trainer.load_checkpoint``
  exactly what that trainer's model holds (:func:`engine_state`);
- :func:`trainer_load_checkpoint`: the trainer's file resolved by layout discovery, then its
  load through the engine for this trainer's model;
- :func:`load_checkpoint`: ``--finetune-from-model`` naming a set however the user names it;
- :func:`parse_args_and_arch`: argparse without the ``+oneload=...`` tokens.

Nothing here imports metaseq or fairseq.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import operator
import os
import sys
import threading
from typing import Any, Callable, List, Mapping, Optional, Tuple

from .. import _reading
from .._begun import load_call
from .._errors import CheckpointLayoutError, CheckpointNotFoundError
from .._hydra import ENV, checkpoint_path, fill_settings, split_argv
from .._loading import load_checkpoint as engine_load_checkpoint
from .._optim import carry_extra_state, rest_source, same_weights_layout
from .._plan import FlatStructure, qkv_naming
from ._checkpoint import OPT_KEY, before_load, fsdp_root, locate, rank_in, read_rest, real_group, remote, rest_file
from ._optimizer import OptimizerTarget, place_optimizer_state
from ._patching import STATE, original

__all__ = ["Framework", "TrainerLoad", "engine_load", "engine_state", "qkv_of", "read_as_saved", "locate_model",
           "load_checkpoint_to_cpu", "trainer_load_checkpoint", "load_checkpoint", "parse_args_and_arch",
           "fill_from_checkpoint"]

logger = logging.getLogger("metaseq_oneload")

# The Trainer.load_checkpoint in progress on this thread, one attribute per library:
# load_checkpoint_to_cpu, which it calls, then loads exactly what that trainer's model holds.
_CONTEXT = threading.local()


@dataclasses.dataclass(frozen=True)
class Framework:
    """What one library's patch declares: where it keeps what, and the steps it does its own
    way. Everything else is this module's, the same for both."""

    # The package: the originals the patch replaced are kept under "<name>.<module>.<function>".
    name: str
    # (trainer or None) -> this rank's (data-parallel, model-parallel) groups; None for a
    # group of one, or without torch.distributed. Never creates a group.
    groups: Callable[[Any], Tuple[Any, Any]]
    # The library's tail of load_checkpoint_to_cpu: (state, arg_overrides) -> state, with the
    # caller's overrides and the library's upgrades of old formats.
    finish_state: Callable[[dict, Optional[Mapping]], dict]
    # load_checkpoint_to_cpu outside a trainer: (path, arg_overrides) -> state. The libraries
    # differ in which files they give back as saved (their own scripts read them one by one).
    read_file: Callable[[Any, Optional[Mapping]], dict]
    # (cfg, --finetune-from-model) -> the path the library's load_checkpoint gets; the same
    # object where it is left as given.
    finetune_path: Callable[[Any, str], Any]
    # Where the trainer keeps --use-sharded-state (an attribute path on the trainer).
    sharded_state: str
    # Whether a fairscale FSDP trainer loads its flat shard (on every data-parallel rank) only
    # with --use-sharded-state: fairseq's, whose data-parallel rank 0 otherwise reads the full
    # weights alone and broadcasts them. metaseq's always loads the flat shard under FSDP.
    flat_needs_sharded_state: bool
    # Whether load_checkpoint_to_cpu outside a trainer gives the state as the library's own
    # scripts use it: flat shards stay flat and the optimizer state comes along (metaseq's
    # reshard and consolidation scripts); else the merged model to evaluate, without
    # optimizer state (fairseq's).
    as_saved_outside_trainer: bool
    # Whether the library's models name their attention projections their own way (asked of
    # the model: metaseq's fused qkv_proj, its naming where there is no model); else the stored
    # names stay (fairseq's attention keeps split k/v/q_proj).
    qkv_from_model: bool
    # Whether a flat state comes with the engine's shard_metadata (metaseq's trainer and
    # scripts read it); else none is returned.
    keeps_shard_metadata: bool
    # The library's treatment of a saved cfg, in place (metaseq keeps DictConfigs its way).
    cast_cfg: Optional[Callable[[dict], None]] = None
    # (state, layout, model-parallel group) -> None: a last change of a whole state before
    # finish_state (fairseq: a model-parallel checkpoint merged for a process without a group).
    adapt_state: Optional[Callable[[dict, Any, Any], None]] = None


@dataclasses.dataclass(frozen=True)
class TrainerLoad:
    """The Trainer.load_checkpoint in progress: what its model needs."""

    model: Any
    model_fsdp: Any  # the model if it is a fairscale FSDP root, else None
    flat: bool  # the model takes FSDP flat shards (else whole parameters)
    every_rank: bool  # every data-parallel rank loads (else data-parallel rank 0 alone)
    groups: Tuple[Any, Any]  # (data-parallel, model-parallel), as Framework.groups gave them
    layout: Any
    reset_optimizer: bool
    optimizer: OptimizerTarget


# --------------------------------------------------------------------------- the engine's load


def engine_load(layout, *, process_group=None, model_parallel_group=None, flat=False, shard_metadata=None,
                qkv="auto"):
    """(collective over the groups given) The engine's load with the installed options."""
    cfg = STATE.config
    # The layout itself, not a path: it may be one part of a set (part_layout).
    # No groups: a script's own read of a file (each rank its part), never an implied
    # collective over the default group.
    lc = engine_load_checkpoint(layout, process_group=process_group,
                                model_parallel_group=model_parallel_group, flat=flat, shard_metadata=shard_metadata,
                                strategy=cfg.strategy if cfg.enabled else "auto", bucket_mb=cfg.bucket_mb,
                                verify=cfg.verify, qkv=qkv,
                                no_dist=process_group is None and model_parallel_group is None)
    # The engine has logged the one strategy line (on the first rank of the groups).
    for w in lc.report.warnings:
        logger.info("metaseq-oneload: %s", w)
    return lc


def qkv_of(model: Any, metadata: Optional[Mapping] = None) -> str:
    """How ``model`` names its attention projections (:func:`._plan.qkv_naming`): "fused"
    (metaseq's ``qkv_proj``), "split", or "keep" (neither: stored names stay). From the
    FSDP ``metadata`` where given (a full FSDP ``state_dict()`` is collective). Without a
    model, "auto": metaseq's fused naming for metaseq checkpoints."""
    if metadata is not None:
        return qkv_naming(n for g in FlatStructure.from_metadata(metadata).groups for n in g.names)
    if model is None:
        return "auto"
    return qkv_naming(model.state_dict(keep_vars=True))


def _target(fw: Framework, layout, ctx: Optional[TrainerLoad], dp: Any) -> Tuple[bool, Any, Any, Any, str]:
    """(local) How this rank loads ``layout``: (flat, the data-parallel group the load is
    collective over or None, the model's FSDP root, its local shard_metadata, qkv naming)."""
    if ctx is None:
        flat = fw.as_saved_outside_trainer and layout.flat
        return flat, (dp if flat else None), None, None, ("auto" if fw.qkv_from_model else "keep")
    fsdp = ctx.model_fsdp
    group = ((real_group(fsdp.process_group) if fsdp is not None else dp) if ctx.every_rank else None)
    metadata = fsdp.local_metadata_dict() if ctx.flat else None
    if metadata is not None:
        qkv = qkv_of(None, metadata)
    else:
        qkv = qkv_of(ctx.model) if fw.qkv_from_model else "keep"
    return ctx.flat, group, fsdp, metadata, qkv


def engine_state(fw: Framework, layout, ctx: Optional[TrainerLoad], dp: Any, mp: Any, arg_overrides) -> dict:
    """(collective over the groups it loads with) A whole checkpoint state for this rank:
    weights through the engine, the rest from the file that goes with this rank, the
    optimizer state resharded like the weights, layout-specific extra_state dropped.

    Inside a trainer, exactly what its model holds; outside one, as ``fw`` declares."""
    flat, group, model_fsdp, metadata, qkv = _target(fw, layout, ctx, dp)
    lc = engine_load(layout, process_group=group, model_parallel_group=mp, flat=flat, shard_metadata=metadata,
                     qkv=qkv)
    mp_rank, mp_size = rank_in(mp)
    dp_rank, dp_size = rank_in(group)
    skip = ctx.reset_optimizer if ctx is not None else not fw.as_saved_outside_trainer
    state = read_rest(rest_source(layout, mp_rank, mp_size, dp_rank, dp_size), skip_optimizer=skip, cast=fw.cast_cfg)
    state["model"] = lc.model
    state.pop("fsdp_metadata", None)
    structure = FlatStructure.from_metadata(lc.shard_metadata) if flat else None
    if flat and fw.keeps_shard_metadata:
        state["shard_metadata"] = lc.shard_metadata
    else:
        state.pop("shard_metadata", None)
    if not skip:
        place_optimizer_state(state, layout, flat=flat, model_fsdp=model_fsdp, part=mp_rank, parts=mp_size,
                              shard=dp_rank, shards=dp_size, trainer=ctx.optimizer if ctx is not None else None,
                              qkv=qkv, structure=structure)
    elif ctx is not None:
        state[OPT_KEY] = None  # the trainer resets it; outside one there is none to restore
    if "extra_state" in state:
        same = same_weights_layout(layout, parts=mp_size, shards=dp_size, flat=flat, structure=structure)
        state["extra_state"], notes = carry_extra_state(
            state["extra_state"], same_parts=layout.model_parallel_size == mp_size, same_weights=same)
        for note in notes:
            logger.warning("metaseq-oneload: %s: %s", layout.display_name, note)
    if fw.adapt_state is not None:
        fw.adapt_state(state, layout, mp)
    return fw.finish_state(state, arg_overrides)


def read_as_saved(fw: Framework, path: Any) -> dict:
    """(local) The file ``path`` as the library's own ``torch.load`` gives it, through the
    safe reader; not memory-mapped: training may overwrite a file it loaded from while the
    tensors live."""
    state = _reading.load_object(os.fspath(path), mmap=False)
    if not isinstance(state, dict):
        raise CheckpointLayoutError(f"{path}: expected a {fw.name} checkpoint (a dict), found {type(state).__name__}.")
    if fw.cast_cfg is not None:
        fw.cast_cfg(state)
    return state


def locate_model(filename: Any, suffix: str, num_shards: int):
    """(local) The set one of ``load_model_ensemble_and_task``'s ``filenames`` names;
    ``num_shards`` (fairseq-style ``_partK`` files) is checked against the files, not needed."""
    layout = locate(filename, suffix)
    k = layout.shards_per_part if layout.name.shard_style == "_part" and layout.name.shard is not None else 1
    if num_shards not in (1, k):
        raise CheckpointLayoutError(
            f"checkpoint_shard_count={num_shards} but {layout.display_name} has {k} _part file(s). "
            "Drop --checkpoint-shard-count (the files tell) or point at the right checkpoint."
        )
    return layout


# --------------------------------------------------------------------------- the patched functions


@load_call()  # a discovery's note of where the call began ends with the call
def load_checkpoint_to_cpu(fw: Framework, path, arg_overrides=None, load_on_all_ranks=False):
    """(the ranks that load; collective over the groups the load uses) The library's
    ``load_checkpoint_to_cpu`` through the engine: inside its trainer's ``load_checkpoint``
    exactly what that trainer's model holds, elsewhere as ``fw.read_file`` decides."""
    if remote(path):
        return original(f"{fw.name}.checkpoint_utils.load_checkpoint_to_cpu")(path, arg_overrides, load_on_all_ranks)
    ctx: Optional[TrainerLoad] = getattr(_CONTEXT, fw.name, None)
    if ctx is not None:
        dp, mp = ctx.groups
        return engine_state(fw, ctx.layout, ctx, dp, mp, arg_overrides)
    return fw.read_file(path, arg_overrides)


@load_call()
def trainer_load_checkpoint(fw: Framework, trainer, filename, reset_optimizer=False, reset_lr_scheduler=False,
                            optimizer_overrides=None, reset_meters=False):
    """(all ranks of the trainer; collective, as the library's) ``Trainer.load_checkpoint``
    with ``filename`` resolved by layout discovery (this world size's suffixed file need not
    exist) and the state loaded through the engine for exactly this trainer's model: its
    FSDP shard (any saved shard count, padding included) or its whole parameters; the
    optimizer state resharded like the weights (data- and model-parallel sizes)."""
    call = functools.partial(original(f"{fw.name}.trainer.Trainer.load_checkpoint"), trainer)
    resets = (reset_optimizer, reset_lr_scheduler, optimizer_overrides, reset_meters)
    if remote(filename):
        return call(filename, *resets)
    model = trainer.model
    fsdp = fsdp_root(model)
    sharded = bool(operator.attrgetter(fw.sharded_state)(trainer))
    flat_load = sharded or not fw.flat_needs_sharded_state
    dp, mp = fw.groups(trainer)
    group = real_group(fsdp.process_group) if fsdp is not None and flat_load else dp
    try:
        # Discovery on this rank before the collective load: its failure stops the others now.
        with before_load(group, mp, unless=CheckpointNotFoundError):
            layout = locate(filename, trainer.checkpoint_suffix)
    except CheckpointNotFoundError:  # the library logs "No existing checkpoint found"
        return call(filename, *resets)
    if fsdp is not None and not flat_load and not reset_optimizer:
        with before_load(group, mp):
            _refuse_unless_full_fsdp_optimizer(layout)
    inner = getattr(trainer, "_model", None) or model
    names = tuple(n for n, p in inner.named_parameters() if p.requires_grad) if fsdp is None else None
    optimizer = OptimizerTarget(("local_flat" if sharded else "full_fsdp") if fsdp is not None else "plain", names)
    ctx = TrainerLoad(model=model, model_fsdp=fsdp, flat=fsdp is not None and flat_load,
                      every_rank=bool(trainer.is_fsdp) and flat_load, groups=(dp, mp), layout=layout,
                      reset_optimizer=bool(reset_optimizer), optimizer=optimizer)
    previous = getattr(_CONTEXT, fw.name, None)
    setattr(_CONTEXT, fw.name, ctx)
    try:
        return call(rest_file(layout, group, mp), *resets)
    finally:
        setattr(_CONTEXT, fw.name, previous)


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
            return  # fairscale's format, or nothing to restore: the library's own path
        saved = "an unsharded optimizer state"
    raise CheckpointLayoutError(
        f"{layout.display_name}: its optimizer state cannot be restored here: it holds {saved} and this run's "
        "optimizer (FSDP without --use-sharded-state) expects a full FSDP optimizer state. Pass "
        "--use-sharded-state to have it resharded, or --reset-optimizer to start from fresh optimizer state "
        "(the weights load either way).")


@load_call()
def load_checkpoint(fw: Framework, cfg, trainer, **passthrough_args):
    """(all ranks; collective, as the library's) ``checkpoint_utils.load_checkpoint`` with
    ``--finetune-from-model`` naming a set by any of its files, its folder or its
    un-suffixed name (``fw.finetune_path``); the trainer then loads the whole set."""
    call = original(f"{fw.name}.checkpoint_utils.load_checkpoint")
    finetune = cfg.finetune_from_model
    if finetune is None or remote(finetune):
        return call(cfg, trainer, **passthrough_args)
    path = fw.finetune_path(cfg, finetune)
    if path is finetune:
        return call(cfg, trainer, **passthrough_args)
    cfg.finetune_from_model = path
    try:
        return call(cfg, trainer, **passthrough_args)
    finally:
        cfg.finetune_from_model = finetune


def parse_args_and_arch(fw: Framework, parser, input_args=None, *args, **kwargs):
    """(local) The library's ``options.parse_args_and_arch`` without the ``oneload``
    overrides that the start-up hook has already composed (they are in ``METASEQ_ONELOAD``
    then): argparse would reject ``+oneload=auto``, e.g. from a program the hook did not
    know to be the library's."""
    if os.environ.get(ENV, "").strip():
        if input_args is None:
            sys.argv[1:] = split_argv(sys.argv[1:])[0]
        else:
            input_args = split_argv(input_args)[0]
    return original(f"{fw.name}.options.parse_args_and_arch")(parser, input_args, *args, **kwargs)


# --------------------------------------------------------------------------- settings


def fill_from_checkpoint(cfg: Any, *, requires: Optional[Mapping[str, Tuple[Any, str]]] = None,
                         world_size: Optional[int] = None) -> List[Tuple[str, Any, Any]]:
    """(every rank, local) Fill a metaseq config's loading settings from the checkpoint it
    will load (see :func:`metaseq_oneload.hydra.fill_settings`), with the installed options: a
    no-op with ``fill_cfg=False``, or when there is no checkpoint yet (a first launch).
    ``requires``: what the run's model needs, setting name -> (value, why). ``world_size``:
    the ranks the run will have, where known; a model-parallel size of the files that it
    cannot run is not taken where the run gives none (it keeps 1; the engine loads onto it).

    Returns:
        The changes, as (dotted key, old, new).

    Raises:
        CheckpointSettingsError: a setting the user gave cannot be loaded onto.
    """
    oc = STATE.config
    if not oc.fill_cfg or not oc.enabled:
        return []
    path = checkpoint_path(cfg, oc.path)
    if path is None or remote(path):
        return []
    try:
        layout = locate(path)
    except CheckpointNotFoundError:
        if oc.path:
            raise
        return []
    kept: list = []
    requires = dict(requires or {})
    saved_mp = layout.model_parallel_size
    common = cfg.get("common") if isinstance(cfg, Mapping) else getattr(cfg, "common", None)
    run_mp = common.get("model_parallel_size") if isinstance(common, Mapping) else getattr(common, "model_parallel_size", None)
    given = run_mp != 1 or bool({"common.model_parallel_size", "--model-parallel-size"} & set(STATE.explicit))
    if world_size and saved_mp > 1 and world_size % saved_mp and run_mp is not None and not given:
        # The files' size would be taken as the run's default; Megatron would then clamp a
        # size above the world silently (the run saving a cfg that names a size it never
        # had) or assert on one that does not divide it.
        requires.setdefault("model_parallel_size", (run_mp, f"{world_size} rank(s) cannot run model parallel {saved_mp}"))
        logger.info("metaseq-oneload: common.model_parallel_size=%s kept: the files hold %d, which %d rank(s) "
                    "cannot run; loaded onto %s", run_mp, saved_mp, world_size, run_mp)
    changes = fill_settings(cfg, layout, explicit=STATE.explicit, strategy=oc.strategy, requires=requires,
                            kept=kept)
    needed = {name: why for name, (_, why) in (requires or {}).items()}
    for key, old, new in changes:
        why = needed.get(key.rsplit(".", 1)[-1])
        logger.info("metaseq-oneload: %s=%s (was %s): %s", key, new, old,
                    f"this run needs it ({why})" if why else f"from {layout.display_name}")
    for key, run, files in kept:
        logger.info("metaseq-oneload: %s=%s as this run asks (the files hold %s): loaded onto it", key, run, files)
    return changes

