"""`convert`, `consolidate` and `verify` on the real metaseq fixtures: every set through every
layout and back, structure as metaseq and fairscale write it, optimizer state, safetensors."""

from __future__ import annotations

import json
import os
import zipfile

import pytest
import torch

import metaseq_oneload as mo
from metaseq_oneload._convert import consolidate, convert, verify
from tests.conftest import (FIXTURES, SETS, assert_matches_reference, needs_fixtures, raw_load, reference_part,
                            reference_weights)

pytestmark = needs_fixtures

LAYOUTS = [(1, 1), (1, 3), (2, 2), (2, 1), (1, 4)]
TIED = "decoder.output_projection.weight"
# What a checkpoint's cfg says about its layout (the rest, e.g. save_dir, is the run's own).
LAYOUT_CFG = {
    "common": ("model_parallel_size",),
    "checkpoint": ("checkpoint_shard_count", "model_parallel_size", "checkpoint_suffix"),
    "distributed_training": ("distributed_world_size", "distributed_rank", "ddp_backend", "use_sharded_state"),
}


@pytest.fixture(scope="module")
def ref():
    return reference_weights()


def _source(name: str) -> str:
    return str(FIXTURES / name)


def _fairscale_full(paths) -> dict:
    """fairscale's own consolidation of one model part's flat shards."""
    from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP

    objs = [raw_load(p) for p in paths]
    return FSDP.consolidate_shard_weights([o["model"] for o in objs], [o["shard_metadata"] for o in objs])


