"""``load_into(..., optimizer=)`` on 3 real gloo ranks (issue 23, optimizer state): the Adam
state ``tests/fixtures/dcp/fsdp2_optim`` holds (saved by FSDP2 on 2 ranks) resharded onto FSDP2
over 3 ranks and onto plain replicas, against torch's own recipe in the same run (``dcp.load``
into ``get_state_dict`` then ``set_state_dict``): every state tensor's local shard equal,
``param_groups`` equal, and one more step gives identical parameters. The single-process load
onto a plain module is in ``tests/unit/test_optim_into.py``."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import REPO
from tests.distributed.harness import run_ranks

OPTIM = REPO / "tests" / "fixtures" / "dcp" / "fsdp2_optim"
pytestmark = pytest.mark.skipif(not (OPTIM / ".metadata").is_file(), reason="DCP corpus not found")


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _step(model, optim, mesh) -> None:
    """One step with seeded gradients, each placed as its parameter is."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    g = torch.Generator().manual_seed(11)
    for _, p in sorted(model.named_parameters()):
        full = torch.randn(p.shape, generator=g)
        p.grad = distribute_tensor(full, mesh, p.placements) if isinstance(p, DTensor) else full
    optim.step()


def _compare(ours, ours_optim, theirs, theirs_optim, mesh, what: str) -> None:
    a, b = ours_optim.state_dict(), theirs_optim.state_dict()
    assert a["param_groups"] == b["param_groups"] and a["param_groups"][0]["lr"] == 1e-3, what
    assert set(a["state"]) == set(b["state"]) and len(a["state"]) == len(list(ours.parameters())), what
    for i, entry in a["state"].items():
        assert set(entry) == {"step", "exp_avg", "exp_avg_sq"} == set(b["state"][i]), what
        for k, v in entry.items():
            w = b["state"][i][k]
            assert type(v) is type(w) and getattr(v, "placements", None) == getattr(w, "placements", None), (what, i, k)
            assert torch.equal(_local(v), _local(w)), (what, i, k)
    _step(ours, ours_optim, mesh)
    _step(theirs, theirs_optim, mesh)
    for (n, p), (_, q) in zip(ours.named_parameters(), theirs.named_parameters()):
        assert torch.equal(_local(p).detach(), _local(q).detach()), (what, n)


def _torch_way(model):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    optim = torch.optim.Adam(model.parameters(), lr=5e-2)
    msd, osd = get_state_dict(model, optim)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=str(OPTIM))
    set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    return optim


def optim_cases(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import metaseq_oneload as mo
    from tests.tiny_metaseq import TinyMetaseqLM, sharded_on_meta

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for strategy in ("auto", "parallel"):  # FSDP2 shards of 3 from chunks of 2
        ours = sharded_on_meta(mesh)
        ours.to_empty(device="cpu")  # the optimizer is built over the materialised parameters
        optim = torch.optim.Adam(ours.parameters(), lr=5e-2)
        report = mo.load_into(ours, str(OPTIM), optimizer=optim, strategy=strategy, verify=True)
        theirs = sharded_on_meta(mesh)
        theirs.to_empty(device="cpu")
        _compare(ours, optim, theirs, _torch_way(theirs), mesh, f"FSDP2 {strategy}")
        out[f"fsdp2_{strategy}"] = report.bytes_read
    # Plain replicas: every rank wants every byte; "parallel" reads each once between the ranks.
    ours = TinyMetaseqLM()
    optim = torch.optim.Adam(ours.parameters(), lr=5e-2)
    report = mo.load_into(ours, str(OPTIM), optimizer=optim, strategy="parallel", process_group=dist.group.WORLD)
    theirs = TinyMetaseqLM()
    _compare(ours, optim, theirs, _torch_way(theirs), mesh, "replicas")
    out["replicas"] = report.bytes_read
    # No optimizer state in the folder: refused on every rank, before anything is read.
    try:
        mo.load_into(TinyMetaseqLM(), str(OPTIM.parent / "fsdp2_w2"), no_dist=False,
                     optimizer=torch.optim.Adam(TinyMetaseqLM().parameters()), process_group=dist.group.WORLD)
        out["refused"] = ""
    except mo.OptionError as e:
        out["refused"] = str(e)
    dist.barrier()
    return out


def test_optimizer_state_onto_three_ranks(tmp_path):
    results = run_ranks(3, optim_cases, tmp_path=tmp_path, timeout=240)
    stored = sum(t.nbytes for t in _stored_tensors())
    for name in ("fsdp2_parallel", "replicas"):
        total = sum(r[name] for r in results)
        # read once between the ranks: the model's and the optimizer's tensor bytes (less the
        # tied output projection's copy, which the module does not want), not 3x
        assert 0.95 * stored <= total <= 1.05 * stored, (name, total, stored)
        print(f"{name}: {total} bytes read by 3 ranks, {stored} stored")
    assert all("holds no optimizer state" in r["refused"] for r in results), results


def _stored_tensors():
    from metaseq_oneload.formats.dcp import describe_with_optimizer

    layout, shadows = describe_with_optimizer(str(OPTIM))
    assert shadows is not None and len(shadows.tensors) == 3 * 28
    return layout.parts[0].tensors.values()
