"""`convert(path, dst, format="dcp")`: torch.distributed.checkpoint folders that torch's own
loader reads, from every set of the corpus, written as torch's writer writes them, created
beside the user's files as every output is (exclusive, never through a link, all or nothing).

Oracles: the corpus's independent reading of each set (tests/corpus.py, no package code),
read back with torch's ``dcp.load`` (no package code); torch's own ``FileSystemWriter`` on the
same weights, in the same run, for the folder's metadata.
"""

from __future__ import annotations

import os
import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

import metaseq_oneload as mo
from metaseq_oneload.cli import main
from tests.conftest import FIXTURES, assert_matches_reference, needs_fixtures, reference_weights
from tests.corpus import assert_same, canonical, entries, full_weights, fused

pytestmark = [needs_fixtures, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

ENTRIES = [e for e in entries() if not e.refused]
TIED = "decoder.output_projection.weight"


def _metadata(folder) -> object:
    with open(os.path.join(folder, ".metadata"), "rb") as f:
        return pickle.load(f)  # torch's own loader unpickles it the same way


def _dcp_load(folder, like: dict) -> dict:
    """What torch's loader reads into a state dict shaped like ``like`` (zeros first)."""
    sd = {k: torch.zeros_like(v) for k, v in like.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, checkpoint_id=str(folder))
    return sd


@pytest.mark.parametrize("e", ENTRIES, ids=[e.id for e in ENTRIES])
def test_every_corpus_set_loads_with_torchs_loader(tmp_path, e):
    """Each set as 1, 2 or 3 files; torch's loader reads exactly the independent reading."""
    shards = 1 + ENTRIES.index(e) % 3
    r = mo.convert(e.path, tmp_path / "dcp", format="dcp", shards=shards, progress=False)
    assert sorted(os.listdir(tmp_path / "dcp")) == [".metadata"] + [f"__{i}_0.distcp" for i in range(shards)]
    assert r.format == "dcp" and r.shards == shards and r.files[-1].endswith(".metadata")
    md = _metadata(tmp_path / "dcp")
    like = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in md.state_dict_metadata.items()}
    assert_same(canonical(_dcp_load(tmp_path / "dcp", like)), full_weights(e), what=e.id)


def test_the_folder_is_what_torchs_writer_writes(tmp_path):
    """Same tensors, sizes, chunks, planner data and storage keys as ``dcp.save`` of the
    same weights in this run, and every item a torch.save archive torch.load reads alone."""
    from torch.distributed.checkpoint.utils import _create_file_view

    ref = reference_weights()
    mo.convert(FIXTURES / "singleton", tmp_path / "ours", format="dcp", progress=False)
    theirs = {k: v.clone() for k, v in ref.items()}  # torch writes a tied name twice; so do we, once in bytes
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(theirs, checkpoint_id=str(tmp_path / "theirs"))
    a, b = _metadata(tmp_path / "ours"), _metadata(tmp_path / "theirs")
    assert a.state_dict_metadata == b.state_dict_metadata
    assert a.planner_data == b.planner_data
    assert set(a.storage_data) == set(b.storage_data)
    assert a.version == b.version and a.storage_meta.checkpoint_id == str(tmp_path / "ours")
    with open(tmp_path / "ours" / "__0_0.distcp", "rb") as f:
        for index, info in a.storage_data.items():
            assert info.offset % 64 == 0 and info.transform_descriptors is None
            t = torch.load(_create_file_view(f, info.offset, info.length), weights_only=True)
            assert torch.equal(t, ref[index.fqn]), index.fqn
    # The tied name is its own entry, stored once: the bytes of the name it is tied to.
    emb = next(v for k, v in a.storage_data.items() if k.fqn == "decoder.embed_tokens.weight")
    assert next(v for k, v in a.storage_data.items() if k.fqn == TIED) == emb


def test_a_plain_model_loads_it_with_its_tie(tmp_path):
    from tests.tiny_metaseq import TinyMetaseqLM

    mo.convert(FIXTURES / "mp2_dp2", tmp_path / "dcp", format="dcp", progress=False)
    model = TinyMetaseqLM()
    sd = model.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, checkpoint_id=str(tmp_path / "dcp"))
    model.load_state_dict(sd)
    assert_matches_reference(model.state_dict(), reference_weights())
    assert model.decoder.output_projection.weight is model.decoder.embed_tokens.weight


