"""Collectives for loading: no-ops without a process group, and failures reach every rank.

Like torch.distributed.checkpoint's ``_DistWrapper``: every helper here works the same with
no process group (one process, nothing to talk to). Nothing is ever pickled between ranks:
small messages travel as UTF-8 JSON in uint8 tensors, weights as raw tensor bytes.

Failure protocol: each phase of a load runs inside ``try``; at its end all ranks call
:func:`settle`, which exchanges "did you fail, and why" over the data-parallel group and
then the model-parallel group (two hops cover the whole grid) and raises
:class:`~metaseq_oneload._errors.DistributedLoadError` on every rank if any rank failed.
Inside the broadcast loop the reader announces each bucket with a status word first, so a
reader that fails mid-stream releases the receivers instead of leaving them waiting.
"""

from __future__ import annotations

import json
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ._errors import DistributedLoadError

__all__ = ["Group", "PeerFailure", "settle", "first_failure"]


class Group:
    """(all ranks of ``group``) One process group, or none.

    ``device`` is where collective buffers must live: CUDA for NCCL groups, CPU otherwise.
    """

    def __init__(self, group: Optional["dist.ProcessGroup"]):
        self.group = group
        self.active = group is not None and dist.is_available() and dist.is_initialized()
        if self.active:
            if dist.get_rank(group) < 0:
                raise ValueError(
                    f"rank {dist.get_rank()} is not a member of the process group it passed; pass the "
                    "groups this rank belongs to (every rank calls with its own data- and model-parallel group).")
            self.rank = dist.get_rank(group)
            self.size = dist.get_world_size(group)
            self.global_rank = dist.get_rank()
            backend = str(dist.get_backend(group)).lower()
            self.device = (torch.device("cuda", torch.cuda.current_device())
                           if "nccl" in backend and torch.cuda.is_available() else torch.device("cpu"))
        else:
            self.rank, self.size, self.global_rank = 0, 1, 0
            self.device = torch.device("cpu")

    def members(self) -> tuple:
        """Global ranks of the group (this rank alone without one)."""
        if not self.active:
            return (self.global_rank,)
        return tuple(dist.get_process_group_ranks(self.group))

    def all_max(self, value: int) -> int:
        """(collective) The largest ``value`` over the group."""
        if not self.active or self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t.item())

    def global_of(self, local_rank: int) -> int:
        return dist.get_global_rank(self.group, local_rank) if self.active else local_rank

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """(collective) In-place broadcast from local rank ``src``; staged through the
        group's device when the tensor lives elsewhere."""
        if not self.active or self.size == 1:
            return
        if tensor.device == self.device:
            dist.broadcast(tensor, src=self.global_of(src), group=self.group)
            return
        staged = tensor.to(self.device)
        dist.broadcast(staged, src=self.global_of(src), group=self.group)
        tensor.copy_(staged)

    def broadcast_bytes(self, payload: Optional[bytes], src: int = 0) -> bytes:
        """(collective) ``payload`` from local rank ``src`` to everyone."""
        if not self.active or self.size == 1:
            return payload or b""
        n = torch.tensor([len(payload) if self.rank == src else 0], dtype=torch.int64, device=self.device)
        dist.broadcast(n, src=self.global_of(src), group=self.group)
        buf = (torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device) if self.rank == src
               else torch.empty(int(n.item()), dtype=torch.uint8, device=self.device))
        if int(n.item()):
            dist.broadcast(buf, src=self.global_of(src), group=self.group)
        return bytes(buf.cpu().numpy().tobytes()) if self.rank != src else payload

    def all_gather_bytes(self, payload: bytes) -> list:
        """(collective) Every rank's ``payload``, in local-rank order."""
        if not self.active or self.size == 1:
            return [payload]
        n = torch.tensor([len(payload)], dtype=torch.int64, device=self.device)
        sizes = [torch.zeros_like(n) for _ in range(self.size)]
        dist.all_gather(sizes, n, group=self.group)
        longest = max(int(s.item()) for s in sizes)
        buf = torch.zeros(longest, dtype=torch.uint8, device=self.device)
        if payload:
            buf[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device)
        out = [torch.empty_like(buf) for _ in range(self.size)]
        dist.all_gather(out, buf, group=self.group)
        return [bytes(o[: int(s.item())].cpu().numpy().tobytes()) for o, s in zip(out, sizes)]

    def all_gather_json(self, obj) -> list:
        return [json.loads(b) for b in self.all_gather_bytes(json.dumps(obj).encode())]


class PeerFailure(Exception):
    """This rank is fine, but another rank of its group failed (see :func:`first_failure`)."""


def first_failure(group: Group, error: Optional[BaseException]) -> Optional[BaseException]:
    """(collective over ``group``) This rank's error, or, if another rank of the group
    failed, an error saying so; None when all went well. Never raises: a section that only
    one data-parallel group runs (its broadcast loop) uses it to stop in step, and carries
    the error to the next :func:`settle`, which every rank of the grid reaches."""
    if not group.active or group.size == 1:
        return error
    if group.all_max(0 if error is None else 1) and error is None:
        return PeerFailure("another rank of this group failed")
    return error


def settle(groups: Sequence[Group], error: Optional[BaseException], what: str) -> None:
    """(collective over every group given) Raise on every rank if any rank failed.

    ``error`` is this rank's failure in the phase just ended (None if it went well). With
    no active group the original error is re-raised unchanged.
    """
    active = [g for g in groups if g.active and g.size > 1]
    if not active:
        if error is not None:
            raise error
        return
    me = active[0].global_rank
    failures: dict = {}
    # A rank that only learned of another's failure (first_failure) adds nothing itself.
    if error is not None and not isinstance(error, PeerFailure):
        failures[str(me)] = f"{type(error).__name__}: {error}"
    for g in active:
        for gathered in g.all_gather_json(failures):
            failures.update(gathered)
    if not failures:
        return
    ranks = sorted(int(r) for r in failures)
    lines = "\n".join(f"  rank {r}: {failures[str(r)]}" for r in ranks)
    raise DistributedLoadError(
        f"{what} failed on {len(ranks)} rank(s) ({', '.join(map(str, ranks))}); every rank stops here.\n"
        f"{lines}",
        {r: failures[str(r)] for r in ranks},
    ) from (None if isinstance(error, PeerFailure) else error)
