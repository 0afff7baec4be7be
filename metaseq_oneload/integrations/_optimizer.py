"""The optimizer state a rank's trainer restores, resharded exactly like the weights: across
data- and model-parallel sizes, between FSDP flat shards and per-parameter state, or kept in
fairscale's own full format (indexed by its ``param_id_map``) where that is what both sides
hold. The offline conversion plans and streams the same (:func:`._optim.plan_optimizer`), so
both give the same values.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Iterable, Mapping, Optional, Sequence, Tuple

import torch

from .._errors import CheckpointLayoutError
from .._optim import materialize, plan_optimizer, rest_source, same_weights_layout
from .._plan import FlatStructure, flat_shard_range, flat_structure, plan_part
from ._checkpoint import OPT_KEY, owning, read_rest

__all__ = ["OptimizerTarget", "rank_optimizer_state", "place_optimizer_state"]

logger = logging.getLogger("metaseq_oneload")

# The formats of a saved or expected optimizer state, in words.
_FORMATS = {"local_flat": "FSDP flat shards", "full_fsdp": "a full FSDP optimizer state",
            "plain": "an unsharded optimizer state"}


@dataclasses.dataclass(frozen=True)
class OptimizerTarget:
    """The optimizer a trainer will restore the state into."""

    format: str  # "local_flat" (fairscale FSDP, sharded state), "full_fsdp" (FSDP, full state) or "plain"
    param_names: Optional[tuple] = None  # its parameter order: the unwrapped model's names (plain only)


def _optimizer_problem(layout, why: str, trainer: Optional[OptimizerTarget]) -> None:
    message = (f"{layout.display_name}: its optimizer state cannot be restored here: {why}. "
               "Pass --reset-optimizer to start from fresh optimizer state (the weights load either way).")
    if trainer is not None:
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
        if structure is None:
            structure = flat_structure(layout, weights)
        else:
            structure.check_against(weights)
    if same_weights_layout(layout, parts=parts, shards=shards, flat=flat, structure=structure) and (
            not flat or _state_sizes_fit(opt, layout, part, shard, shards)):
        return owning(opt), ""
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


def _param_order(trainer: Optional[OptimizerTarget], weights_names: Iterable[str]) -> Optional[list]:
    """The trainer's optimizer parameter order in checkpoint names, when every name is
    known (a wrapper's ``module.`` prefixes stripped); else None (the checkpoint's order)."""
    if trainer is None or trainer.param_names is None:
        return None
    known = set(weights_names)
    out = []
    for n in trainer.param_names:
        while n not in known and n.startswith("module."):
            n = n[len("module."):]
        if n not in known:
            return None
        out.append(n)
    return out


def place_optimizer_state(state: dict, layout, *, flat: bool, model_fsdp: Any, part: int, parts: int,
                          shard: int, shards: int, trainer: Optional[OptimizerTarget], qkv: str,
                          structure: Optional[FlatStructure]) -> None:
    """(local) Make ``state[OPT_KEY]`` the optimizer state ``trainer`` expects, or refuse;
    without a trainer, the state laid out like the weights (``flat``) or as saved, or dropped
    with a warning."""
    opt = state.get(OPT_KEY)
    if opt is None:
        return
    if isinstance(opt, int) and opt == -1:
        # FSDP without sharded state: only data-parallel rank 0 saved the full optimizer state.
        opt = read_rest(rest_source(layout, part, parts, 0, shards), skip_optimizer=False).get(OPT_KEY)
        if isinstance(opt, int) or opt is None:
            state[OPT_KEY] = None
            logger.warning("metaseq-oneload: %s: no full optimizer state in the set", layout.display_name)
            return
    if not isinstance(opt, Mapping):
        state[OPT_KEY] = None
        return _optimizer_problem(layout, f"it is a {type(opt).__name__}, not an optimizer state dict", trainer)
    saved = "local_flat" if layout.flat else ("full_fsdp" if "param_id_map" in opt else "plain")
    target = trainer.format if trainer is not None else ("local_flat" if flat else saved)
    if saved == "full_fsdp" or target == "full_fsdp":
        # fairscale's own format, indexed by its param_id_map: kept, or cut by fairscale.
        if saved != "full_fsdp" or layout.model_parallel_size != parts:
            state[OPT_KEY] = None
            why = (f"it holds {_FORMATS[saved]} and this run's optimizer expects {_FORMATS[target]}" if saved != target
                   else f"it was saved for model-parallel size {layout.model_parallel_size} and this run has {parts}")
            return _optimizer_problem(layout, why, trainer)
        if target == "local_flat" and model_fsdp is not None:
            state[OPT_KEY] = owning(model_fsdp.get_shard_from_optim_state_dict(opt))
        elif target == "full_fsdp":
            state[OPT_KEY] = owning(opt)
        else:
            state[OPT_KEY] = None
            _optimizer_problem(layout, f"it holds {_FORMATS[saved]} and this run's optimizer expects "
                                       f"{_FORMATS[target]}", trainer)
        return
    # Flat shards or per-parameter state: resharded exactly like the weights, whatever the
    # saved and the target data- and model-parallel sizes.
    try:
        params = None
        if target == "plain":
            weights = plan_part(layout, parts, part, qkv=qkv)
            params = _param_order(trainer, weights)
            if params is None and saved == "local_flat":
                raise ValueError("the flat shards do not record the order of the model's parameters")
        new, why = rank_optimizer_state(layout, opt, part=part, parts=parts, shard=shard, shards=shards,
                                        flat=target == "local_flat", qkv=qkv, structure=structure, params=params)
    except (CheckpointLayoutError, ValueError, KeyError) as e:
        new, why = None, str(e)
    if new is None:
        state[OPT_KEY] = None
        return _optimizer_problem(layout, why, trainer)
    state[OPT_KEY] = new
    if not same_weights_layout(layout, parts=parts, shards=shards, flat=target == "local_flat", structure=structure):
        logger.info("metaseq-oneload: optimizer state resharded from %dx%d to %dx%d like the weights",
                    layout.model_parallel_size, layout.shards_per_part, parts, shards)