def test_chunks_split_as_fsdp2_splits_them(tmp_path):
    """torch.chunk's split along dim 0 (FSDP2's Shard(0)): 64 rows on 3 files are 22, 22,
    20; 18 positions on 4 are 5, 5, 5, 3; a 1-row buffer is in file 0 only."""
    mo.convert(FIXTURES / "singleton", tmp_path / "s3", format="dcp", shards=3, progress=False)
    mo.convert(FIXTURES / "singleton", tmp_path / "s4", format="dcp", shards=4, progress=False)
    md3, md4 = _metadata(tmp_path / "s3"), _metadata(tmp_path / "s4")
    rows = lambda md, n: [(c.offsets[0], c.sizes[0]) for c in md.state_dict_metadata[n].chunks]  # noqa: E731
    assert rows(md3, "decoder.embed_tokens.weight") == [(0, 22), (22, 22), (44, 20)]
    assert rows(md4, "decoder.embed_positions.weight") == [(0, 5), (5, 5), (10, 5), (15, 3)]
    assert rows(md4, "decoder.version") == [(0, 1)]
    files = {(k.fqn, k.index): v.relative_path for k, v in md4.storage_data.items()}
    assert files[("decoder.embed_positions.weight", 3)] == "__3_0.distcp"
    assert files[("decoder.version", 0)] == "__0_0.distcp"


def test_dtype_and_split_qkv(tmp_path):
    r = mo.convert(FIXTURES / "singleton", tmp_path / "d", format="dcp", dtype="bf16", qkv="split", progress=False)
    ref = {k: v.to(torch.bfloat16) for k, v in reference_weights().items()}
    split = {}
    for k, v in ref.items():
        if ".qkv_proj." in k:
            for name, piece in zip(("k_proj", "v_proj", "q_proj"), v.chunk(3)):
                split[k.replace("qkv_proj", name)] = piece
        else:
            split[k] = v
    assert_same(_dcp_load(tmp_path / "d", split), split, what="bf16 split")
    assert r.bytes_written == sum(v.nbytes for k, v in split.items() if k != TIED)


def test_hugging_face_and_bare_state_dict_sources(tmp_path):
    from tests.hf_tiny import save_tiny_t5

    saved = save_tiny_t5(tmp_path / "t5")
    mo.convert(tmp_path / "t5", tmp_path / "t5_dcp", format="dcp", shards=2, progress=False)
    md = _metadata(tmp_path / "t5_dcp")
    got = _dcp_load(tmp_path / "t5_dcp", {k: v for k, v in saved.items() if k in md.state_dict_metadata})
    assert len(got) >= len(saved) - 3  # T5 ties its embeddings: shared/encoder/decoder names
    assert_same(got, {k: saved[k] for k in got}, what="t5")

    bare = {k: v.clone() for k, v in reference_weights().items() if k != TIED}
    os.makedirs(tmp_path / "bare")
    torch.save(bare, tmp_path / "bare" / "model.pt")
    r = mo.convert(tmp_path / "bare" / "model.pt", tmp_path / "bare_dcp", format="dcp", progress=False)
    assert r.optimizer == "absent"
    assert_same(_dcp_load(tmp_path / "bare_dcp", bare), bare, what="bare")


@pytest.mark.parametrize("kwargs, match", [
    (dict(model_parallel=2), r"model_parallel=2 with format='dcp'"),
    (dict(flat=True), r"flat=True .* with format='dcp'"),
    (dict(wrapping={"param_metadata": []}), r"wrapping= .* applies to flat outputs"),
])
def test_layout_options_without_meaning_are_refused(tmp_path, kwargs, match):
    with pytest.raises(mo.OptionError, match=match):
        mo.convert(FIXTURES / "singleton", tmp_path / "d", format="dcp", **kwargs)
    assert not (tmp_path / "d").exists()


