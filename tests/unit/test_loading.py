"""The engine in one process (no process group): options, formats, and refusals."""

from __future__ import annotations

import pytest
import torch

import metaseq_oneload as mo
from metaseq_oneload import CheckpointLayoutError, StateDictMismatchError
from metaseq_oneload._plan import plan_part
from tests.conftest import FIXTURES, assert_matches_reference, needs_fixtures, raw_load, reference_weights
from tests.tiny_metaseq import TinyMetaseqLM


@needs_fixtures
@pytest.mark.parametrize("name", ["singleton", "fsdp_dp3", "mp2_ddp", "mp2_dp2", "shard_only"])
def test_every_set_in_one_process(name):
    lc = mo.load_checkpoint(FIXTURES / name, verify=True)
    assert_matches_reference(lc.model, reference_weights())
    assert lc.report.verified and lc.report.target_world == 1
    # Read once: every model byte at most once (the tied projection is not read again).
    assert lc.report.bytes_read <= mo.inspect(FIXTURES / name).total_bytes


@needs_fixtures
def test_dtype_device_and_split_names():
    sd = mo.load_state_dict(FIXTURES / "fsdp_dp3", dtype=torch.bfloat16)
    ref = reference_weights()
    assert sd["decoder.layers.0.fc1.weight"].dtype == torch.bfloat16
    assert torch.equal(sd["decoder.layers.1.fc2.weight"], ref["decoder.layers.1.fc2.weight"].to(torch.bfloat16))
    split = mo.load_state_dict(FIXTURES / "mp2_dp2", qkv="split")
    k = split["decoder.layers.0.self_attn.k_proj.weight"]
    assert torch.allclose(torch.cat([k, split["decoder.layers.0.self_attn.v_proj.weight"],
                                     split["decoder.layers.0.self_attn.q_proj.weight"]]),
                          ref["decoder.layers.0.self_attn.qkv_proj.weight"], atol=1e-5)
    kept = mo.load_state_dict(FIXTURES / "singleton", qkv="keep")
    assert "decoder.layers.0.self_attn.q_proj.bias" in kept and "decoder.layers.0.self_attn.qkv_proj.bias" not in kept


@needs_fixtures
def test_model_parallel_plans():
    layout = mo.inspect(FIXTURES / "singleton")
    with pytest.raises(CheckpointLayoutError, match=r"34 rows per projection \(k, v, q\) do not split over 4 model-parallel parts"):
        plan_part(layout, 4, 0)
    two = plan_part(layout, 2, 1)
    assert two["decoder.layers.0.self_attn.qkv_proj.weight"].shape == (51, 34)
    assert two["decoder.layers.0.fc2.weight"].shape == (34, 32)
    assert two["decoder.output_projection.weight"].alias_of == "decoder.embed_tokens.weight"


def test_unknown_names_need_a_rule_to_change_model_parallel_size(tmp_path):
    for m in range(2):
        torch.save({"model": {"encoder.mystery.weight": torch.full((4, 4), float(m))},
                    "cfg": {"common": {"model_parallel_size": 2}}}, tmp_path / f"ck-model_part-{m}.pt")
    layout = mo.inspect(tmp_path / "ck.pt")
    with pytest.raises(CheckpointLayoutError, match=r"cannot change the model-parallel size 2 -> 1: no split rule for "
                                                    r"\['encoder\.mystery\.weight'\]\. Pass rules="):
        mo.load_state_dict(tmp_path / "ck.pt")
    merged = mo.load_state_dict(tmp_path / "ck.pt", rules={"mystery.weight": "row"})
    assert merged["encoder.mystery.weight"].shape == (4, 8)
    assert torch.equal(merged["encoder.mystery.weight"][:, 4:], torch.ones(4, 4))
    assert plan_part(layout, 2, 1)["encoder.mystery.weight"].copies[0].src.part == 1  # same size: identity


