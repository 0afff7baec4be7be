"""torch.distributed.checkpoint folders onto 1-4 real gloo ranks (issue 23, reader): every set
of ``tests/fixtures/dcp`` loads, with full weights on every rank under every strategy and into
FSDP2 shards, equal to what torch's own readers give in the same run (``dcp.load`` with its
empty-state-dict planner, as ``dcp_to_torch_save`` reads; ``dcp.load`` into the same FSDP2
model). One process group per world serves every case; worlds of 3 and 4 play one node per
rank and ask for ``parallel``, so the bytes are read once between the ranks."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from tests.conftest import REPO
from tests.distributed.harness import run_ranks

DCP = REPO / "tests" / "fixtures" / "dcp"
SETS = ("plain_nopg", "fsdp1_sharded", "fsdp2_w2", "fsdp2_w3", "fsdp2_dim1", "fsdp2_optim")
pytestmark = pytest.mark.skipif(not (DCP / "fsdp2_w2" / ".metadata").is_file(), reason="DCP corpus not found")


def _torch_model_dict(path: str) -> dict:
    """The model's state dict as torch's own reader gives it, read by this rank alone."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
    from torch.distributed.checkpoint import FileSystemReader

    sd: dict = {}
    _load_state_dict(sd, storage_reader=FileSystemReader(path), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return sd["model"] if isinstance(sd.get("model"), dict) else sd


def _equal(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), what
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, f"{what}: {k}"
        assert torch.equal(got[k], want[k]), f"{what}: {k}"


def _fsdp2_case(path: str, name: str, world: int, want: dict, against_torch: bool) -> list:
    """load_into an FSDP2 model built on meta; with ``against_torch``, dcp.load into another
    sharded the same way: the same full tensors."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    import metaseq_oneload as mo
    from tests.tiny_metaseq import sharded_on_meta

    mesh = init_device_mesh("cpu", (world,))
    ours = sharded_on_meta(mesh)
    report = mo.load_into(ours, path, verify=True)
    full = {n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in ours.state_dict().items()}
    _equal(full, want, f"{name} load_into FSDP2")
    if against_torch:
        theirs = sharded_on_meta(mesh)
        theirs.to_empty(device="cpu")
        sd = theirs.state_dict()
        dcp.load({"model": sd} if name in ("fsdp1_sharded", "fsdp2_optim") else sd, checkpoint_id=path)
        full2 = {n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in theirs.state_dict().items()}
        _equal(full, full2, f"{name} load_into FSDP2 against dcp.load")
    local = sum(p.to_local().numel() for p in ours.parameters())
    return [name, "fsdp2", local, report.bytes_read, report.verified]


def dcp_cases(rank: int, world: int, cases) -> list:
    """Each case (set, what): a strategy for full weights on every rank, or "fsdp2" /
    "fsdp2+torch" (load_into FSDP2 shards; also against dcp.load)."""
    import metaseq_oneload as mo

    nodes = world > 2
    if nodes:
        os.environ["METASEQ_ONELOAD_NODE"] = f"node{rank}"
    out = []
    wants: dict = {}
    for name, what in cases:
        path = str(DCP / name)
        want = wants.get(name)
        if want is None:
            want = wants[name] = _torch_model_dict(path)
        if what.startswith("fsdp2"):
            out.append(_fsdp2_case(path, name, world, want, what == "fsdp2+torch"))
            continue
        strategy = "parallel" if nodes and what == "auto" else what
        lc = mo.load_checkpoint(path, process_group=dist.group.WORLD, strategy=strategy, verify=True)
        _equal(lc.model, want, f"{name} {strategy} (world {world}, rank {rank})")
        out.append([name, strategy, lc.report.strategy, lc.report.bytes_read, lc.report.verified])
    return out


def _all(what: str) -> list:
    return [(name, what) for name in SETS]


# Every set with full weights and into FSDP2 shards on 2 and 3 ranks; the other strategies,
# worlds 1 and 4, and torch's own FSDP2 load on a few (the suite's time: ~60 s in all).
@pytest.mark.parametrize("world,cases", [
    (1, [("fsdp2_w3", "auto"), ("fsdp1_sharded", "fsdp2")]),
    (2, _all("auto") + _all("fsdp2") + [("fsdp2_dim1", "broadcast"), ("fsdp2_w3", "reshard"),
                                        ("fsdp2_w3", "fsdp2+torch"), ("fsdp1_sharded", "fsdp2+torch")]),
    (3, _all("auto") + [("fsdp2_w2", "fsdp2"), ("fsdp2_optim", "fsdp2+torch")]),
    (4, [("fsdp2_w3", "auto"), ("fsdp2_dim1", "auto"), ("fsdp1_sharded", "broadcast"), ("fsdp2_dim1", "fsdp2")]),
], ids=["w1", "w2", "w3", "w4"])
def test_every_dcp_set_onto_any_world(tmp_path, world, cases):
    results = run_ranks(world, dcp_cases, cases, tmp_path=tmp_path, timeout=300)
    rows = results[0]
    assert all(len(r) == len(rows) for r in results)
    sizes = {name: sum(f.stat().st_size for f in (DCP / name).glob("*.distcp")) for name in SETS}
    for i, row in enumerate(rows):
        name, asked = row[0], row[1]
        assert all(r[i][4] for r in results)  # verify=True passed on every rank
        if asked == "fsdp2":
            assert sum(r[i][2] for r in results) == 21548  # the local shards make the model once
        elif asked == "parallel":
            # one node per rank: the cluster reads each byte once between them
            assert sum(r[i][3] for r in results) <= sizes[name], (row, [r[i] for r in results])
