"""Layout discovery on real metaseq checkpoints, from every entry point."""

from __future__ import annotations

import glob
import os

import pytest

import metaseq_oneload as mo
from tests.conftest import EXPECTED, FIXTURES, REPO, SETS, needs_fixtures

pytestmark = needs_fixtures


def entry_points(name: str) -> list:
    """Every way a user may point at a fixture set."""
    d = FIXTURES / name
    pts = [str(d)] + sorted(str(p) for p in d.iterdir() if p.name != "reference_logits.pt")
    prefixes = {p.name.split("-")[0] for p in d.iterdir() if "-" in p.name}
    pts += [str(d / f"{pre}.pt") for pre in sorted(prefixes)]  # un-suffixed names
    if name != "singleton":
        pts.append(str(d / "checkpoint_2-*.pt"))  # a glob
    return pts


CASES = [(name, p) for name in SETS for p in entry_points(name)] if FIXTURES.is_dir() else []


@pytest.mark.parametrize("name,path", CASES, ids=[f"{n}:{os.path.basename(p)}" for n, p in CASES])
def test_every_entry_point_finds_the_set(name, path):
    layout = mo.inspect(path)
    kind, m, d, flat = EXPECTED[name]
    assert (layout.kind, layout.model_parallel_size, layout.shards_per_part, layout.flat) == (kind, m, d, flat)
    assert layout.saved_world_size == m * d
    real = sorted(p for p in glob.glob(str(FIXTURES / name / "*.pt"))
                  if "reference_logits" not in p and "checkpoint_last" not in p)
    assert sorted(f.path for f in layout.all_files) == real  # links never double-counted
    for mi, row in enumerate(layout.files):
        for di, f in enumerate(row):
            assert (f.part, f.shard) == (mi, di)


def test_facts_from_the_files():
    sizes = {name: mo.inspect(FIXTURES / name) for name in SETS}
    # All sets are the same model: 64x34 embeddings, 18x34 positions, 2 layers.
    assert {lay.num_params for lay in sizes.values()} == {21548}
    assert {lay.dtypes for lay in sizes.values()} == {("float32",)}
    fsdp = sizes["fsdp_dp3"]
    layer = [fp for fp in fsdp.parts[0].flat_params if fp.key == "decoder.layers.0.flat_param_0"][0]
    assert layer.paddings == (0, 0, 2) and layer.shard_numels == (3116,) * 3 and layer.total_numel == 9346
    assert layer.names[0] == "decoder.layers.0.self_attn.qkv_proj.weight"
    assert layer.shapes[0] == (102, 34)
    assert fsdp.parts[0].buffer_names == ("decoder.version",)
    assert ("decoder.embed_tokens.weight", "decoder.output_projection.weight") in fsdp.parts[0].shared
    mp = sizes["mp2_dp2"]
    assert mp.parts[1].tensors["decoder.layers.0.self_attn.qkv_proj.weight"].shape == (51, 34)
    assert sizes["mp2_ddp"].cfg.ddp_backend == "pytorch_ddp"
    assert fsdp.aliases and all(a.startswith("checkpoint_last-") for a in fsdp.aliases)


def test_stale_cfg_is_a_note_and_the_files_win():
    # What consolidating and resharding writers leave is normal: reported, not warned about.
    single = mo.inspect(FIXTURES / "singleton")
    assert single.cfg.distributed_world_size == 3 and single.saved_world_size == 1
    assert any("use_sharded_state=True" in w for w in single.notes) and single.warnings == ()
    resharded = mo.inspect(FIXTURES / "shard_only")
    assert any("distributed_world_size=3" in w and "2 ranks" in w for w in resharded.notes)
    assert mo.inspect(FIXTURES / "fsdp_dp3").notes == ()


DOC = (REPO / "docs" / "inspect.md").read_text() if (REPO / "docs" / "inspect.md").exists() else ""


def test_json_fields_are_documented():
    d = mo.inspect(FIXTURES / "mp2_dp2").to_dict()
    for key in ("kind", "model_parallel_size", "shards_per_part", "flat", "use_sharded_state",
                "saved_world_size", "files", "num_params", "total_bytes", "warnings"):
        assert key in d
        assert f"`{key}`" in DOC, f"{key} is not documented in docs/inspect.md"
    assert d["files"][1][0].endswith("checkpoint_2-model_part-1-shard0.pt") and os.path.isabs(d["files"][1][0])


def test_real_symlinks_resolve_to_one_set(tmp_path):
    for p in (FIXTURES / "mp2_ddp").glob("checkpoint_2-*.pt"):
        os.symlink(p, tmp_path / p.name)
        os.symlink(tmp_path / p.name, tmp_path / p.name.replace("checkpoint_2", "checkpoint_last"))
    for entry in (tmp_path, tmp_path / "checkpoint_last.pt", tmp_path / "checkpoint_last-model_part-1.pt"):
        layout = mo.inspect(entry)
        assert layout.model_parallel_size == 2 and len(layout.all_files) == 2
        # File links: the set lives where the real files are (here: FIXTURES, or what it links to).
        assert all(f.path.startswith(os.path.realpath(FIXTURES)) for f in layout.all_files)


def test_fairseq_part_files_with_fsdp_metadata(tmp_path):
    """X_part{k}.pt (fairseq checkpoint_shard_count > 1) holding FSDP shards whose metadata
    fairseq stores under ``fsdp_metadata``."""
    import torch

    from tests.conftest import assert_matches_reference, raw_load, reference_weights

    for d in range(3):
        state = raw_load(FIXTURES / "fsdp_dp3" / f"checkpoint_2-model_part-0-shard{d}.pt")
        state["fsdp_metadata"] = state.pop("shard_metadata")
        torch.save(state, tmp_path / f"checkpoint_2_part{d}.pt")
    for entry in (tmp_path, tmp_path / "checkpoint_2_part1.pt", tmp_path / "checkpoint_2.pt"):
        layout = mo.inspect(entry)
        assert (layout.kind, layout.shards_per_part, layout.metadata_key) == ("fsdp_sharded", 3, "fsdp_metadata")
    assert any("checkpoint.checkpoint_shard_count=1" in w and "3 _part file(s)" in w for w in layout.notes)
    assert_matches_reference(mo.load_state_dict(tmp_path), reference_weights())
