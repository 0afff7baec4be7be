"""fairseq's patch: ``checkpoint_utils.load_checkpoint_to_cpu`` and
``load_model_ensemble_and_task`` take any file of a set, its folder or its un-suffixed name,
and FSDP-sharded sets (``-shardD``, ``_partK``, any count) with no flag.
"""

from __future__ import annotations

import inspect as _inspect
import os

from ._core import _engine_load, _locate, _original, _Patches, _remote, _swap

__all__ = ["patch"]


def patch(patches: _Patches, *, hydra_schema: bool = False) -> None:
    """(every rank, local) Replace fairseq's loading functions into ``patches``
    (``hydra_schema`` is metaseq's; fairseq has no structured base config to extend)."""
    from fairseq import checkpoint_utils

    _swap(patches, checkpoint_utils, "load_checkpoint_to_cpu", _fairseq_load_checkpoint_to_cpu)
    _swap(patches, checkpoint_utils, "load_model_ensemble_and_task", _fairseq_load_model_ensemble_and_task)


def _fairseq_load_checkpoint_to_cpu(path, arg_overrides=None, *args, **kwargs):
    """(local) fairseq's ``load_checkpoint_to_cpu`` on the file ``path`` names (a folder, any
    file of the set, the un-suffixed name); the torch.load inside works under weights_only
    through the allowlist install() added. Sharded sets: see load_model_ensemble_and_task."""
    original = _original("fairseq.checkpoint_utils.load_checkpoint_to_cpu")
    if _remote(path) or os.path.isfile(path):
        return original(path, arg_overrides, *args, **kwargs)
    return original(_locate(path).all_files[0].path, arg_overrides, *args, **kwargs)


def _fairseq_load_model_ensemble_and_task(filenames, arg_overrides=None, task=None, strict=True, suffix="",
                                          num_shards=1, state=None, *args, **kwargs):
    """(local) fairseq's ``load_model_ensemble_and_task``; FSDP-sharded sets (``-shardD``,
    ``_partK``, any count, padded or not) are merged by the engine into full weights and
    handed over as ``state=`` (fairseq versions that take it), so no flag is needed."""
    original = _original("fairseq.checkpoint_utils.load_model_ensemble_and_task")
    takes_state = "state" in _inspect.signature(original).parameters
    if state is not None or not takes_state or any(_remote(f) for f in filenames):
        if takes_state:
            return original(filenames, arg_overrides, task, strict, suffix, num_shards, state, *args, **kwargs)
        return original(filenames, arg_overrides, task, strict, suffix, num_shards, *args, **kwargs)
    ensemble, cfg = [], None
    for filename in filenames:
        layout = _locate(filename, suffix)
        first = layout.all_files[0].path
        if layout.saved_world_size == 1:
            models, cfg, task = original([first], arg_overrides, task, strict, "", 1, None, *args, **kwargs)
            ensemble += models
            continue
        loaded = _original("fairseq.checkpoint_utils.load_checkpoint_to_cpu")(first, arg_overrides)
        loaded["model"] = _engine_load(layout, flat=False, qkv="keep").model
        for key in ("fsdp_metadata", "shard_metadata"):
            loaded.pop(key, None)
        models, cfg, task = original([first], arg_overrides, task, strict, "", 1, loaded, *args, **kwargs)
        ensemble += models
    return ensemble, cfg, task