def test_destinations_that_are_not_a_new_folder(tmp_path):
    (tmp_path / "file").write_bytes(b"mine")
    with pytest.raises(mo.OutputExistsError, match="exists and is not a folder"):
        mo.convert(FIXTURES / "singleton", tmp_path / "file", format="dcp")
    assert (tmp_path / "file").read_bytes() == b"mine"
    with pytest.raises(mo.OptionError, match="is a folder"):
        mo.convert(FIXTURES / "singleton", tmp_path / "out.pt", format="dcp")
    with pytest.raises(mo.OptionError, match="s3://bucket/ckpt_dcp: outputs are written to a local"):
        mo.convert(FIXTURES / "singleton", "s3://bucket/ckpt_dcp", format="dcp")
    src = tmp_path / "src"
    src.mkdir()
    os.symlink(FIXTURES / "singleton" / "checkpoint_2_consolidated.pt", src / "checkpoint_2_consolidated.pt")
    with pytest.raises(mo.OutputExistsError, match="the folder of the source checkpoint"):
        mo.convert(src / "checkpoint_2_consolidated.pt", src, format="dcp")
    assert sorted(os.listdir(src)) == ["checkpoint_2_consolidated.pt"]


def test_existing_outputs_need_overwrite_which_removes_an_older_save(tmp_path):
    dst = tmp_path / "d"
    mo.convert(FIXTURES / "singleton", dst, format="dcp", shards=3, progress=False)
    before = {n: (dst / n).read_bytes() for n in os.listdir(dst)}
    with pytest.raises(mo.OutputExistsError, match=r"destination file\(s\) exist .*overwrite=True"):
        mo.convert(FIXTURES / "singleton", dst, format="dcp", shards=1)
    assert {n: (dst / n).read_bytes() for n in os.listdir(dst)} == before
    r = mo.convert(FIXTURES / "fsdp_dp3", dst, format="dcp", shards=1, overwrite=True, progress=False)
    assert sorted(os.listdir(dst)) == [".metadata", "__0_0.distcp"]
    assert sorted(os.path.basename(p) for p in r.removed) == ["__1_0.distcp", "__2_0.distcp"]
    want = fused(full_weights(next(e for e in ENTRIES if e.id == "metaseq/fsdp_dp3")))
    assert_same(_dcp_load(dst, want), want, what="overwritten")


@pytest.mark.parametrize("name", [".metadata", "__0_0.distcp"])
def test_a_planted_link_is_never_written_through(tmp_path, name):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    dst = tmp_path / "d"
    dst.mkdir()
    os.symlink(victim, dst / name)
    with pytest.raises(mo.OutputExistsError, match="exist"):
        mo.convert(FIXTURES / "singleton", dst, format="dcp")
    mo.convert(FIXTURES / "singleton", dst, format="dcp", overwrite=True, progress=False)
    assert victim.read_bytes() == b"precious"
    assert not os.path.islink(dst / name) and os.path.isfile(dst / name)
    assert sorted(os.listdir(dst)) == [".metadata", "__0_0.distcp"]
    ref = reference_weights()
    assert_same(_dcp_load(dst, ref), ref, what="after the link")


def test_a_failure_midway_leaves_nothing(tmp_path):
    """A writer that fails after its first chunk (here: the progress callback) leaves no
    file at any final name, no temporary file, and not the folder it created."""
    def boom(done, total):
        raise RuntimeError("stop here")

    with pytest.raises(RuntimeError, match="stop here"):
        mo.convert(FIXTURES / "fsdp_dp3", tmp_path / "d", format="dcp", shards=2, progress=boom)
    assert not (tmp_path / "d").exists()
    (tmp_path / "e").mkdir()
    with pytest.raises(RuntimeError, match="stop here"):
        mo.convert(FIXTURES / "fsdp_dp3", tmp_path / "e", format="dcp", progress=boom)
    assert os.listdir(tmp_path / "e") == []


def test_cli(tmp_path, capsys):
    assert main(["convert", str(FIXTURES / "mp2_dp2"), str(tmp_path / "d"), "--format", "dcp", "--shards", "2"]) == 0
    out = capsys.readouterr().out
    for line in (f"target     {tmp_path / 'd'}  (1x2 unflattened, dcp)", "optimizer  dropped", "__1_0.distcp",
                 ".metadata", "optimizer state dropped: the dcp output holds the model's weights; use --format torch"):
        assert line in out, out
    assert main(["convert", str(FIXTURES / "mp2_dp2"), str(tmp_path / "e"), "--format", "dcp", "-m", "2"]) == 2
    assert "--model-parallel" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["mp2_dp2", "fsdp_dp3", "singleton"])
