"""Shared test fixtures.

Real metaseq- and fairseq-written checkpoints live in the repository, in
``tests/fixtures/metaseq`` and ``tests/fixtures/fairseq`` (see their READMEs for how each set
was made). Set ONELOAD_FIXTURES to point the metaseq sets elsewhere.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]

# The index key (formats/_index.py) defaults to one in the user's home: the suite keeps its
# own, so that running the tests writes nothing there (subprocesses inherit it).
if not os.environ.get("METASEQ_ONELOAD_INDEX_KEY"):
    os.environ["METASEQ_ONELOAD_INDEX_KEY"] = os.path.join(
        tempfile.mkdtemp(prefix="oneload-test-key-"), "index-key")
FIXTURES = Path(os.environ.get("ONELOAD_FIXTURES", REPO / "tests" / "fixtures" / "metaseq"))
SETS = ("singleton", "fsdp_dp3", "mp2_ddp", "mp2_dp2", "shard_only")

# (kind, model_parallel_size, shards_per_part, flat) of each fixture set, from its README.
EXPECTED = {
    "singleton": ("singleton", 1, 1, False),
    "fsdp_dp3": ("fsdp_sharded", 1, 3, True),
    "mp2_ddp": ("model_parallel", 2, 1, False),
    "mp2_dp2": ("fsdp_sharded", 2, 2, True),
    "shard_only": ("fsdp_sharded", 1, 2, True),
}


def fixtures_available() -> bool:
    return (FIXTURES / "singleton").is_dir()


needs_fixtures = pytest.mark.skipif(not fixtures_available(), reason=f"metaseq fixtures not found at {FIXTURES}")


@pytest.fixture
def fixtures() -> Path:
    if not fixtures_available():
        pytest.skip(f"metaseq fixtures not found at {FIXTURES}")
    return FIXTURES


def copy_set(name: str, dst: Path) -> Path:
    """A writable copy of one fixture set (links stay what they are on disk)."""
    out = dst / name
    shutil.copytree(FIXTURES / name, out, symlinks=True)
    for p in out.iterdir():
        p.chmod(0o644)
    return out


def raw_load(path) -> dict:
    """torch.load, independent of the package under test."""
    with torch.serialization.safe_globals([argparse.Namespace]):
        return torch.load(path, map_location="cpu", weights_only=True)


def reference_weights() -> dict:
    """The singleton's weights with metaseq's names, built by hand (not by the package):
    k/v/q fused as metaseq does (``cat([k, v, q])``), output projection tied."""
    sd = dict(raw_load(FIXTURES / "singleton" / "checkpoint_2_consolidated.pt")["model"])
    out = {}
    for k, v in sd.items():
        if ".self_attn.k_proj." in k:
            leaf = k.rsplit(".", 1)[1]
            pre = k.split(".self_attn.")[0] + ".self_attn."
            out[pre + "qkv_proj." + leaf] = torch.cat(
                [sd[pre + "k_proj." + leaf], sd[pre + "v_proj." + leaf], sd[pre + "q_proj." + leaf]])
        elif ".self_attn.v_proj." in k or ".self_attn.q_proj." in k:
            continue
        else:
            out[k] = v
    out["decoder.output_projection.weight"] = out["decoder.embed_tokens.weight"]
    return out


def assert_matches_reference(loaded: dict, ref: dict, *, tol: float = 1e-5) -> None:
    """Equal to the singleton within ``tol``. The k rows of ``qkv_proj.bias`` are the one
    exception, compared at 1e-4: they get no gradient (softmax ignores a per-query shift),
    so Adam's noise differs between the fixture runs there (README: logits agree to 1e-6)."""
    assert set(loaded) == set(ref), sorted(set(loaded) ^ set(ref))
    for k, v in ref.items():
        got = loaded[k].to(v.dtype)
        assert got.shape == v.shape, (k, got.shape, v.shape)
        diff = (got - v).abs()
        if k.endswith("self_attn.qkv_proj.bias"):
            third = v.shape[0] // 3
            assert diff[:third].max() <= 1e-4, (k, diff[:third].max())
            diff = diff[third:]
        assert diff.max() <= tol, (k, float(diff.max()))


def reference_part(ref: dict, part: int, nparts: int) -> dict:
    """Megatron's split of the reference weights, written out by hand for the tests."""
    if nparts == 1:
        return dict(ref)
    out = {}
    for k, v in ref.items():
        if k.endswith(("qkv_proj.weight", "qkv_proj.bias")):
            k_, v_, q_ = v.chunk(3)
            out[k] = torch.cat([x.chunk(nparts)[part] for x in (k_, v_, q_)])
        elif k.endswith((".fc1.weight", ".fc1.bias", "embed_tokens.weight", "output_projection.weight")):
            out[k] = v.chunk(nparts)[part]
        elif k.endswith((".out_proj.weight", ".fc2.weight")):
            out[k] = v.chunk(nparts, dim=1)[part]
        else:
            out[k] = v
    return out
