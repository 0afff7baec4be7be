"""What metaseq's patch and fairseq's share: the patch bookkeeping (:func:`install`,
:func:`uninstall`, originals kept and restored exactly), the engine's load of a layout,
this rank's optimizer state resharded like the weights, and :func:`broadcast_object`.

Nothing here imports metaseq or fairseq at module level; each library's patch is the
module of its name in this package (``metaseq.py``, ``fairseq.py``), imported only by
:func:`install`. Which functions each replaces, and why, is in their docstrings.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import importlib.util
import io
import json
import logging
import os
import re
import sys
import threading
from typing import Any, Callable, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch

from .. import _reading, _storage
from .._dist import Group, settle, tell_failed
from .._errors import CheckpointLayoutError, CheckpointNotFoundError, UnsafeCheckpointError
from .._hydra import OneloadConfig, checkpoint_path, fill_settings, to_config
from ..formats import discover
from .._loading import load_checkpoint
from .._optim import materialize, plan_optimizer, rest_source, same_weights_layout
from .._plan import FlatStructure, flat_shard_range, plan_part, qkv_naming

__all__ = ["install", "uninstall", "installed", "current_config", "broadcast_object", "fill_from_checkpoint"]

logger = logging.getLogger("metaseq_oneload")

OPT_KEY = "last_optimizer_state"
_ABSENT = object()
_LOCK = threading.RLock()


class _Patches:
    """What :func:`install` changed, undone exactly and in reverse (pytest's MonkeyPatch)."""

    def __init__(self) -> None:
        self._undo: list = []

    def setattr(self, target: Any, name: str, value: Any) -> None:
        self._undo.append((target, name, vars(target).get(name, _ABSENT)))
        setattr(target, name, value)

    def on_undo(self, fn: Callable[[], None]) -> None:
        self._undo.append((None, fn, None))

    def undo(self) -> None:
        while self._undo:
            target, name, old = self._undo.pop()
            if target is None:
                name()
            elif old is _ABSENT:
                if name in vars(target):
                    delattr(target, name)
            else:
                setattr(target, name, old)


@dataclasses.dataclass
class _State:
    patches: Optional[_Patches] = None
    config: OneloadConfig = dataclasses.field(default_factory=OneloadConfig)
    explicit: frozenset = frozenset()
    originals: dict = dataclasses.field(default_factory=dict)
    libraries: tuple = ()
    hydra_schema: bool = False


_STATE = _State()


@dataclasses.dataclass(frozen=True)
class _TrainerLoad:
    """The Trainer.load_checkpoint in progress: what its model needs."""

    model: Any
    is_fsdp: bool
    use_sharded_state: bool
    reset_optimizer: bool
    layout: Any
    param_names: Optional[tuple] = None  # the optimizer's parameter order (unwrapped model)

# --------------------------------------------------------------------------- install


# Each has a module of its name in this package with a `patch(patches, *, hydra_schema)`.
_LIBRARIES = ("metaseq", "fairseq")


def install(config: Any = None, *, explicit: Optional[Iterable[str]] = None, hydra_schema: bool = False) -> bool:
    """(every rank, local) Route metaseq's checkpoint loading (and fairseq's) through
    metaseq-oneload.

    Patches what the program uses: the libraries already imported, else metaseq (or, where
    only fairseq is installed, fairseq). A library imported later is patched as it is
    imported. Idempotent: a later call changes the configuration only where it passes one
    (a repeated ``install()`` keeps what the start-up hook composed); ``strategy="off"``
    undoes an installation. Reversible with :func:`uninstall`.

    Args:
        config: an :class:`~metaseq_oneload.OneloadConfig`, a composed ``oneload`` node or a
            mapping of its fields; None keeps the installed configuration (the defaults,
            ``strategy="auto"``, on a first call).
        explicit: the loading settings the user gave (dotted keys such as
            ``common.model_parallel_size`` or flags such as ``--use-sharded-state``); the
            start-up hook passes what it saw on the command line. Values that differ from
            metaseq's defaults count as given anyway. None keeps what an earlier call gave.
        hydra_schema: also store metaseq's ``base_config`` with an optional ``oneload`` node
            in Hydra's ConfigStore, for Hydra apps that compose metaseq's config with
            ``+oneload=...``. Off by default: metaseq's own configs (and the checkpoints
            they are saved into) then stay free of a ``oneload`` key.

    Returns:
        True if this call installed the patch, False if it was installed already, or the
        strategy is "off".

    Raises:
        ImportError: neither metaseq nor fairseq can be imported.

    Example::

        import metaseq_oneload
        metaseq_oneload.install({"strategy": "broadcast"})
        models, cfg, task = metaseq.checkpoint_utils.load_model_ensemble_and_task(["/ckpt/"])
    """
    with _LOCK:
        if config is not None:
            new = to_config(config)
        elif _STATE.patches is not None:
            new = _STATE.config
        else:
            new = OneloadConfig()
        if explicit is not None:
            _STATE.explicit = frozenset(explicit)
        elif _STATE.patches is None:
            _STATE.explicit = frozenset()
        if not new.enabled:
            if _uninstall_locked():
                logger.info("metaseq-oneload: strategy=off: uninstalled, metaseq's own loading is back")
            else:
                logger.info("metaseq-oneload: strategy=off: metaseq's loading left as it is")
            _STATE.config = new
            return False
        _STATE.config = new
        if _STATE.patches is not None:
            return False
        imported = [lib for lib in _LIBRARIES if lib in sys.modules]
        importable = [lib for lib in _LIBRARIES if lib not in sys.modules and _importable(lib)]
        now = imported or importable[:1]
        later = [lib for lib in importable if lib not in now]
        if not now:
            raise ImportError(
                "metaseq_oneload.install(): neither metaseq nor fairseq can be imported. Install "
                "metaseq from its repository (pip install -e path/to/metaseq) in this environment."
            )
        patches = _Patches()
        libraries = []
        _STATE.hydra_schema = hydra_schema
        try:
            for lib in now:
                if _patch_library(patches, lib):
                    libraries.append(lib)
            if not libraries:
                raise ImportError(f"metaseq_oneload.install(): {', '.join(now)} could not be patched (see the log).")
            _allow_checkpoint_globals(patches)
        except BaseException:
            patches.undo()
            _STATE.originals.clear()
            raise
        if later:
            from .._startup import _AfterImport

            finder = _AfterImport.watch(later, lambda: _patch_later(later))
            patches.on_undo(lambda: sys.meta_path.remove(finder) if finder in sys.meta_path else None)
        _STATE.patches = patches
        _STATE.libraries = tuple(libraries)
        logger.info("metaseq-oneload: installed for %s (strategy=%s)%s", ", ".join(libraries), new.strategy,
                    f"; {', '.join(later)} when imported" if later else "")
        return True


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _patch_library(patches: _Patches, lib: str) -> bool:
    """Patch one library into ``patches``, all of it or nothing. metaseq failing is an
    error; fairseq failing is a warning (it must not stand in the way of metaseq)."""
    sub = _Patches()
    try:
        importlib.import_module(f"{__package__}.{lib}").patch(sub, hydra_schema=_STATE.hydra_schema)
    except Exception as e:
        sub.undo()
        if lib == "metaseq":
            raise
        logger.warning("metaseq-oneload: %s is installed but could not be patched (%s: %s)", lib, type(e).__name__, e)
        return False
    patches._undo.extend(sub._undo)
    return True


def _patch_later(names: Sequence[str]) -> None:
    """(import hook) A library the program imports after install(): patch it now. A
    failure is logged, never raised: it would make the program's own import fail."""
    with _LOCK:
        if _STATE.patches is None:
            return
        for lib in names:
            if lib not in sys.modules or lib in _STATE.libraries:
                continue
            try:
                patched = _patch_library(_STATE.patches, lib)
            except Exception as e:  # noqa: BLE001
                logger.error("metaseq-oneload: %s was imported after install() and could not be patched (%s: %s); "
                             "its loading is left as it is", lib, type(e).__name__, e)
                continue
            if patched:
                _STATE.libraries += (lib,)
                logger.info("metaseq-oneload: installed for %s (imported after install())", lib)


def uninstall() -> bool:
    """(every rank, local) Undo :func:`install`: every patched name gets its original back,
    the configuration returns to the defaults. Returns False if nothing was installed."""
    with _LOCK:
        done = _uninstall_locked()
        _STATE.config = OneloadConfig()
        _STATE.explicit = frozenset()
        return done


def _uninstall_locked() -> bool:
    if _STATE.patches is None:
        return False
    _STATE.patches.undo()
    _STATE.patches = None
    _STATE.originals.clear()
    _STATE.libraries = ()
    return True


def installed() -> bool:
    """Whether :func:`install` is in effect."""
    return _STATE.patches is not None


def current_config() -> OneloadConfig:
    """The configuration the patched functions use."""
    return _STATE.config


def _original(key: str) -> Callable:
    return _STATE.originals[key]


def _swap(patches: _Patches, target: Any, name: str, new: Callable) -> Callable:
    """Replace ``target.name`` and remember the original under 'module.name' / 'Class.name'."""
    label = target.__name__ if isinstance(target, type(sys)) else f"{target.__module__}.{target.__qualname__}"
    old = getattr(target, name)
    _STATE.originals[f"{label}.{name}"] = old
    patches.setattr(target, name, new)
    return old


def _rebind(patches: _Patches, prefix: str, name: str, old: Any, new: Any) -> None:
    """Point every already-imported ``prefix.*`` module that did ``from x import name`` at
    ``new``: patching only the defining module would leave those copies behind."""
    for modname, mod in list(sys.modules.items()):
        if mod is None or not (modname == prefix or modname.startswith(prefix + ".")):
            continue
        if vars(mod).get(name, _ABSENT) is old:
            patches.setattr(mod, name, new)


def _allow_checkpoint_globals(patches: _Patches) -> None:
    """Add the engine's allowlist to torch's, so that the ``torch.load`` calls metaseq
    makes itself (reshard scripts, ``_broadcast_object_slow``) work under weights_only; on
    uninstall remove exactly the entries this added."""
    add = getattr(torch.serialization, "add_safe_globals", None)
    if add is None:  # torch < 2.4: weights_only is not the default there
        return
    lock = getattr(_reading, "_ALLOWLIST_LOCK", None) or threading.RLock()
    with lock:
        before = list(torch.serialization.get_safe_globals())
        ours = [g for g in list(_reading.safe_globals()) + [_TensorRef] if g not in before]
        add(ours)

    def remove() -> None:
        with lock:
            now = list(torch.serialization.get_safe_globals())
            torch.serialization.clear_safe_globals()
            torch.serialization.add_safe_globals([g for g in now if g not in ours])

    patches.on_undo(remove)


# --------------------------------------------------------------------------- helpers


def _remote(path: Any) -> bool:
    """URLs the engine cannot read here stay with the library: a protocol fsspec does not
    know (manifold://), or no fsspec installed. s3://, gs://, ... go through the engine."""
    return isinstance(path, str) and "://" in path and not _storage.readable_url(path)


_RANK_SUFFIX = re.compile(r"(-model_part-\d+)?(-shard\d+)?\.pt$")


def _locate(path: Any, suffix: str = ""):
    """(local) The checkpoint set ``path`` names, the way metaseq names files: ``path`` with
    this rank's ``suffix`` when that file exists, else ``path`` itself (a folder, any file,
    the un-suffixed name), else ``path`` with a rank suffix stripped (the suffix of a
    world size other than the one that saved).

    Raises:
        CheckpointNotFoundError: none of them exists. CheckpointLayoutError: a damaged set
            is never skipped for another candidate.
    """
    path = os.fspath(path)
    candidates = []
    if suffix and path.endswith(".pt") and not path.endswith(suffix + ".pt"):
        suffixed = path[:-3] + suffix + ".pt"
        if _storage.lexists(suffixed):
            candidates.append(suffixed)
    candidates.append(path)
    if path.endswith(".pt"):
        candidates.append(_RANK_SUFFIX.sub(".pt", path))
    first: Optional[BaseException] = None
    for c in dict.fromkeys(candidates):
        try:
            return discover(c)
        except CheckpointNotFoundError as e:
            first = first or e
    raise first


@contextlib.contextmanager
def _before_load(process_group: Any = None, model_parallel_group: Any = None, unless: tuple = ()):
    """(this rank alone) This rank's own preparation of a collective load over the groups
    given (its discovery of the set, :func:`_locate`, a check of the files): an error raised
    in the block tells the ranks of those groups at once (as the engine's entry points do
    for their arguments, :func:`metaseq_oneload._dist.tell_failed`), so they stop with its
    reason instead of waiting ``arrival_timeout`` for a rank that is not coming. Errors of
    the types in ``unless`` (those the caller answers without loading, on every rank alike:
    no checkpoint yet) pass without telling. None for a group: not part of the load."""
    try:
        yield
    except BaseException as e:
        if not isinstance(e, unless):
            groups = []
            for g, role in ((process_group, "data-parallel"), (model_parallel_group, "model-parallel")):
                if g is not None:
                    with contextlib.suppress(Exception):
                        groups.append(Group(g, role))
            tell_failed(groups, e)
        raise


def _real_group(group: Any) -> Any:
    """``group`` if it is a torch.distributed group of more than one rank, else None
    (fairscale's DummyProcessGroup, a group of one)."""
    import torch.distributed as dist

    if group is None or not (dist.is_available() and dist.is_initialized()):
        return None
    if not isinstance(group, dist.ProcessGroup):
        return None
    try:
        return group if dist.get_world_size(group) > 1 else None
    except (RuntimeError, ValueError):
        return None


def _rank_in(group: Any) -> Tuple[int, int]:
    import torch.distributed as dist

    return (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)


def _fsdp_root(model: Any) -> Any:
    """``model`` if it is a fairscale FullyShardedDataParallel, else None."""
    try:
        from fairscale.nn.data_parallel import FullyShardedDataParallel
    except ImportError:
        return None
    return model if isinstance(model, FullyShardedDataParallel) else None


def _qkv(model: Any, metadata: Optional[Mapping] = None) -> str:
    """How ``model`` names its attention projections (:func:`._plan.qkv_naming`): "fused"
    (metaseq's ``qkv_proj``), "split", or "keep" (neither: stored names stay). Without a
    model, "auto": metaseq's fused naming for metaseq checkpoints."""
    if metadata is not None:
        return qkv_naming(n for g in FlatStructure.from_metadata(metadata).groups for n in g.names)
    if model is None:
        return "auto"
    return qkv_naming(model.state_dict(keep_vars=True))


def _rest_file(layout, dp_group: Any = None, mp_group: Any = None) -> str:
    """(local) The file whose cfg, meters and extra_state go with this rank
    (:func:`._optim.rest_source`, the rule the offline conversion follows too)."""
    mp_rank, mp_size = _rank_in(mp_group)
    dp_rank, dp_size = _rank_in(dp_group)
    return rest_source(layout, mp_rank, mp_size, dp_rank, dp_size)


def _named_part(path: Any, layout) -> Optional[int]:
    """The model part of the set that ``path`` names when it is one existing file of it
    (a link to one included), else None (a folder, an un-suffixed name)."""
    if not isinstance(path, (str, os.PathLike)) or not _storage.isfile(os.fspath(path)):
        return None
    real = _storage.realpath(os.fspath(path))
    for row in layout.files:
        for f in row:
            if _storage.realpath(f.path) == real:
                return f.part
    return None


def _part_layout(layout, part: int):
    """``layout`` reduced to its model part ``part``, as a set of one part: what a script
    that names one part's file (and has no model-parallel group) reads."""
    if layout.model_parallel_size == 1:
        return layout
    from collections import OrderedDict

    p = layout.parts[part]
    tensors = OrderedDict((n, dataclasses.replace(t, part=0)) for n, t in p.tensors.items())
    files = tuple(dataclasses.replace(f, part=0) for f in layout.files[part])
    return dataclasses.replace(layout, files=(files,), parts=(dataclasses.replace(p, index=0, tensors=tensors),))


def _fuse_split_qkv(model: Mapping) -> Mapping:
    """``model`` with each split ``k_proj``/``v_proj``/``q_proj`` (weight, bias) fused into
    metaseq's ``qkv_proj`` = cat([k, v, q]), at ``k_proj``'s place; other entries as they are."""
    out = model.copy() if isinstance(model, dict) else dict(model)
    out.clear()
    done = set()
    for name, value in model.items():
        head, _, leaf = name.rpartition(".")
        base, _, proj = head.rpartition(".")
        if proj in ("k_proj", "v_proj", "q_proj") and base.endswith("self_attn"):
            parts = [model.get(f"{base}.{x}.{leaf}") for x in ("k_proj", "v_proj", "q_proj")]
            if all(torch.is_tensor(t) for t in parts):
                if (base, leaf) not in done:
                    done.add((base, leaf))
                    out[f"{base}.qkv_proj.{leaf}"] = torch.cat(parts)
                continue
        out[name] = value
    return out


def _engine_load(layout, *, process_group=None, model_parallel_group=None, flat=False, shard_metadata=None,
                 qkv="auto"):
    """(collective over the groups given) The engine's load with the installed options."""
    cfg = _STATE.config
    # The layout itself, not a path: it may be one part of a set (_part_layout).
    # No groups: a script's own read of a file (each rank its part), never an implied
    # collective over the default group.
    lc = load_checkpoint(layout, process_group=process_group,
                         model_parallel_group=model_parallel_group, flat=flat, shard_metadata=shard_metadata,
                         strategy=cfg.strategy if cfg.enabled else "auto", bucket_mb=cfg.bucket_mb,
                         verify=cfg.verify, qkv=qkv,
                         no_dist=process_group is None and model_parallel_group is None)
    # The engine has logged the one strategy line (on the first rank of the groups).
    for w in lc.report.warnings:
        logger.info("metaseq-oneload: %s", w)
    return lc


def _materialize(obj: Any) -> Any:
    """A copy of ``obj`` whose tensors own their memory: what a memory-mapped load returns
    must not outlive a checkpoint file that training may overwrite in place."""
    if torch.is_tensor(obj):
        return obj.clone()
    if isinstance(obj, dict):
        out = obj.copy()  # keeps OrderedDict / defaultdict
        for k, v in obj.items():
            out[k] = _materialize(v)
        return out
    if isinstance(obj, list):
        return [_materialize(v) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_materialize(v) for v in obj)
    return obj

def _read_rest(path: str, *, skip_optimizer: bool, cast: Optional[Callable[[dict], None]] = None) -> dict:
    """(local) Everything in one checkpoint file except the model weights, read through
    the safe reader; memory-mapped, so the weights it skips cost nothing. The optimizer
    state stays mapped until :func:`_place_optimizer_state` decides what of it to keep.
    ``cast``: the library's own treatment of the saved cfg, applied in place."""
    # the weights (and a skipped optimizer state) are left out: from an object store they
    # are then never fetched
    obj = _reading.load_object(path, mmap=True, exclude=("model",) + ((OPT_KEY,) if skip_optimizer else ()))
    if not isinstance(obj, dict):
        raise CheckpointLayoutError(f"{path}: expected a metaseq checkpoint (a dict), found {type(obj).__name__}.")
    rest = {k: (v if k == OPT_KEY else _materialize(v)) for k, v in obj.items()
            if k != "model" and not (skip_optimizer and k == OPT_KEY)}
    del obj
    if cast is not None:
        cast(rest)
    return rest


# --------------------------------------------------------------------------- optimizer state


def _optimizer_problem(layout, why: str, ctx: Optional[_TrainerLoad]) -> None:
    message = (f"{layout.display_name}: its optimizer state cannot be restored here: {why}. "
               "Pass --reset-optimizer to start from fresh optimizer state (the weights load either way).")
    if ctx is not None:
        raise CheckpointLayoutError(message)
    logger.warning("metaseq-oneload: %s", message)


def _state_sizes_fit(opt: Mapping, layout, part: int, shard: int, shards: int) -> bool:
    """Whether a saved flat optimizer state holds one value per flat parameter, each the
    size of fairscale's shard ``shard`` of ``shards`` (metaseq's reshard_fsdp keeps the old
    padding inside the state: 4674 per shard for 9346 elements, which a world of 2 does not
    take as it is)."""
    state = opt.get("state") if isinstance(opt.get("state"), Mapping) else {}
    fps = layout.parts[part].flat_params
    if len(state) != len(fps):
        return False
    for key, fp in zip(sorted(state, key=str), fps):
        size = flat_shard_range(fp.total_numel, shard, shards)[2]
        entry = state[key]
        if not isinstance(entry, Mapping):
            return False
        if any(torch.is_tensor(v) and v.dim() > 0 and v.numel() != size for v in entry.values()):
            return False
    return True


def rank_optimizer_state(layout, opt: Mapping, *, part: int, parts: int, shard: int, shards: int, flat: bool,
                         qkv: str = "auto", structure: Optional[FlatStructure] = None,
                         params: Optional[Sequence[str]] = None) -> Tuple[Optional[dict], str]:
    """(local) (this rank's optimizer state, "") or (None, why not), for target model part
    ``part`` of ``parts`` and, ``flat``, data-parallel shard ``shard`` of ``shards`` of the
    flat parameters ``structure`` (default: the saved wrapping); unflattened, one entry per
    parameter of ``params`` (default: the checkpoint's parameter order).

    ``opt`` is the saved optimizer state of the file that goes with this rank (its
    ``step``, ``param_groups`` and loss scale are kept). Where the saved files already are
    this rank's layout the state is taken as saved; otherwise it is planned like the weights
    (:func:`._optim.plan_optimizer`) and read now (:func:`._optim.materialize`): the path the
    offline conversion streams to disk, so both give the same values.
    """
    weights = plan_part(layout, parts, part, qkv=qkv)
    if flat:
        structure = structure if structure is not None else FlatStructure.from_layout(layout, weights)
        structure.check_against(weights)
    if same_weights_layout(layout, parts=parts, shards=shards, flat=flat, structure=structure) and (
            not flat or _state_sizes_fit(opt, layout, part, shard, shards)):
        return _materialize(opt), ""
    if flat:
        order = [n for g in structure.groups for n in g.names]
    else:
        buffers = set(layout.parts[0].buffer_names)
        order = list(params) if params is not None else [
            n for n, t in weights.items() if t.alias_of is None and n not in buffers]
    plan, why = plan_optimizer(layout, parts, qkv, {part: order}, {part: weights}, parts=[part])
    if plan is None:
        return None, why
    return materialize(plan, part, opt, structure=structure if flat else None, shard=shard, shards=shards,
                       params=None if flat else order), ""


def _param_order(ctx: Optional[_TrainerLoad], weights_names: Iterable[str]) -> Optional[list]:
    """The trainer's optimizer parameter order in checkpoint names, when every name is
    known (a wrapper's ``module.`` prefixes stripped); else None (the checkpoint's order)."""
    if ctx is None or ctx.param_names is None:
        return None
    known = set(weights_names)
    out = []
    for n in ctx.param_names:
        while n not in known and n.startswith("module."):
            n = n[len("module."):]
        if n not in known:
            return None
        out.append(n)
    return out


def _place_optimizer_state(state: dict, layout, *, flat: bool, model_fsdp: Any, part: int, parts: int,
                           shard: int, shards: int, ctx: Optional[_TrainerLoad], qkv: str,
                           structure: Optional[FlatStructure]) -> None:
    """(local) Make ``state[OPT_KEY]`` the optimizer state this rank's trainer expects, or
    refuse (with a trainer) / drop it with a warning (without one)."""
    opt = state.get(OPT_KEY)
    if opt is None:
        return
    if isinstance(opt, int) and opt == -1:
        # FSDP without sharded state: only data-parallel rank 0 saved the full optimizer state.
        opt = _read_rest(rest_source(layout, part, parts, 0, shards), skip_optimizer=False).get(OPT_KEY)
        if isinstance(opt, int) or opt is None:
            state[OPT_KEY] = None
            logger.warning("metaseq-oneload: %s: no full optimizer state in the set", layout.display_name)
            return
    if not isinstance(opt, Mapping):
        state[OPT_KEY] = None
        return _optimizer_problem(layout, f"it is a {type(opt).__name__}, not an optimizer state dict", ctx)
    saved = "local_flat" if layout.flat else ("full_fsdp" if "param_id_map" in opt else "plain")
    if ctx is None:
        target = "local_flat" if flat else saved
    elif model_fsdp is not None:
        target = "local_flat" if ctx.use_sharded_state else "full_fsdp"
    else:
        target = "plain"
    names = {"local_flat": "FSDP flat shards", "full_fsdp": "a full FSDP optimizer state",
             "plain": "an unsharded optimizer state"}
    if saved == "full_fsdp" or target == "full_fsdp":
        # fairscale's own format, indexed by its param_id_map: kept, or cut by fairscale.
        if saved != "full_fsdp" or layout.model_parallel_size != parts:
            state[OPT_KEY] = None
            why = (f"it holds {names[saved]} and this run's optimizer expects {names[target]}" if saved != target
                   else f"it was saved for model-parallel size {layout.model_parallel_size} and this run has {parts}")
            return _optimizer_problem(layout, why, ctx)
        if target == "local_flat" and model_fsdp is not None:
            state[OPT_KEY] = _materialize(model_fsdp.get_shard_from_optim_state_dict(opt))
        elif target == "full_fsdp":
            state[OPT_KEY] = _materialize(opt)
        else:
            state[OPT_KEY] = None
            _optimizer_problem(layout, f"it holds {names[saved]} and this run's optimizer expects {names[target]}", ctx)
        return
    # Flat shards or per-parameter state: resharded exactly like the weights, whatever the
    # saved and the target data- and model-parallel sizes.
    try:
        params = None
        if target == "plain":
            weights = plan_part(layout, parts, part, qkv=qkv)
            params = _param_order(ctx, weights)
            if params is None and saved == "local_flat":
                raise ValueError("the flat shards do not record the order of the model's parameters")
        new, why = rank_optimizer_state(layout, opt, part=part, parts=parts, shard=shard, shards=shards,
                                        flat=target == "local_flat", qkv=qkv, structure=structure, params=params)
    except (CheckpointLayoutError, ValueError, KeyError) as e:
        new, why = None, str(e)
    if new is None:
        state[OPT_KEY] = None
        return _optimizer_problem(layout, why, ctx)
    state[OPT_KEY] = new
    if not same_weights_layout(layout, parts=parts, shards=shards, flat=target == "local_flat", structure=structure):
        logger.info("metaseq-oneload: optimizer state resharded from %dx%d to %dx%d like the weights",
                    layout.model_parallel_size, layout.shards_per_part, parts, shards)


# --------------------------------------------------------------------------- settings


def _exists(path: str) -> bool:
    try:
        _locate(path)
    except CheckpointNotFoundError:
        return False
    return True


def fill_from_checkpoint(cfg: Any, *, requires: Optional[Mapping[str, Tuple[Any, str]]] = None,
                         world_size: Optional[int] = None) -> List[Tuple[str, Any, Any]]:
    """(every rank, local) Fill a metaseq config's loading settings from the checkpoint it
    will load (see :func:`metaseq_oneload.fill_settings`), with the installed options: a
    no-op with ``fill_cfg=False``, or when there is no checkpoint yet (a first launch).
    ``requires``: what the run's model needs, setting name -> (value, why). ``world_size``:
    the ranks the run will have, where known; a model-parallel size of the files that it
    cannot run is not taken where the run gives none (it keeps 1; the engine loads onto it).

    Returns:
        The changes, as (dotted key, old, new).

    Raises:
        CheckpointSettingsError: a setting the user gave cannot be loaded onto.
    """
    oc = _STATE.config
    if not oc.fill_cfg or not oc.enabled:
        return []
    path = checkpoint_path(cfg, oc.path)
    if path is None or _remote(path):
        return []
    try:
        layout = _locate(path)
    except CheckpointNotFoundError:
        if oc.path:
            raise
        return []
    kept: list = []
    requires = dict(requires or {})
    saved_mp = layout.model_parallel_size
    common = cfg.get("common") if isinstance(cfg, Mapping) else getattr(cfg, "common", None)
    run_mp = common.get("model_parallel_size") if isinstance(common, Mapping) else getattr(common, "model_parallel_size", None)
    given = run_mp != 1 or bool({"common.model_parallel_size", "--model-parallel-size"} & set(_STATE.explicit))
    if world_size and saved_mp > 1 and world_size % saved_mp and run_mp is not None and not given:
        # The files' size would be taken as the run's default; Megatron would then clamp a
        # size above the world silently (the run saving a cfg that names a size it never
        # had) or assert on one that does not divide it.
        requires.setdefault("model_parallel_size", (run_mp, f"{world_size} rank(s) cannot run model parallel {saved_mp}"))
        logger.info("metaseq-oneload: common.model_parallel_size=%s kept: the files hold %d, which %d rank(s) "
                    "cannot run; loaded onto %s", run_mp, saved_mp, world_size, run_mp)
    changes = fill_settings(cfg, layout, explicit=_STATE.explicit, strategy=oc.strategy, requires=requires,
                            kept=kept)
    needed = {name: why for name, (_, why) in (requires or {}).items()}
    for key, old, new in changes:
        why = needed.get(key.rsplit(".", 1)[-1])
        logger.info("metaseq-oneload: %s=%s (was %s): %s", key, new, old,
                    f"this run needs it ({why})" if why else f"from {layout.display_name}")
    for key, run, files in kept:
        logger.info("metaseq-oneload: %s=%s as this run asks (the files hold %s): loaded onto it", key, run, files)
    return changes


# --------------------------------------------------------------------------- FSDP


def _fsdp_load_local(model: Any, state_dict: Mapping, strict: bool = True) -> Any:
    """(local) fairscale's ``load_local_state_dict``, also before the first forward.

    fairscale 0.4.13 ends it by freeing every instance's full parameters, which do not
    exist before the lazy init of the first forward (AttributeError ``_full_param_padded``);
    here only parameters that were initialised are freed, and an uninitialised model stays
    uninitialised, as fairscale's own ``load_state_dict`` leaves it.
    """
    from fairscale.nn.data_parallel import fully_sharded_data_parallel as fsdp

    model.assert_state([fsdp.TrainingState.IDLE, fsdp.TrainingState.FORWARD, fsdp.TrainingState.BACKWARD_PRE,
                        fsdp.TrainingState.BACKWARD_POST])
    uninitialized = model._is_root is None
    with contextlib.ExitStack() as stack:
        for m in fsdp.get_fsdp_instances(model):
            stack.enter_context(m._no_return_full_state_dict())
        output = model._load_state_dict(state_dict, strict)
    for m in fsdp.get_fsdp_instances(model):
        initialised = [p for p in m.params if hasattr(p, "_fp32_shard")]
        if initialised:
            m._free_full_params(initialised)
    if uninitialized and model._is_root:
        for m in fsdp.get_fsdp_instances(model):
            m._reset_lazy_init()
    return output


def _feed(h: Any, value: Any) -> None:
    """Feed ``value`` to the hash ``h``: tensors by dtype, shape and every byte (so two
    tensors holding the same numbers in another order differ), containers item by item."""
    if torch.is_tensor(value):
        t = value.detach()
        h.update(json.dumps(["tensor", str(t.dtype), list(t.shape)]).encode())
        flat = t.reshape(-1)
        if flat.is_complex() or flat.dtype == torch.bool:
            flat = flat.view(torch.uint8) if flat.dtype == torch.bool else torch.view_as_real(flat).reshape(-1)
        raw = flat.contiguous().view(torch.uint8) if flat.numel() else flat.new_empty(0, dtype=torch.uint8)
        step = 1 << 24
        for lo in range(0, raw.numel(), step):
            h.update(memoryview(raw[lo: lo + step].cpu().numpy()))
    elif isinstance(value, Mapping):
        h.update(f"map{len(value)}".encode())
        for k, v in value.items():
            h.update(repr(k).encode())
            _feed(h, v)
    elif isinstance(value, (list, tuple)):
        h.update(f"{type(value).__name__}{len(value)}".encode())
        for v in value:
            _feed(h, v)
    else:
        h.update(repr(value).encode())


def _digest(state_dict: Mapping) -> str:
    """A hash of a state dict's names and bytes (not of float sums: [1, 2, 3] is not [3, 2, 1])."""
    h = hashlib.sha256()
    _feed(h, dict(state_dict))
    return h.hexdigest()


def _same_everywhere(state_dict: Mapping, group: Any) -> Mapping:
    """(collective over ``group``) ``state_dict`` as group rank 0 has it, on every rank: no
    transfer when every rank holds the same already, else tensors broadcast as raw bytes."""
    g = Group(group)
    digests = g.all_gather_json(_digest(state_dict or {}))
    if len(set(digests)) == 1 and state_dict:
        return state_dict
    return broadcast_object(state_dict if g.rank == 0 else None, 0, group)


# --------------------------------------------------------------------------- broadcast_object


class _TensorRef(int):
    """Where a tensor was in a broadcast object (the tensor itself travels as bytes)."""


def _split_tensors(obj: Any, tensors: list) -> Any:
    if torch.is_tensor(obj):
        tensors.append(obj)
        return _TensorRef(len(tensors) - 1)
    if isinstance(obj, dict):
        out = obj.copy() if type(obj) is not dict else {}
        for k, v in obj.items():
            out[k] = _split_tensors(v, tensors)
        return out
    if isinstance(obj, list):
        return [_split_tensors(v, tensors) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_split_tensors(v, tensors) for v in obj)
    if isinstance(obj, set):
        return {_split_tensors(v, tensors) for v in obj}
    return obj


def _put_tensors(obj: Any, tensors: Sequence[torch.Tensor]) -> Any:
    if isinstance(obj, _TensorRef):
        return tensors[int(obj)]
    if isinstance(obj, dict):
        out = obj.copy() if type(obj) is not dict else {}
        for k, v in obj.items():
            out[k] = _put_tensors(v, tensors)
        return out
    if isinstance(obj, list):
        return [_put_tensors(v, tensors) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_put_tensors(v, tensors) for v in obj)
    if isinstance(obj, set):
        return {_put_tensors(v, tensors) for v in obj}
    return obj


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes) -> Any:
    """Unpickle with weights_only and the engine's allowlist (plus the tensor placeholder)."""
    import pickle

    with _reading._allowlisted():  # restores torch's allowlist exactly on exit
        torch.serialization.add_safe_globals([_TensorRef])
        try:
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(e))
            raise UnsafeCheckpointError(
                f"broadcast_object: the object holds {found.group(1) if found else 'a class'}, which is outside "
                "the allowlist of classes checkpoints carry; nothing was executed. Broadcast containers, "
                "numbers, strings and tensors only."
            ) from None