def test_metaseq_to_dcp_and_back_verifies_bit_identical(tmp_path, name):
    mo.convert(FIXTURES / name, tmp_path / "dcp", format="dcp", shards=2, progress=False)
    assert mo.verify(FIXTURES / name, tmp_path / "dcp", atol=0, rtol=0).match
    mo.consolidate(tmp_path / "dcp", tmp_path / "back.pt", progress=False)
    report = mo.verify(FIXTURES / name, tmp_path / "back.pt", atol=0, rtol=0)
    assert report.match and all(d.identical for d in report.diffs), report
    back = mo.convert(tmp_path / "dcp", tmp_path / "mp2" / "ck", model_parallel=2, shards=2, progress=False)
    assert mo.verify(FIXTURES / name, back.dst + "-model_part-0-shard0.pt", atol=0, rtol=0).match


@pytest.mark.parametrize("name", ["fsdp2_w3", "fsdp1_sharded", "fsdp2_optim"])
def test_dcp_to_dcp_equals_what_torch_reads_from_the_source(tmp_path, name):
    """A folder a real writer made (tests/fixtures/dcp), rewritten as 2 files: torch's
    loader reads from ours exactly what it reads from the source's model entries."""
    src = FIXTURES.parent / "dcp" / name
    md = _metadata(src)
    r = mo.convert(src, tmp_path / "d", format="dcp", shards=2, progress=False)
    ours = _metadata(tmp_path / "d")
    prefix = next((p for p in ("model.", "") if any(k.startswith(p + "decoder.") for k in md.state_dict_metadata)))
    like = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in md.state_dict_metadata.items()
            if k.startswith(prefix + "decoder.") and hasattr(m, "size")}
    theirs = _dcp_load(src, like)
    mine = _dcp_load(tmp_path / "d", {k[len(prefix):]: v for k, v in like.items()})
    assert set(mine) == set(ours.state_dict_metadata)
    assert_same(mine, {k[len(prefix):]: v for k, v in theirs.items()}, what=name)
    assert r.optimizer == ("dropped" if name == "fsdp2_optim" else "absent")
    assert any("optim.state.decoder.embed_tokens.weight.exp_avg" in n for n in r.notes) == (name == "fsdp2_optim")


def test_a_cut_overwrite_leaves_no_metadata_of_the_older_save(tmp_path):
    """torch's loader reads no commit journal: when an overwrite's renames stop midway
    (here: a folder sits at the second file's name), the older save's .metadata must not be
    left describing offsets of files that were replaced."""
    dst = tmp_path / "d"
    mo.convert(FIXTURES / "singleton", dst, format="dcp", dtype="bf16", progress=False)
    (dst / "__1_0.distcp").mkdir()
    (dst / "__1_0.distcp" / "keep").write_bytes(b"x")
    with pytest.raises(mo.ConversionError, match="files of two different sets"):
        mo.convert(FIXTURES / "singleton", dst, format="dcp", shards=2, overwrite=True, progress=False)
    assert not (dst / ".metadata").exists()
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException, match=r"\.metadata"):  # nothing loads: no wrong load
        _dcp_load(dst, reference_weights())


def test_overwrite_removes_only_the_older_saves_files_and_never_a_link(tmp_path):
    dst = tmp_path / "d"
    mo.convert(FIXTURES / "singleton", dst, format="dcp", shards=3, progress=False)
    (dst / "important.distcp").write_bytes(b"the user's")
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    os.symlink(victim, dst / "__7_0.distcp")
    with pytest.raises(mo.OutputExistsError, match=r"__7_0\.distcp is a link, .*it is left alone"):
        mo.convert(FIXTURES / "fsdp_dp3", dst, format="dcp", shards=1, overwrite=True, progress=False)
    assert os.path.islink(dst / "__7_0.distcp") and victim.read_bytes() == b"precious"
    assert sorted(os.listdir(dst)) == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__7_0.distcp",
                                       "important.distcp"]
    os.unlink(dst / "__7_0.distcp")
    r = mo.convert(FIXTURES / "fsdp_dp3", dst, format="dcp", shards=1, overwrite=True, progress=False)
    assert sorted(os.path.basename(p) for p in r.removed) == ["__1_0.distcp", "__2_0.distcp"]
    assert sorted(os.listdir(dst)) == [".metadata", "__0_0.distcp", "important.distcp"]
    assert (dst / "important.distcp").read_bytes() == b"the user's"
