"""The broadcast_object that install() puts into metaseq.distributed.utils, on real gloo
ranks (metaseq itself is not needed): tensors as raw bytes in buckets, the rest unpickled
with weights_only, failures on every rank, no transfer when every rank has the same."""

import argparse
from collections import OrderedDict

import torch
import torch.distributed as dist

from metaseq_oneload.integrations._broadcast import broadcast_object, digest, same_everywhere
from tests.distributed.harness import run_ranks


def sample() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "fp32": torch.randn(3, 4, generator=g),
        "list": [torch.randn(5, generator=g).to(torch.bfloat16), (1, "x", torch.tensor([True, False, True]))],
        "meta": OrderedDict(cfg=argparse.Namespace(model_parallel_size=2, arch="tiny"), step=7, lr=0.5),
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(7, dtype=torch.int64),
        "strided": torch.arange(24.).reshape(4, 6)[:, ::2],  # not contiguous on the sender
        "big": torch.randn(70_000, generator=g),  # 280 KB: several 0.1 MB buckets
        "none": None,
        "set": {1, 2},
    }


def same(a, b) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def broadcast_worker(rank: int, world: int) -> list:
    out = []
    got = broadcast_object(sample() if rank == 1 else None, 1, None, bucket_mb=0.1)
    out.append(same(got, sample()))
    # A group that leaves rank 0 out: src_rank counts within the group (global rank 2).
    sub = dist.new_group([1, 2])
    if rank in (1, 2):
        got = broadcast_object({"from": rank, "t": torch.full((3,), float(rank))} if rank == 2 else "ignored", 1, sub)
        out.append(got["from"] == 2 and torch.equal(got["t"], torch.full((3,), 2.0)))
    else:
        out.append(True)

    class Unpicklable:
        pass

    for bad in (NotAllowed(), Unpicklable()):
        try:
            broadcast_object({"x": bad} if rank == 0 else None, 0, None)
            out.append("no error")
        except Exception as e:  # every rank, the sender included, learns of the failure
            out.append(f"{type(e).__name__}: {e}")
    # The FSDP wrapper's full state dicts: nothing sent when every rank holds the same.
    same_sd = {"w": torch.arange(6.).reshape(2, 3)}
    out.append(same_everywhere(same_sd, dist.group.WORLD) is same_sd)
    differing = {"w": torch.full((2, 3), float(rank))} if rank == 0 else {}
    out.append(torch.equal(same_everywhere(differing, dist.group.WORLD)["w"], torch.zeros(2, 3)))
    # Same numbers in another order (equal float sums): not the same state dict.
    permuted = {"w": torch.tensor([1.0, 2.0, 3.0]) if rank == 0 else torch.tensor([3.0, 2.0, 1.0])}
    out.append(same_everywhere(permuted, dist.group.WORLD)["w"].tolist() == [1.0, 2.0, 3.0])
    return out


class NotAllowed:
    """Picklable, but not a class checkpoints carry: receivers must refuse to build it."""


def test_broadcast_object_on_three_ranks(tmp_path):
    results = run_ranks(3, broadcast_worker, tmp_path=tmp_path)
    for r in results:
        assert r[0] is True and r[1] is True
        assert r[2].startswith("DistributedLoadError: broadcast_object: unpacking the object failed on 2 rank(s) (1, 2)")
        assert "holds tests.unit.test_metaseq_broadcast.NotAllowed, which is outside the allowlist" in r[2]
        assert r[3].startswith("DistributedLoadError: broadcast_object: packing the object failed on 1 rank(s) (0)")
        assert r[4] is True and r[5] is True and r[6] is True


def test_without_a_process_group_it_is_the_identity():
    obj = {"t": torch.ones(2)}
    assert broadcast_object(obj, 0, None) is obj


def test_digest_hashes_bytes_not_sums():
    a = {"w": torch.tensor([1.0, 2.0, 3.0])}
    assert digest(a) == digest({"w": torch.tensor([1.0, 2.0, 3.0])})
    assert digest(a) != digest({"w": torch.tensor([3.0, 2.0, 1.0])})
    assert digest(a) != digest({"w": torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)})
    assert digest(a) != digest({"w": torch.tensor([[1.0, 2.0, 3.0]])})
    assert digest({"b": torch.tensor([True, False]), "h": torch.ones(2, dtype=torch.bfloat16)}) != digest(
        {"b": torch.tensor([False, True]), "h": torch.ones(2, dtype=torch.bfloat16)})
    assert digest({"t": torch.arange(6.0).reshape(2, 3).t()}) == digest({"t": torch.arange(6.0).reshape(2, 3).t().contiguous()})
