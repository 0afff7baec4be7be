"""Hugging Face models, read once: :func:`from_pretrained` (public at the top level) and the
helpers around it, :func:`empty_model`, :func:`fully_shard_blocks` and
:func:`fsdp1_param_init_fn` (public in ``metaseq_oneload.hf``). The ``export-hf`` direction is
``_hf_export.py``.

``from_pretrained`` is the answer to "under torchrun every rank calls
``T5ForConditionalGeneration.from_pretrained`` and the machine holds N copies":

1. the coordinator (rank 0 of the group) reads ``config.json`` and the checkpoint's tensor
   names (headers only) and broadcasts them, so ranks that cannot see the folder still
   build the same model;
2. every rank builds the model from the config with its parameters on the ``meta`` device
   (no weights allocated) and its buffers real, like accelerate's
   ``init_empty_weights(include_buffers=False)``: non-persistent buffers (rotary
   frequencies, position ids) keep the values the model's code computed;
3. an optional ``fsdp`` callable shards the still-empty model (FSDP2 ``fully_shard``);
4. :func:`metaseq_oneload.load_into` fills it: ranks that see the files read only the byte
   ranges of their own parameters (their FSDP2 shard, or everything for an unwrapped model);
   ranks that do not receive from rank 0 in bounded buckets. Ties (T5's shared embeddings)
   stay one tensor.

Nothing here imports transformers at module level: ``import metaseq_oneload`` stays cheap.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import threading
from dataclasses import asdict, dataclass
from typing import Callable, Iterable, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

from ._begun import begin, load_call
from ._dist import Group, settle
from ._errors import CheckpointLayoutError, CheckpointNotFoundError, OneloadError, StateDictMismatchError
from ._into import is_dtensor, owner_of
from ._loading import load_groups, load_into

__all__ = ["from_pretrained", "empty_model", "fully_shard_blocks", "fsdp1_param_init_fn"]

logger = logging.getLogger("metaseq_oneload")


@dataclass(frozen=True)
class _Source:
    """What the coordinator tells every rank about a Hugging Face folder."""

    path: str  # the folder as the coordinator sees it
    config: Optional[dict]  # config.json, None when the caller passed a config
    generation_config: Optional[dict]  # generation_config.json, if any
    names: tuple  # the checkpoint's tensor names


# --------------------------------------------------------------------------- the source


def _looks_like_repo_id(s: str) -> bool:
    return bool(re.fullmatch(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?", s)) and ".." not in s


def _resolve(path: str, hub_kwargs: Optional[Mapping]) -> str:
    """(coordinator) A local folder for ``path``, downloading a Hub repo id once."""
    if os.path.exists(path):
        return os.path.abspath(path)
    if not _looks_like_repo_id(path):
        raise CheckpointNotFoundError(
            f"{path}: no such file or folder on the coordinating rank (rank 0 of the group). Pass the "
            "folder save_pretrained wrote, or a Hugging Face Hub repo id such as google/flan-t5-xxl.")
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:
        raise CheckpointNotFoundError(
            f"{path}: not a local path, and huggingface_hub (to download it) is not installed.") from e
    try:
        folder = snapshot_download(path, allow_patterns=["*.json", "*.safetensors"], **dict(hub_kwargs or {}))
        if not any(n.endswith(".safetensors") for n in os.listdir(folder)):
            folder = snapshot_download(path, allow_patterns=["*.json", "*.bin"], **dict(hub_kwargs or {}))
    except Exception as e:
        raise CheckpointNotFoundError(
            f"{path}: not a local path, and downloading it from the Hugging Face Hub failed "
            f"({type(e).__name__}: {e}). Download it once (huggingface-cli download) and pass the folder.") from e
    return folder


def _read_json(path: str) -> Optional[dict]:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _read_source(path: str, need_config: bool, hub_kwargs, trust_pickle: bool) -> _Source:
    """(coordinator, local) The folder, its config and its tensor names (headers only)."""
    from .formats import discover

    path = _resolve(path, hub_kwargs)
    layout = discover(path, trust_pickle=trust_pickle)
    folder = layout.directory
    config = None
    if need_config:
        config = _read_json(os.path.join(folder, "config.json"))
        if config is None:
            raise CheckpointLayoutError(
                f"{folder}: no config.json beside the weights; from_pretrained builds the model from it. "
                "Pass config=<a PretrainedConfig> instead.")
    return _Source(path, config, _read_json(os.path.join(folder, "generation_config.json")),
                   tuple(layout.parts[0].tensors))


def _default_group(process_group):
    if process_group is not None:
        return process_group
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return None


def _coordinate(group: Group, path: str, need_config: bool, hub_kwargs, trust_pickle: bool) -> _Source:
    """(collective over ``group``) Rank 0 reads the source; everyone gets the same answer."""
    source, error = None, None
    if group.rank == 0:
        try:
            source = _read_source(path, need_config, hub_kwargs, trust_pickle)
        except Exception as e:  # reaches every rank through settle
            error = e
    settle([group], error, f"from_pretrained {path}: reading the config")
    payload = group.broadcast_bytes(json.dumps(asdict(source)).encode() if group.rank == 0 else None)
    if group.rank == 0:
        return source
    d = json.loads(payload)
    d["names"] = tuple(d["names"])
    return _Source(**d)


# --------------------------------------------------------------------------- building


# Building on meta patches two process-wide attributes (nn.Module.register_parameter and
# PreTrainedModel.init_weights). The patches are installed once by the first thread in and
# removed by the last one out, under a lock, and act only in threads inside
# _params_on_meta / _skip_init_weights (a per-thread depth): a thread building an ordinary
# model meanwhile gets ordinary parameters, and no interleaving of enters and exits can
# leave a patch behind or remove one another thread still needs.
_patch_lock = threading.Lock()
_patches: dict = {}  # (owner, attribute) -> [wrapper, original, users]
_this_thread = threading.local()  # .meta, .no_init: how deep this thread is in each context
# transformers sets torch's default dtype process-wide while it builds a model
# (local_torch_dtype): two builds at once would see each other's dtype. Builds on meta
# take milliseconds to seconds, so they take turns; loading does not.
_build_lock = threading.RLock()


def _install(owner: type, attribute: str, make: Callable) -> None:
    with _patch_lock:
        slot = _patches.get((owner, attribute))
        if slot is None:
            original = owner.__dict__[attribute]
            wrapper = make(original)
            setattr(owner, attribute, wrapper)
            slot = _patches[(owner, attribute)] = [wrapper, original, 0]
        slot[2] += 1


def _uninstall(owner: type, attribute: str) -> None:
    with _patch_lock:
        slot = _patches[(owner, attribute)]
        slot[2] -= 1
        if slot[2]:
            return
        del _patches[(owner, attribute)]
        # Someone else patched over ours meanwhile: theirs calls ours, which passes
        # through outside our contexts; putting the original back would drop theirs.
        if owner.__dict__.get(attribute) is slot[0]:
            setattr(owner, attribute, slot[1])


@contextlib.contextmanager
def _thread_flag(flag: str, owner: type, attribute: str, make: Callable):
    _install(owner, attribute, make)
    depth = getattr(_this_thread, flag, 0)
    setattr(_this_thread, flag, depth + 1)
    try:
        yield
    finally:
        setattr(_this_thread, flag, depth)
        _uninstall(owner, attribute)


def _meta_register_parameter(original: Callable) -> Callable:
    def register_parameter(module, name, param):
        original(module, name, param)
        if not getattr(_this_thread, "meta", 0):
            return
        p = module._parameters.get(name)
        if p is None or p.device.type == "meta":
            return
        if type(p) is nn.Parameter:
            new = nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad)
            new.__dict__.update(p.__dict__)
        else:  # parameter subclasses rebuild from their own attributes
            new = type(p)(p.to("meta"), **{**p.__dict__, "requires_grad": p.requires_grad})
        module._parameters[name] = new

    return register_parameter


def _params_on_meta():
    """(this thread only) Parameters go to ``meta`` as they are registered; buffers stay
    where the model's code creates them (accelerate's ``init_empty_weights(include_buffers=False)``),
    so non-persistent buffers that no checkpoint carries keep their computed values."""
    return _thread_flag("meta", nn.Module, "register_parameter", _meta_register_parameter)


def _skipped_init_weights(original: Callable) -> Callable:
    def init_weights(self, *args, **kwargs):
        if getattr(_this_thread, "no_init", 0):
            return None
        return original(self, *args, **kwargs)

    return init_weights


def _skip_init_weights():
    """(this thread only) Skip ``PreTrainedModel.init_weights``: random initialisation the
    checkpoint overwrites, about a second per 250M parameters in Python even on meta.
    Unlike transformers' ``no_init_weights``, which empties torch.nn.init process-wide,
    other threads keep initialising their models."""
    from transformers import PreTrainedModel

    return _thread_flag("no_init", PreTrainedModel, "init_weights", _skipped_init_weights)


def _transformers_dtype_kw() -> str:
    import transformers

    major, minor = (int(x) for x in re.findall(r"\d+", transformers.__version__)[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def _resolve_dtype(dtype, config) -> torch.dtype:
    if dtype is None:
        return torch.get_default_dtype()
    if dtype == "auto":
        found = getattr(config, "dtype", None) if _transformers_dtype_kw() == "dtype" else getattr(config, "torch_dtype", None)
        dtype = found if found is not None else torch.get_default_dtype()
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.replace("torch.", ""), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype={dtype!r}: expected a torch.dtype, its name, 'auto' or None.")
    return dtype


def _config_from(model_cls, raw: Mapping, config_kwargs: Mapping):
    config_class = getattr(model_cls, "config_class", None)
    if isinstance(config_class, type):
        return config_class.from_dict(dict(raw), **config_kwargs)
    from transformers import AutoConfig  # an Auto* class: the config names the model type

    raw = dict(raw)
    model_type = raw.pop("model_type", None)
    if model_type is None:
        raise CheckpointLayoutError("config.json has no model_type, so an Auto class cannot pick the model. "
                                    "Pass the concrete model class (e.g. T5ForConditionalGeneration).")
    return AutoConfig.for_model(model_type, **{**raw, **config_kwargs})


def _build(model_cls, config, dtype: torch.dtype) -> nn.Module:
    """(local) The model from ``config``, parameters on meta, buffers real, tied weights tied."""
    kw = {_transformers_dtype_kw(): dtype}
    with _build_lock, _params_on_meta(), _skip_init_weights():
        if hasattr(model_cls, "_from_config"):
            model = model_cls._from_config(config, **kw)
        else:  # Auto* classes
            model = model_cls.from_config(config, **kw)
    # Skipping init_weights also skips the tying it does.
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    # Hugging Face keeps some modules in fp32 when loading in fp16 (T5's "wo"): the same here.
    keep = getattr(model, "_keep_in_fp32_modules", None)
    if dtype == torch.float16 and keep:
        for name, module in model.named_modules():
            if any(k in name.split(".") for k in keep):
                module.to(torch.float32)
    return model


def _prepare(model_cls, path, config, group: Group, dtype, hub_kwargs, trust_pickle, config_kwargs):
    """(collective over ``group`` when a path is given) (model on meta, source or None)."""
    source = None
    if path is not None:
        source = _coordinate(group, os.fspath(path), config is None, hub_kwargs, trust_pickle)
    if config is None:
        if source is None:
            raise ValueError("empty_model needs path or config.")
        config = _config_from(model_cls, source.config, config_kwargs)
    elif config_kwargs:
        for k, v in config_kwargs.items():
            setattr(config, k, v)
    if path is not None:
        config._name_or_path = os.fspath(path)  # what transformers' own from_pretrained records
    model = _build(model_cls, config, _resolve_dtype(dtype, config))
    if source is not None and source.generation_config and getattr(model, "generation_config", None) is not None:
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_dict(source.generation_config)
    return model, source


def empty_model(
    model_cls,
    path: "str | os.PathLike | None" = None,
    *,
    config=None,
    process_group: Optional["dist.ProcessGroup"] = None,
    dtype: "torch.dtype | str | None" = "auto",
    hub_kwargs: Optional[Mapping] = None,
    trust_pickle: bool = False,
    **config_kwargs,
) -> nn.Module:
    """(collective over ``process_group`` when ``path`` is given) The model built
    from its config with every parameter on the ``meta`` device and real buffers.

    Rank 0 of the group reads ``config.json`` and broadcasts it, so ranks that cannot see
    the folder build the same model. Fill it with :func:`metaseq_oneload.load_into` (e.g.
    on rank 0 only, for the FSDP1 recipe in docs/huggingface.md).

    Args:
        model_cls: a transformers model class (``T5ForConditionalGeneration``) or Auto class.
        path: a folder written by ``save_pretrained`` or a Hub repo id (downloaded
            once, by rank 0). None: build from ``config`` alone (no collective).
        config: a ``PretrainedConfig`` to use instead of the folder's ``config.json``.
        process_group: the group to coordinate over; None: the default group when
            torch.distributed is initialised, else no collectives.
        dtype: parameter dtype: ``"auto"`` (the config's), a ``torch.dtype`` or its name,
            or None (torch's default dtype).
        hub_kwargs: passed to ``huggingface_hub.snapshot_download`` (revision, cache_dir...).
        **config_kwargs: override config attributes (e.g. ``dropout_rate=0.0``).
    """
    group = Group(_default_group(process_group))
    model, _ = _prepare(model_cls, path, config, group, dtype, hub_kwargs, trust_pickle, config_kwargs)
    return model


# --------------------------------------------------------------------------- loading


def _tied_groups(model: nn.Module) -> list:
    """Names of each distinct tensor in the state dict (several when tied)."""
    groups: dict = {}
    for n, t in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(t), []).append(n)
    return list(groups.values())


def _check_keys(model: nn.Module, names: Sequence[str], ignore_unexpected: Iterable[str], where: str) -> bool:
    """(every rank, identically) Raise on missing or unexpected tensors, the way Hugging Face
    judges them: tied names count once, ``_keys_to_ignore_on_load_unexpected`` patterns and
    buffer names the model does not persist are not unexpected, and a buffer the checkpoint
    lacks keeps the value the model computed. Returns whether anything was let through (then
    the load must not be strict)."""
    ckpt = set(names)
    sd_names = set()
    missing = []
    lenient = False
    for group in _tied_groups(model):
        sd_names.update(group)
        if any(n in ckpt for n in group):
            continue
        owner, leaf = owner_of(model, group[0])
        if leaf in owner._buffers and owner._buffers[leaf] is not None and owner._buffers[leaf].device.type != "meta":
            lenient = True
            continue
        missing.append(group[0])
    buffers = {n for n, _ in model.named_buffers()}
    patterns = [p for p in (getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())] + list(ignore_unexpected)
    unexpected = []
    for n in sorted(ckpt - sd_names):
        if n in buffers or any(re.search(p, n) for p in patterns):
            lenient = True
            continue
        unexpected.append(n)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing from the checkpoint: {', '.join(missing[:5])}"
                         + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""))
        if unexpected:
            parts.append(f"not in the model: {', '.join(unexpected[:5])}"
                         + (f" (+{len(unexpected) - 5} more)" if len(unexpected) > 5 else ""))
        raise StateDictMismatchError(
            f"{type(model).__name__} does not match {where}: {' | '.join(parts)}. Nothing was loaded. Check that "
            "the model class and config match the checkpoint (pass ignore_unexpected=[regex] for tensors to skip).")
    return lenient


def _unpersisted(model: nn.Module, names: Sequence[str]) -> dict:
    """Real buffers the checkpoint will not fill: kept aside, because sharding or
    materialising the model may replace them with empty tensors."""
    ckpt = set(names)
    out = {}
    for n, b in model.named_buffers():
        if b is not None and b.device.type != "meta" and n not in ckpt:
            out[n] = b
    return out


def _restore(model: nn.Module, kept: Mapping[str, torch.Tensor], device: torch.device) -> None:
    for n, saved in kept.items():
        owner, leaf = owner_of(model, n)
        current = owner._buffers.get(leaf)
        if current is saved and current.device == device:
            continue
        owner._buffers[leaf] = saved.to(device)


def _buffers_to(model: nn.Module, device: torch.device) -> None:
    """Every buffer on ``device``: those the checkpoint filled in place where the model
    built them (CPU) too. A buffer shared by several modules stays one tensor."""
    moved: dict = {}
    for n, b in list(model.named_buffers(remove_duplicate=False)):
        if b is None or is_dtensor(b) or b.device == device:
            continue
        owner, leaf = owner_of(model, n)
        owner._buffers[leaf] = moved.setdefault(id(b), b.to(device))


def _fsdp2_offload(model: nn.Module) -> tuple:
    """(names of FSDP2 modules whose parameters are offloaded to CPU, names of those whose
    parameters live on the mesh's device)."""
    try:
        from torch.distributed.fsdp import CPUOffloadPolicy
    except ImportError:  # torch < 2.6
        try:
            from torch.distributed._composable.fsdp import CPUOffloadPolicy
        except ImportError:
            return (), ()
    offloaded, resident = [], []
    for name, m in model.named_modules():
        get_state = getattr(m, "_get_fsdp_state", None)
        if get_state is None:
            continue
        try:
            state = get_state()
        except Exception:  # an FSDPModule class without state: not sharded
            continue
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:  # torch < 2.10: one group per state
            groups = [getattr(state, "_fsdp_param_group", None)]
        for g in groups:
            if g is None or not getattr(g, "fsdp_params", None):
                continue
            cpu = isinstance(getattr(g, "offload_policy", None), CPUOffloadPolicy) or any(
                getattr(fp, "offload_to_cpu", False) for fp in g.fsdp_params)
            (offloaded if cpu else resident).append(name or "<root>")
    return tuple(offloaded), tuple(resident)


def _mesh_device(model: nn.Module) -> Optional[torch.device]:
    """The device of the FSDP2 mesh the parameters are sharded over, None when unsharded."""
    for p in model.parameters():
        if is_dtensor(p):
            kind = p.device_mesh.device_type
            if kind == "cpu":
                return torch.device("cpu")
            mod = getattr(torch, kind, None)
            return torch.device(kind, mod.current_device() if mod is not None and hasattr(mod, "current_device") else 0)
    return None


def _placement(model: nn.Module, device) -> tuple:
    """(where parameters are materialised, where buffers go).

    Default: the FSDP2 mesh's device for both, else CPU. With FSDP2 ``CPUOffloadPolicy``
    the sharded parameters must be on CPU (FSDP2 raises on the first forward otherwise)
    while buffers, which FSDP2 does not manage, stay on the mesh's device for the forward.
    """
    mesh = _mesh_device(model)
    offloaded, resident = _fsdp2_offload(model) if mesh is not None and mesh.type != "cpu" else ((), ())
    if offloaded and resident:
        raise ValueError(
            f"some FSDP2 modules offload their parameters to CPU ({', '.join(offloaded[:3])}) and others keep "
            f"them on {mesh} ({', '.join(resident[:3])}); from_pretrained materialises all parameters on one "
            "device. Pass the same offload_policy to every fully_shard call (fully_shard_blocks does).")
    if device is not None:
        device = torch.device(device)
        if offloaded and device.type != "cpu":
            raise ValueError(
                f"device={device}, but the FSDP2 modules offload their parameters to CPU (CPUOffloadPolicy): "
                "FSDP2 needs them materialised on CPU. Leave device unset (or pass device='cpu').")
        return device, device
    if offloaded:
        return torch.device("cpu"), mesh
    target = mesh if mesh is not None else torch.device("cpu")
    return target, target


@load_call()  # where this call's check-ins count from is forgotten when it ends (as load_into's)
def from_pretrained(
    model_cls,
    path: "str | os.PathLike",
    *,
    process_group: Optional["dist.ProcessGroup"] = None,
    fsdp: Optional[Callable[[nn.Module], Optional[nn.Module]]] = None,
    config=None,
    dtype: "torch.dtype | str | None" = "auto",
    device: "str | torch.device | None" = None,
    strategy: str = "auto",
    ignore_unexpected: Sequence[str] = (),
    bucket_mb: float = 256,
    chunk_mb: float = 64,
    verify: bool = False,
    hub_kwargs: Optional[Mapping] = None,
    trust_pickle: bool = False,
    progress: "Optional[bool] | Callable[[int, int], None]" = None,
    return_report: bool = False,
    **config_kwargs,
):
    """(collective over ``process_group``, and over the FSDP mesh when ``fsdp`` shards)
    A Hugging Face model with its pretrained weights, read once for all ranks.

    Every rank builds the model from its config with parameters on the ``meta`` device,
    ``fsdp`` (if given) shards it while still empty, and the checkpoint is read into it:
    ranks that see the folder read only the bytes of their own parameters (``os.preadv``
    into the parameter memory), ranks that do not receive them from rank 0 in buckets of at
    most ``bucket_mb``. An unwrapped (or DDP-to-be) model ends with the full weights on every
    rank; one sharded with FSDP2 ``fully_shard`` holds only each rank's shard, never the
    whole model.

    Args:
        model_cls: the transformers class to build (``T5ForConditionalGeneration``) or an
            Auto class (``AutoModelForSeq2SeqLM``).
        path: a folder written by ``save_pretrained`` (``model.safetensors``, a sharded
            ``model.safetensors.index.json`` set, or ``pytorch_model.bin`` read through the
            allowlisted unpickler), or a Hub repo id that rank 0 downloads once.
        process_group: the ranks that load together; None: the default group when
            torch.distributed is initialised, else a plain local load.
        fsdp: called with the empty model before loading: :func:`fully_shard_blocks`, or
            any function that calls ``fully_shard`` on the blocks and then on the model; what
            it returns, if not None, is the model from then on.
        config: a ``PretrainedConfig`` instead of the folder's ``config.json``.
        dtype: ``"auto"`` (the config's dtype, as transformers 5), a dtype or its name, or None
            (torch's default). Weights stored in another dtype are converted while read.
        device: where parameters are materialised (default: the FSDP2 mesh's device, else CPU;
            CPU when ``fsdp`` shards with ``offload_policy=CPUOffloadPolicy()``, buffers then
            staying on the mesh's device).
        strategy: :func:`metaseq_oneload.load_into`'s: "auto", "reshard", "broadcast" or "parallel".
        ignore_unexpected: regexes of checkpoint tensors to skip, beyond the model class's
            own ``_keys_to_ignore_on_load_unexpected``.
        bucket_mb: broadcast bucket size: the peak extra memory of every rank when broadcasting.
        chunk_mb: staging size for dtype/device conversion.
        verify: compare what was loaded with an independent (memory-mapped) read of the files.
        hub_kwargs: passed to ``huggingface_hub.snapshot_download`` on rank 0.
        trust_pickle: for ``pytorch_model.bin`` needing classes outside the allowlist. Unsafe.
        progress: a progress bar (default: on a terminal, rank 0, >= 256 MiB), or a callable
            called with (bytes done so far, bytes in all).
        return_report: also return the :class:`~metaseq_oneload.LoadReport`.
        **config_kwargs: override config attributes (e.g. ``dropout_rate=0.0``).

    Returns:
        The model in eval mode (as transformers returns it), or ``(model, report)``.

    Raises:
        StateDictMismatchError: on every rank, before anything is read, when the checkpoint
            misses tensors of the model or holds tensors the model does not have.
        DistributedLoadError: on every rank, when any rank failed (the message names each).
        CheckpointNotFoundError: nothing at ``path`` on rank 0 (single process).

    Example::

        model = from_pretrained(T5ForConditionalGeneration, "/models/flan-t5-xxl",
                                fsdp=fully_shard_blocks(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)))
    """
    group = Group(_default_group(process_group))
    try:
        # load_into's check-in counts from here: rank 0's download, the build and ``fsdp`` come
        # first (minutes for a large model), and may outlast the others' arrival_timeout
        begin(load_groups(group.group if group.active else None, None, not group.active))
    except ValueError:
        pass  # load_into refuses the same groups, and tells the other ranks
    model, source = _prepare(model_cls, path, config, group, dtype, hub_kwargs, trust_pickle, config_kwargs)
    # Judged the Hugging Face way here; what it lets through (ignored tensors, computed
    # buffers) load_into must skip instead of refusing, and it still checks every shape.
    lenient = _check_keys(model, source.names, ignore_unexpected, source.path)
    kept = _unpersisted(model, source.names)
    if fsdp is not None:
        wrapped = fsdp(model)
        model = wrapped if wrapped is not None else model
    target, buffers_on = _placement(model, device)
    # A rank reads the folder it was given when it sees it. A Hub id is where rank 0
    # downloaded it (seen by the ranks of its node). A rank that sees nothing receives
    # everything from rank 0 by broadcast.
    local = os.fspath(path)
    where = local if os.path.exists(local) or not _looks_like_repo_id(local) else source.path
    report = load_into(model, where, process_group=group.group if group.active else None, no_dist=not group.active,
                       strategy=strategy,
                       strict=not lenient, device=target, bucket_mb=bucket_mb, chunk_mb=chunk_mb, verify=verify,
                       trust_pickle=trust_pickle, progress=progress)
    _restore(model, kept, buffers_on)
    _buffers_to(model, buffers_on)  # with CPU offload: not where the parameters are, where the forward runs
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers())
            if not is_dtensor(t) and t.device.type == "meta"
            or is_dtensor(t) and t.to_local().device.type == "meta"]
    if left:
        raise OneloadError(f"from_pretrained left {len(left)} tensor(s) without values ({', '.join(left[:5])}); "
                           "this is a bug, please report it with the model class.")
    model.eval()
    return (model, report) if return_report else model


def fully_shard_blocks(*, block_types: Optional[Iterable[Union[str, type]]] = None, **fully_shard_kwargs) -> Callable:
    """(local; the returned callable is collective over the FSDP mesh) An ``fsdp=`` argument
    for :func:`from_pretrained`: FSDP2 ``fully_shard`` on every transformer block, then on
    the root, as the PyTorch FSDP examples wrap T5.

    Args:
        block_types: classes or class names to shard; default: the model's
            ``_no_split_modules`` (``T5Block`` for T5, ``LlamaDecoderLayer``...).
        **fully_shard_kwargs: passed to ``fully_shard`` (``mesh``, ``mp_policy``,
            ``reshard_after_forward``, ``offload_policy``).
    """

    def apply(model: nn.Module) -> nn.Module:
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:  # torch < 2.6
            from torch.distributed._composable.fsdp import fully_shard
        wanted = list(block_types if block_types is not None else (getattr(model, "_no_split_modules", None) or ()))
        if not wanted:
            raise ValueError(f"{type(model).__name__} names no _no_split_modules; pass block_types=[...] "
                             "(the transformer block classes) to fully_shard_blocks.")
        names = {w for w in wanted if isinstance(w, str)}
        classes = tuple(w for w in wanted if isinstance(w, type))
        blocks = [m for m in model.modules() if m is not model and (type(m).__name__ in names or isinstance(m, classes))]
        for m in blocks:
            fully_shard(m, **fully_shard_kwargs)
        fully_shard(model, **fully_shard_kwargs)
        return model

    return apply


def fsdp1_param_init_fn(model: nn.Module, device: "str | torch.device") -> Callable[[nn.Module], None]:
    """(local) FSDP1's ``param_init_fn`` for a model built on ``meta`` (:func:`empty_model`):
    materialises each module as FSDP1 wraps it and keeps tied parameters tied.

    torch's usual ``lambda m: m.to_empty(device=d, recurse=False)`` gives each module its own
    tensor, untying T5's shared embeddings on the ranks that build on meta while the rank
    that loaded keeps them tied, and FSDP1 then flattens the ranks differently. Call this on
    the unwrapped model; see docs/huggingface.md ("FSDP1").
    """
    device = torch.device(device)
    groups: dict = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(owner_of(model, name))
    tied = [members for members in groups.values() if len(members) > 1]

    def init(module: nn.Module) -> None:
        module.to_empty(device=device, recurse=False)
        for (owner, leaf), *aliases in tied:
            source = owner._parameters.get(leaf)
            if source is not None and source.device.type != "meta":
                for a_owner, a_leaf in aliases:
                    a_owner._parameters[a_leaf] = source

    return init