def test_plain_pytorch_formats(tmp_path):
    torch.manual_seed(0)
    sd = {"a.weight": torch.randn(5, 3).t(),  # non-contiguous: read through torch.load
          "b.weight": torch.randn(7, dtype=torch.bfloat16),
          "c.steps": torch.arange(4)}
    torch.save(sd, tmp_path / "plain.pt")
    torch.save(sd, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    for name in ("plain.pt", "legacy.pt"):
        got = mo.load_state_dict(tmp_path / name, verify=True)
        assert set(got) == set(sd)
        for k in sd:
            assert torch.equal(got[k], sd[k]) and got[k].dtype == sd[k].dtype
    assert mo.inspect(tmp_path / "legacy.pt").files[0][0].format == "legacy"


@needs_fixtures
def test_refusals():
    with pytest.raises(ValueError, match=r"strategy='fastest': expected one of auto, own_shard, reshard, broadcast"):
        mo.load_state_dict(FIXTURES / "singleton", strategy="fastest")
    with pytest.raises(CheckpointLayoutError, match=r"strategy='own_shard' needs the saved layout to match the world, "
                                                    r"but saved 3 shard\(s\) per part != 1 data-parallel rank\(s\)"):
        mo.load_state_dict(FIXTURES / "fsdp_dp3", strategy="own_shard")
    with pytest.raises(StateDictMismatchError, match=r"flat=True needs the target FSDP wrapping.*local_metadata_dict"):
        mo.load_state_dict(FIXTURES / "mp2_ddp", flat=True)


@needs_fixtures
def test_load_into_checks_everything_before_writing():
    torch.manual_seed(0)
    model = TinyMetaseqLM(layers=3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(StateDictMismatchError, match=r"missing from the checkpoint: decoder\.layers\.2\.self_attn\.qkv_proj\.weight.*"
                                                     r"Nothing was loaded.*strict=False"):
        mo.load_into(model, FIXTURES / "fsdp_dp3")
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    report = mo.load_into(model, FIXTURES / "fsdp_dp3", strict=False)
    assert report.strategy in ("own_shard", "reshard")
    sd = model.state_dict()
    assert torch.equal(sd["decoder.layers.2.fc1.weight"], before["decoder.layers.2.fc1.weight"])
    ref = reference_weights()
    assert torch.equal(sd["decoder.layers.1.fc1.weight"], ref["decoder.layers.1.fc1.weight"])
    small = TinyMetaseqLM(dim=32)
    with pytest.raises(StateDictMismatchError, match=r"wrong shape: decoder\.embed_tokens\.weight: checkpoint \(64, 34\) vs module \(64, 32\)"):
        mo.load_into(small, FIXTURES / "singleton", strict=False)


@needs_fixtures
def test_load_into_meta_module_in_one_process():
    with torch.device("meta"):
        model = TinyMetaseqLM()
    mo.load_into(model, FIXTURES / "mp2_dp2")
    assert_matches_reference(model.state_dict(), reference_weights())
    assert model.decoder.output_projection.weight is model.decoder.embed_tokens.weight
    assert model.decoder.version.device.type == "cpu"


@needs_fixtures
def test_flat_shard_of_one_rank_is_the_whole_flat_param():
    lc = mo.load_checkpoint(FIXTURES / "mp2_ddp", flat=True,
                            shard_metadata=raw_load(FIXTURES / "fsdp_dp3" / "checkpoint_2-model_part-0-shard0.pt")["shard_metadata"])
    md = lc.shard_metadata
    assert [pm["fsdp_path"] for pm in md["param_metadata"]] == ["", "decoder.layers.0", "decoder.layers.1"]
    assert all(v["padding"] == 0 for pm in md["param_metadata"] for v in pm["params"].values())
    assert lc.model.shard_metadata is md
    ref = reference_weights()
    names = md["param_metadata"][1]["params"]["flat_param_0"]["names"]
    full = torch.cat([ref["decoder.layers.0." + n].flatten() for n in names])
    assert torch.allclose(lc.model["decoder.layers.0.flat_param_0"], full, atol=1e-4)


def test_compressed_or_big_endian_zips_are_read_whole_not_in_place(tmp_path):
    import zipfile

    w = torch.arange(4096, dtype=torch.float32)
    torch.save({"w": w}, tmp_path / "plain.pt")
    with zipfile.ZipFile(tmp_path / "plain.pt") as src, \
            zipfile.ZipFile(tmp_path / "packed.pt", "w", compression=zipfile.ZIP_DEFLATED) as z:
        for info in src.infolist():
            z.writestr(info.filename, src.read(info.filename))
    assert torch.equal(torch.load(tmp_path / "packed.pt")["w"], w)  # a valid torch file
    assert mo.inspect(tmp_path / "packed.pt").files[0][0].format == "zip-packed"
    assert torch.equal(mo.load_state_dict(tmp_path / "packed.pt", verify=True)["w"], w)


class Opaque:
    """A class no allowlist knows."""

    def __init__(self):
        self.x = 1


def test_trust_pickle_reaches_every_header_read(tmp_path):
    path = tmp_path / "checkpoint_1.pt"
    torch.save({"model": {"decoder.fc1.weight": torch.ones(2, 2)}, "cfg": {"model": Opaque()}}, path)
    with pytest.raises(mo.UnsafeCheckpointError):
        mo.inspect(path)
    layout = mo.inspect(path, trust_pickle=True)
    assert layout.to_dict()["num_params"] == 4  # num_params reads the cfg again: same trust
    assert torch.equal(mo.load_state_dict(path, trust_pickle=True)["decoder.fc1.weight"], torch.ones(2, 2))


@needs_fixtures
def test_verify_compares_in_the_destination_dtype():
    model = TinyMetaseqLM().to(torch.bfloat16)
    report = mo.load_into(model, FIXTURES / "shard_only", verify=True)
    assert report.verified
    assert torch.equal(model.decoder.layers[1].fc1.weight, reference_weights()["decoder.layers.1.fc1.weight"].to(torch.bfloat16))


@needs_fixtures
def test_strict_false_leaves_what_the_checkpoint_lacks_on_meta_and_says_so():
    with torch.device("meta"):
        model = TinyMetaseqLM(layers=3)
    report = mo.load_into(model, FIXTURES / "fsdp_dp3", strict=False)
    assert "decoder.layers.2.fc1.weight" in report.unloaded
    assert model.decoder.layers[2].fc1.weight.device.type == "meta"
    assert model.decoder.layers[1].fc1.weight.device.type == "cpu"


@needs_fixtures
def test_own_shard_reads_only_its_own_file():
    """Replicated tensors included: each part's reader takes them from its own file."""
    from metaseq_oneload._reading import RangeReader
    from metaseq_oneload._execute import fill as _fill
    from metaseq_oneload._plan import plan_part

    layout = mo.inspect(FIXTURES / "mp2_ddp")
    for part in range(2):
        targets = plan_part(layout, 2, part)
        files = {e.path for t in targets.values() for c in t.copies for e in c.src.extents}
        assert files == {layout.files[part][0].path}
        with RangeReader() as r:
            for t in targets.values():
                _fill(t, torch.empty(t.numel, dtype=t.dtype), 0, r)
