"""`convert --format dcp` output read by torch's own ``dcp.load`` into FSDP2 ``fully_shard``
models on 2 and 3 gloo ranks: world sizes other than the source's layout and than the
folder's file count. One process group per world size serves every case.

Oracle: the corpus's independent reading of the source set (tests/corpus.py), compared
exactly with each parameter's ``full_tensor()``; each rank holds only its own dim-0 shard.
"""

from __future__ import annotations

import pytest
import torch

import metaseq_oneload as mo
from tests.conftest import FIXTURES, needs_fixtures
from tests.distributed.harness import run_ranks

pytestmark = [needs_fixtures, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

# (source set, files of the DCP folder written from it): MP2 x DP2 flat, 1x3 flat, a singleton.
CASES = [("mp2_dp2", 1), ("fsdp_dp3", 2), ("singleton", 3)]


def load_cases(rank: int, world: int, cases: list) -> list:
    """(collective over the world) Each DCP folder into a fresh FSDP2 model with dcp.load;
    every full tensor equal to the independent reading of its source set."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from tests.corpus import canonical
    from tests.tiny_metaseq import sharded_on_meta

    mesh = init_device_mesh("cpu", (world,))
    out = []
    for name, folder, reference in cases:
        model = sharded_on_meta(mesh)
        model.to_empty(device="cpu")
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().fill_(float("nan"))  # nothing left unloaded passes as a value
        sd = model.state_dict()
        dcp.load(sd, checkpoint_id=folder)
        model.load_state_dict(sd)
        want = torch.load(reference, weights_only=True)
        full = {n: t.full_tensor() if isinstance(t, DTensor) else t for n, t in model.state_dict().items()}
        got = canonical(full)
        assert set(want) <= set(got), sorted(set(want) - set(got))
        for k, v in want.items():
            assert torch.equal(got[k], v), (name, k, float((got[k] - v).abs().max()))
        assert torch.equal(full["decoder.output_projection.weight"], full["decoder.embed_tokens.weight"])
        emb = model.decoder.embed_tokens.weight
        # This rank's own dim-0 shard only, as torch.chunk splits the rows.
        assert emb.to_local().shape[0] == torch.empty(emb.shape[0]).chunk(world)[rank].numel()
        out.append([name, list(emb.to_local().shape)])
    return out


def test_fsdp2_on_2_and_3_ranks_loads_our_dcp_output(tmp_path):
    from tests.corpus import by_id, full_weights

    cases = []
    for name, files in CASES:
        folder = tmp_path / f"{name}_dcp"
        mo.convert(FIXTURES / name, folder, format="dcp", shards=files, progress=False)
        torch.save(full_weights(by_id(f"metaseq/{name}")), tmp_path / f"{name}_ref.pt")  # read once, here
        cases.append((name, str(folder), str(tmp_path / f"{name}_ref.pt")))
    for world in (2, 3):
        results = run_ranks(world, load_cases, cases, tmp_path=tmp_path)
        assert [[c[0] for c in r] for r in results] == [[n for n, _ in CASES]] * world