def broadcast_object(obj: Any, src_rank: int, group: Any, dist_device: Optional[torch.device] = None, *,
                     bucket_mb: Optional[float] = None) -> Any:
    """(collective over ``group``) metaseq's ``distributed.utils.broadcast_object`` without
    pickling tensors.

    The object's tensors travel as raw bytes in buckets of at most ``oneload.bucket_mb``;
    the rest (containers, numbers, strings) is pickled on ``src_rank`` and unpickled on the
    others with ``weights_only`` and the checkpoint allowlist, so a receiver never runs code
    from the sender. When any rank fails, every rank raises DistributedLoadError.

    Args:
        obj: the object on ``src_rank`` (ignored elsewhere).
        src_rank: the sender's rank within ``group``.
        group: a process group; None means the default (world) group.
        dist_device: accepted for metaseq's signature; the group's backend decides.
        bucket_mb: bucket size (default: the installed ``oneload.bucket_mb``).

    Returns:
        The object on every rank; received tensors land on CPU, or on the current CUDA
        device when they were on CUDA on the sender.
    """
    import torch.distributed as dist

    if group is None and dist.is_available() and dist.is_initialized():
        group = dist.group.WORLD
    g = Group(group)
    if not g.active or g.size == 1:
        return obj
    sender = g.rank == src_rank
    tensors: list = []
    payload, error = b"", None
    if sender:
        try:
            skeleton = _split_tensors(obj, tensors)
            meta = [[list(t.shape), str(t.dtype).replace("torch.", ""), t.device.type] for t in tensors]
            payload = _dumps((skeleton, meta))
        except Exception as e:
            error = e
    settle([g], error, "broadcast_object: packing the object")
    data = g.broadcast_bytes(payload if sender else None, src=src_rank)
    error = None
    if not sender:
        try:
            skeleton, meta = _loads(data)
            for shape, dtype, device in meta:
                where = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" and torch.cuda.is_available() else "cpu"
                tensors.append(torch.empty(shape, dtype=getattr(torch, dtype), device=where))
        except Exception as e:
            error = e
    settle([g], error, "broadcast_object: unpacking the object")
    _broadcast_tensor_bytes(g, tensors, src_rank, sender, _STATE.config.bucket_mb if bucket_mb is None else bucket_mb)
    return obj if sender else _put_tensors(skeleton, tensors)


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)


