"""Objects between ranks without pickling their tensors: :func:`broadcast_object` (what
metaseq's and fairseq's ``broadcast_object`` become) and :func:`same_everywhere` (a state
dict that every rank may already hold, sent only where it differs).

The tensors travel as raw bytes in bounded buckets; only the small rest is pickled, and it is
unpickled with ``weights_only`` and the checkpoint allowlist, so a receiver never runs code
from the sender.
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import re
from typing import Any, Mapping, Optional, Sequence

import torch

from .. import _allowlist
from .._dist import Group, settle
from .._errors import UnsafeCheckpointError
from ._patching import current_config

__all__ = ["broadcast_object", "same_everywhere", "digest", "TensorRef"]


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


def digest(state_dict: Mapping) -> str:
    """A hash of a state dict's names and bytes (not of float sums: [1, 2, 3] is not [3, 2, 1])."""
    h = hashlib.sha256()
    _feed(h, dict(state_dict))
    return h.hexdigest()


def same_everywhere(state_dict: Mapping, group: Any) -> Mapping:
    """(collective over ``group``) ``state_dict`` as group rank 0 has it, on every rank: no
    transfer when every rank holds the same already, else tensors broadcast as raw bytes."""
    g = Group(group)
    digests = g.all_gather_json(digest(state_dict or {}))
    if len(set(digests)) == 1 and state_dict:
        return state_dict
    return broadcast_object(state_dict if g.rank == 0 else None, 0, group)


class TensorRef(int):
    """Where a tensor was in a broadcast object (the tensor itself travels as bytes)."""


def _split_tensors(obj: Any, tensors: list) -> Any:
    if torch.is_tensor(obj):
        tensors.append(obj)
        return TensorRef(len(tensors) - 1)
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
    if isinstance(obj, TensorRef):
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
    with _allowlist.allowlisted():  # restores torch's allowlist exactly on exit
        torch.serialization.add_safe_globals([TensorRef])
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
    _broadcast_tensor_bytes(g, tensors, src_rank, sender, current_config().bucket_mb if bucket_mb is None else bucket_mb)
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