def _equal(a, b, path="") -> None:
    """Deep equality of two checkpoint objects, tensors bit for bit."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), (path, list(a), list(b))
        for k in a:
            _equal(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _equal(x, y, f"{path}[{i}]")
    elif hasattr(a, "__dict__") and not isinstance(a, type):
        assert type(a) is type(b), path
        _equal(vars(a), vars(b), path)
    else:
        assert a == b, (path, a, b)


@pytest.mark.parametrize("name", SETS)
def test_every_layout_and_back(tmp_path, name, ref):
    src = mo.inspect(_source(name))
    for M, N in LAYOUTS:
        r = convert(_source(name), tmp_path / f"{M}x{N}" / "ck", model_parallel=M, shards=N, jobs=2)
        flat = N > 1
        layout = mo.inspect(r.files[0])
        assert (layout.model_parallel_size, layout.shards_per_part, layout.flat) == (M, N, flat)
        assert layout.warnings == () and layout.notes == (), layout.notes  # cfg tells the truth about the new files
        assert [f.path for row in layout.files for f in row] == list(r.files)
        for f in r.files:
            with zipfile.ZipFile(f) as z:
                assert z.testzip() is None  # CRCs patched after the in-place writes
        # Against the singleton (metaseq's own consolidation), any layout to any layout.
        v = verify(r.files[0], _source("singleton"), atol=1e-4, rtol=0)
        assert v.match, v.largest(3)
        # The engine loads it; the full model equals the reference.
        assert_matches_reference(mo.load_state_dict(r.files[0], verify=True), ref)
        # fairscale consolidates every part's flat shards back to that part's weights.
        if flat:
            for m in range(M):
                full = _fairscale_full(r.files[m * N:(m + 1) * N])
                expected = {k: v for k, v in reference_part(ref, m, M).items() if k != TIED}
                assert_matches_reference(full, expected)
        else:
            for m in range(M):
                part = raw_load(r.files[m])["model"]
                assert part[TIED].data_ptr() == part["decoder.embed_tokens.weight"].data_ptr()  # tied, one storage
                assert_matches_reference(part, reference_part(ref, m, M))
        # And back to the source's layout: bit-identical weights.
        back = convert(r.files[0], tmp_path / f"{M}x{N}" / "back", model_parallel=src.model_parallel_size,
                       shards=src.shards_per_part, flat=src.flat)
        v = verify(back.files[0], _source(name), atol=0, rtol=0)
        assert v.identical, v.largest(3)


def test_same_layout_is_the_source_bit_for_bit(tmp_path):
    for name, M, N in (("fsdp_dp3", 1, 3), ("mp2_dp2", 2, 2), ("mp2_ddp", 2, 1)):
        r = convert(_source(name), tmp_path / name / "ck", model_parallel=M, shards=N)
        src = mo.inspect(_source(name))
        for f, out in zip(src.all_files, r.files):
            a, b = raw_load(f.path), raw_load(out)
            save = b.pop("oneload_save")  # the one key a conversion adds: its output set's identity
            assert set(save) == {"save_id", "parts", "shards"} and (save["parts"], save["shards"]) == (M, N)
            if name == "mp2_ddp":
                # The pytorch_ddp run's cfg claims use_sharded_state=True (inspect warns); the
                # output tells the truth about its unsharded files.
                assert b["cfg"]["distributed_training"]["use_sharded_state"] is False
                b["cfg"]["distributed_training"]["use_sharded_state"] = True
                assert b["cfg"]["model"].use_sharded_state is False
                b["cfg"]["model"].use_sharded_state = True
            _equal(a, b)  # model, shard_metadata, optimizer state, cfg, meters: everything


def test_structure_is_what_metaseq_and_fairscale_write(tmp_path):
    # 1x3 -> 2x2 equals the layout a real model-parallel 2 x data-parallel 2 run wrote.
    r = convert(_source("fsdp_dp3"), tmp_path / "a" / "ck", model_parallel=2, shards=2)
    for m in range(2):
        for d in range(2):
            ours = raw_load(r.files[m * 2 + d])
            theirs = raw_load(FIXTURES / "mp2_dp2" / f"checkpoint_2-model_part-{m}-shard{d}.pt")
            assert [k for k in ours if k != "oneload_save"] == list(theirs)
            assert list(ours["model"]) == list(theirs["model"])
            assert {k: v.shape for k, v in ours["model"].items()} == {k: v.shape for k, v in theirs["model"].items()}
            _equal(ours["shard_metadata"], theirs["shard_metadata"])
            for section, keys in LAYOUT_CFG.items():
                for key in keys:
                    assert ours["cfg"][section][key] == theirs["cfg"][section][key], (section, key)
            for key in ("model_parallel_size", "use_sharded_state", "ddp_backend"):
                assert getattr(ours["cfg"]["model"], key) == getattr(theirs["cfg"]["model"], key)
            shapes = lambda o: {i: {k: getattr(v, "shape", v) for k, v in e.items()}  # noqa: E731
                                for i, e in o["last_optimizer_state"]["state"].items()}
            assert shapes(ours) == shapes(theirs)
            _equal(ours["last_optimizer_state"]["param_groups"], theirs["last_optimizer_state"]["param_groups"])
    # 1x3 -> 1x2 has the shard_metadata of metaseq's reshard_fsdp output.
    r = convert(_source("fsdp_dp3"), tmp_path / "b" / "ck", shards=2)
    for d in range(2):
        _equal(raw_load(r.files[d])["shard_metadata"],
               raw_load(FIXTURES / "shard_only" / f"checkpoint_2-shard{d}.pt")["shard_metadata"])
    # Unflattened sources get metaseq's FSDP wrapping: the metadata fairscale wrote in training.
    for name in ("singleton", "mp2_ddp"):
        r = convert(_source(name), tmp_path / name / "ck", shards=3, model_parallel=1)
        for d in range(3):
            ours = raw_load(r.files[d])
            theirs = raw_load(FIXTURES / "fsdp_dp3" / f"checkpoint_2-model_part-0-shard{d}.pt")
            _equal(ours["shard_metadata"], theirs["shard_metadata"])
            assert list(ours["model"]) == list(theirs["model"])
    # metaseq's file names.
    assert [os.path.basename(p) for p in convert(_source("mp2_ddp"), tmp_path / "n" / "x", shards=1).files] == [
        "x-model_part-0.pt", "x-model_part-1.pt"]
    assert [os.path.basename(p) for p in convert(_source("mp2_ddp"), tmp_path / "o" / "x", model_parallel=1).files] == [
        "x.pt"]
    assert [os.path.basename(p) for p in
            convert(_source("singleton"), tmp_path / "p" / "x", shards=1, flat=True).files] == [
        "x-model_part-0-shard0.pt"]


def test_optimizer_state_is_resharded_like_the_weights(tmp_path):
    # Across a model-parallel change the moved Adam state equals the state of a real run
    # trained at that size (same data, same init): the Megatron split is applied to it too.
    r = convert(_source("fsdp_dp3"), tmp_path / "a" / "ck", model_parallel=2, shards=2)
    assert r.optimizer == "carried"
    for m in range(2):
        for d in range(2):
            ours = raw_load(r.files[m * 2 + d])["last_optimizer_state"]["state"]
            theirs = raw_load(FIXTURES / "mp2_dp2" / f"checkpoint_2-model_part-{m}-shard{d}.pt")["last_optimizer_state"]["state"]
            for i in theirs:
                assert ours[i]["step"] == theirs[i]["step"]
                for k in ("exp_avg", "exp_avg_sq"):
                    assert (ours[i][k] - theirs[i][k]).abs().max() < 1e-7, (m, d, i, k)
    # ... and back: bit for bit, padding zeroed exactly as fairscale pads.
    back = convert(r.files[0], tmp_path / "b" / "ck", model_parallel=1, shards=3)
    for d in range(3):
        _equal(raw_load(back.files[d])["last_optimizer_state"],
               raw_load(FIXTURES / "fsdp_dp3" / f"checkpoint_2-model_part-0-shard{d}.pt")["last_optimizer_state"])
    # Unflattened (pytorch_ddp, per-parameter state) -> flat: matches the FSDP run's state.
    r = convert(_source("mp2_ddp"), tmp_path / "c" / "ck", model_parallel=1, shards=3)
    assert r.optimizer == "carried"
    for d in range(3):
        ours = raw_load(r.files[d])["last_optimizer_state"]["state"]
        theirs = raw_load(FIXTURES / "fsdp_dp3" / f"checkpoint_2-model_part-0-shard{d}.pt")["last_optimizer_state"]["state"]
        for i in theirs:
            for k in ("exp_avg", "exp_avg_sq"):
                assert (ours[i][k] - theirs[i][k]).abs().max() < 1e-7
    # Unflattened -> unflattened across model parallel sizes, and back, bit for bit.
    one = convert(_source("mp2_ddp"), tmp_path / "d" / "ck", model_parallel=1)
    two = convert(one.files[0], tmp_path / "e" / "ck", model_parallel=2)
    for m in range(2):
        _equal(raw_load(two.files[m])["last_optimizer_state"],
               raw_load(FIXTURES / "mp2_ddp" / f"checkpoint_2-model_part-{m}.pt")["last_optimizer_state"])
    # metaseq's reshard_fsdp kept the padding in shard_only's state (4674 per shard for 9346
    # elements); the real elements are still found.
    r = convert(_source("shard_only"), tmp_path / "f" / "ck", shards=3)
    for d in range(3):
        _equal(raw_load(r.files[d])["last_optimizer_state"]["state"],
               raw_load(FIXTURES / "fsdp_dp3" / f"checkpoint_2-model_part-0-shard{d}.pt")["last_optimizer_state"]["state"])


def test_optimizer_state_dropped_with_a_reason(tmp_path):
    r = convert(_source("fsdp_dp3"), tmp_path / "a" / "ck", model_parallel=1, shards=1)
    assert r.optimizer == "dropped" and not r.files[0].endswith("-shard0.pt")
    assert any("flat FSDP optimizer state cannot be mapped onto unflattened parameters" in n for n in r.notes)
    assert "last_optimizer_state" not in raw_load(r.files[0])
    r = convert(_source("fsdp_dp3"), tmp_path / "b" / "ck", shards=2, drop_optimizer=True)
    assert r.optimizer == "dropped" and "last_optimizer_state" not in raw_load(r.files[0])
    r = convert(_source("singleton"), tmp_path / "c" / "ck", shards=2)
    assert r.optimizer == "absent"
    # Kept when the flat layout is kept, even at one shard.
    r = convert(_source("fsdp_dp3"), tmp_path / "d" / "ck", shards=1, flat=True)
    assert r.optimizer == "carried"
    assert raw_load(r.files[0])["last_optimizer_state"]["state"][1]["exp_avg"].shape == (9346,)


def test_consolidate_like_metaseq(tmp_path):
    # qkv split as metaseq's consolidate_fsdp_shards writes it: the singleton fixture, bit for bit.
    r = consolidate(_source("fsdp_dp3"), tmp_path / "consolidated.pt", qkv="split")
    assert r.files == (str(tmp_path / "consolidated.pt"),)
    ours, theirs = raw_load(r.files[0])["model"], raw_load(FIXTURES / "singleton" / "checkpoint_2_consolidated.pt")["model"]
    assert set(ours) - set(theirs) == {TIED}  # the tied alias, sharing embed_tokens' storage
    for k, v in theirs.items():
        assert torch.equal(ours[k], v), k
    # Default: metaseq's fused qkv_proj, which metaseq itself loads.
    r = consolidate(_source("mp2_dp2"), tmp_path / "fused.pt")
    assert any(k.endswith("qkv_proj.weight") for k in raw_load(r.files[0])["model"])
    with pytest.raises(ValueError, match="expected a file name ending in .pt"):
        consolidate(_source("mp2_dp2"), tmp_path / "fused.bin")


def test_dtype_cast(tmp_path, ref):
    r = convert(_source("mp2_dp2"), tmp_path / "ck", model_parallel=1, shards=2, dtype="bf16")
    sd = mo.load_state_dict(r.files[0])
    assert {t.dtype for t in sd.values()} == {torch.bfloat16}
    assert raw_load(r.files[0])["last_optimizer_state"]["state"][0]["exp_avg"].dtype == torch.float32
    for k, v in ref.items():
        assert (sd[k].float() - v).abs().max() <= 2e-2 * max(1.0, float(v.abs().max())), k


def test_safetensors_round_trip(tmp_path, ref):
    from safetensors.torch import load_file

    r = convert(_source("fsdp_dp3"), tmp_path / "st" / "ck", model_parallel=2, shards=2, format="safetensors")
    assert r.optimizer == "dropped" and len(r.files) == len(r.sidecars) == 4
    from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP

    for m in range(2):
        weights, metas = [], []
        for d in range(2):
            path = str(tmp_path / "st" / f"ck-model_part-{m}-shard{d}.safetensors")
            side = json.loads(open(path[: -len(".safetensors")] + ".json").read())
            assert side["weights"] == os.path.basename(path) and side["model_part"] == m and side["shard"] == d
            assert side["cfg"]["common"]["model_parallel_size"] == 2
            assert side["cfg"]["distributed_training"]["distributed_world_size"] == 4
            assert side["cfg"]["model"]["arch"]  # the Namespace became a JSON object
            weights.append(load_file(path))
            metas.append(side["shard_metadata"])
        full = FSDP.consolidate_shard_weights(weights, metas)
        assert_matches_reference(full, {k: v for k, v in reference_part(ref, m, 2).items() if k != TIED})
    r = consolidate(_source("mp2_ddp"), tmp_path / "one.safetensors", format="safetensors")
    sd = load_file(r.files[0])
    side = json.loads(open(r.sidecars[0]).read())
    assert side["tied"] == {TIED: "decoder.embed_tokens.weight"}
    sd[TIED] = sd["decoder.embed_tokens.weight"]
    assert_matches_reference(sd, ref)


def test_refuses_to_overwrite(tmp_path):
    r = convert(_source("fsdp_dp3"), tmp_path / "ck", shards=2)
    before = [os.stat(p).st_mtime_ns for p in r.files]
    with pytest.raises(mo.OneloadError, match=r"2 destination file\(s\) exist .* Pass overwrite=True"):
        convert(_source("fsdp_dp3"), tmp_path / "ck", shards=2)
    assert [os.stat(p).st_mtime_ns for p in r.files] == before
    r = convert(_source("fsdp_dp3"), tmp_path / "ck", shards=2, overwrite=True)
    assert [os.stat(p).st_mtime_ns for p in r.files] != before


def test_overwrite_replaces_the_older_set(tmp_path):
    convert(_source("fsdp_dp3"), tmp_path / "ck", shards=4)
    with pytest.raises(FileExistsError, match="destination file"):
        convert(_source("fsdp_dp3"), tmp_path / "ck", shards=2)  # shard2, shard3 would mix in
    r = convert(_source("fsdp_dp3"), tmp_path / "ck", shards=2, overwrite=True)
    assert sorted(os.path.basename(p) for p in r.removed) == ["ck-model_part-0-shard2.pt", "ck-model_part-0-shard3.pt"]
    assert sorted(os.listdir(tmp_path)) == ["ck-model_part-0-shard0.pt", "ck-model_part-0-shard1.pt",
                                            "ck.oneload-index.json"]  # the new set's index replaced the old one's
    assert mo.inspect(tmp_path / "ck.pt").shards_per_part == 2


def test_never_writes_over_the_source(tmp_path):
    from tests.conftest import copy_set

    src = copy_set("fsdp_dp3", tmp_path)
    before = {p: os.stat(src / p).st_mtime_ns for p in os.listdir(src)}
    for kwargs in ({}, {"overwrite": True}):
        with pytest.raises(FileExistsError, match="the source checkpoint's own"):
            convert(src / "checkpoint_2-model_part-0-shard0.pt", src / "checkpoint_2", shards=2, **kwargs)
        with pytest.raises(FileExistsError, match="the source checkpoint's own"):
            convert(src, src, shards=2, **kwargs)  # a folder: the source's prefix inside it
    # A destination name that is a link to a source file is refused too, overwrite or not.
    os.symlink(src / "checkpoint_2-model_part-0-shard0.pt", tmp_path / "other-model_part-0-shard0.pt")
    with pytest.raises(FileExistsError, match="a conversion never writes over its source"):
        convert(src, tmp_path / "other", shards=2, overwrite=True)
    assert {p: os.stat(src / p).st_mtime_ns for p in os.listdir(src)} == before


def test_requests_that_cannot_be_met(tmp_path):
    with pytest.raises(ValueError, match="unflattened weights are not split into shards"):
        convert(_source("singleton"), tmp_path / "x", shards=2, flat=False)
    with pytest.raises(mo.CheckpointLayoutError, match="split over 3 model-parallel parts"):
        convert(_source("singleton"), tmp_path / "x", model_parallel=3)
    with pytest.raises(ValueError, match="format='onnx'"):
        convert(_source("singleton"), tmp_path / "x", format="onnx")
    with pytest.raises(mo.CheckpointLayoutError, match="split over 3 model-parallel parts"):
        convert(_source("singleton"), tmp_path / "new" / "x", model_parallel=3)
    assert os.listdir(tmp_path) == []  # nothing written, no folder made


def test_legacy_format_source(tmp_path, ref):
    """Pre-1.6 torch files cannot be range-read: weights come through torch.load, the
    optimizer state is dropped with the reason."""
    src = tmp_path / "legacy"
    src.mkdir()
    for d in range(3):
        obj = raw_load(FIXTURES / "fsdp_dp3" / f"checkpoint_2-model_part-0-shard{d}.pt")
        torch.save(obj, src / f"checkpoint_2-model_part-0-shard{d}.pt", _use_new_zipfile_serialization=False)
    r = convert(src, tmp_path / "out" / "ck", model_parallel=2, shards=2)
    assert r.optimizer == "dropped" and any("cannot be range-read" in n for n in r.notes)
    assert verify(r.files[0], _source("fsdp_dp3"), atol=0, rtol=0).identical
    assert_matches_reference(mo.load_state_dict(r.files[0]), ref)


def test_wrapping_of_another_model(tmp_path):
    """An unflattened source follows the FSDP wrapping of a given flat shard."""
    bare = tmp_path / "plain.pt"  # a bare state dict: no cfg, no tie recorded
    torch.save({k: v for k, v in reference_weights().items() if k != TIED}, bare)
    shard = FIXTURES / "fsdp_dp3" / "checkpoint_2-model_part-0-shard0.pt"
    r = convert(bare, tmp_path / "a" / "ck", shards=2, wrapping=shard)
    for d in range(2):
        _equal(raw_load(r.files[d])["shard_metadata"],
               raw_load(FIXTURES / "shard_only" / f"checkpoint_2-shard{d}.pt")["shard_metadata"])
    assert_matches_reference(mo.load_state_dict(r.files[0]), reference_weights())
    with pytest.raises(mo.StateDictMismatchError, match=r"decoder.embed_tokens.weight: checkpoint \(64, 34\) vs target \(32, 34\)"):
        convert(bare, tmp_path / "b" / "ck", shards=2, wrapping=FIXTURES / "mp2_dp2" / "checkpoint_2-model_part-0-shard0.pt")
    with pytest.raises(mo.OneloadError, match="holds no shard_metadata"):
        convert(bare, tmp_path / "c" / "ck", shards=2, wrapping=FIXTURES / "singleton" / "checkpoint_2_consolidated.pt")


def test_legacy_sources_are_read_once(tmp_path, monkeypatch):
    """Files that cannot be range-read are loaded whole: once for the run (one job, one
    reader), not once per output file."""
    import collections

    src = tmp_path / "legacy"
    src.mkdir()
    for d in range(3):
        obj = raw_load(FIXTURES / "fsdp_dp3" / f"checkpoint_2-model_part-0-shard{d}.pt")
        torch.save(obj, src / f"checkpoint_2-model_part-0-shard{d}.pt", _use_new_zipfile_serialization=False)
    mo.inspect(src)  # headers (metadata) are cached and not counted
    loads = collections.Counter()
    real = torch.load

    def counting(f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)) and str(f).startswith(str(src)) and kwargs.get("map_location") != "meta":
            loads[os.path.basename(str(f))] += 1
        return real(f, *args, **kwargs)

    monkeypatch.setattr(torch, "load", counting)
    r = convert(src, tmp_path / "out" / "ck", model_parallel=2, shards=2, jobs=4)
    assert r.jobs == 1 and any("read whole, once" in n for n in r.notes)
    # Each file once by the reader, the one that supplies cfg and meters once more.
    assert sum(loads.values()) <= 4 and max(loads.values()) <= 2, loads
    assert verify(r.files[0], _source("fsdp_dp3"), atol=0, rtol=0).identical


def _with_ema(tmp_path, name: str):
    """A copy of a fixture set as metaseq writes it with --store-ema --ema-fp32: the EMA
    copy (here: the weights) and its fp32 params in extra_state, laid out like `model`."""
    from tests.conftest import copy_set

    src = copy_set(name, tmp_path)
    for f in sorted(src.glob("checkpoint_2*.pt")):
        obj = raw_load(f)
        obj["extra_state"]["ema"] = {k: v.clone() for k, v in obj["model"].items()}
        obj["extra_state"]["ema_fp32_params"] = {k: v.float().clone() for k, v in obj["model"].items()}
        torch.save(obj, f)
    return src


def test_layout_specific_extra_state(tmp_path):
    """One rule with install(): extra_state that belongs to the saved layout (the RNG tracker
    state of each model-parallel rank; the EMA copy, laid out like the saved weights) is
    kept where the layout is, dropped with a note where it changes."""
    rng = "rng_tracker_states"
    parts = [raw_load(FIXTURES / "mp2_dp2" / f"checkpoint_2-model_part-{m}-shard0.pt")["extra_state"][rng]
             for m in range(2)]
    r = convert(_source("mp2_dp2"), tmp_path / "a" / "ck", model_parallel=1, shards=2)
    assert all(rng not in raw_load(f)["extra_state"] for f in r.files)
    assert any(f"extra_state['{rng}'] dropped" in n for n in r.notes)
    r = convert(_source("mp2_dp2"), tmp_path / "b" / "ck", model_parallel=2, shards=3)
    for m in range(2):
        for d in range(3):
            _equal(raw_load(r.files[m * 3 + d])["extra_state"][rng], parts[m])  # its own part's, not part 0's
    assert not any(rng in n for n in r.notes)
    # EMA: kept, file for file, where the weights keep their layout; else dropped.
    src = _with_ema(tmp_path / "ema", "fsdp_dp3")
    same = convert(src, tmp_path / "c" / "ck", shards=3)
    for d in range(3):
        saved = raw_load(src / f"checkpoint_2-model_part-0-shard{d}.pt")["extra_state"]
        _equal(raw_load(same.files[d])["extra_state"], saved)
    assert not any("ema" in n for n in same.notes)
    other = convert(src, tmp_path / "d" / "ck", shards=2)
    for f in other.files:
        assert not {"ema", "ema_fp32_params"} & set(raw_load(f)["extra_state"])
    assert any("extra_state ema, ema_fp32_params dropped" in n for n in other.notes)