def _broadcast_tensor_bytes(g: Group, tensors: Sequence[torch.Tensor], src: int, sender: bool,
                            bucket_mb: float) -> None:
    """(collective over ``g``) The tensors' bytes from ``src`` into the receivers' tensors,
    as one stream cut into buckets of at most ``bucket_mb``."""
    if not tensors:
        return
    views = [_byte_view(t.contiguous() if sender else t) for t in tensors]
    total = sum(v.numel() for v in views)
    if total == 0:
        return
    bucket_bytes = max(1 << 10, int(bucket_mb * (1 << 20)))
    bucket = torch.empty(min(bucket_bytes, total), dtype=torch.uint8, device=g.device)
    starts, pos = [], 0
    for v in views:
        starts.append(pos)
        pos += v.numel()
    first = 0
    for lo in range(0, total, bucket.numel()):
        hi = min(total, lo + bucket.numel())
        while first < len(views) and starts[first] + views[first].numel() <= lo:
            first += 1
        span = []
        i = first
        while i < len(views) and starts[i] < hi:
            a, b = max(lo, starts[i]), min(hi, starts[i] + views[i].numel())
            if a < b:
                span.append((i, a, b))
            i += 1
        if sender:
            for i, a, b in span:
                bucket[a - lo: b - lo].copy_(views[i][a - starts[i]: b - starts[i]])
        g.broadcast(bucket[: hi - lo], src=src)
        if not sender:
            for i, a, b in span:
                views[i][a - starts[i]: b - starts[i]].copy_(bucket[a - lo: b - lo])
