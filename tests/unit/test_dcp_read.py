"""torch.distributed.checkpoint folders read through the engine (issue 23, reader): every set of
``tests/fixtures/dcp`` (written by torch's own writers) loads equal to what torch's own
readers give in the same run, and the ``.metadata`` is read as data: a crafted one runs
nothing, and one whose chunks or items do not hold together is refused, naming the file and
the tensor. Attacks are made from real ``dcp.save`` output, rewritten with torch's own
(trusted, here) pickle of its metadata classes."""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

import metaseq_oneload as mo
from metaseq_oneload import CheckpointLayoutError, UnsafeCheckpointError
from metaseq_oneload._dcp_meta import read_metadata
from tests.conftest import REPO, reference_weights

DCP = REPO / "tests" / "fixtures" / "dcp"
SETS = ("plain_nopg", "fsdp1_sharded", "fsdp2_w2", "fsdp2_w3", "fsdp2_dim1", "fsdp2_optim")
pytestmark = pytest.mark.skipif(not (DCP / "fsdp2_w2" / ".metadata").is_file(), reason="DCP corpus not found")


def _torch_reads(folder: Path, tmp_path: Path) -> dict:
    """The model's state dict as torch's own converter gives it (unwrapped from 'model')."""
    out = tmp_path / f"{folder.name}.torch.pt"
    dcp_to_torch_save(str(folder), str(out))
    sd = torch.load(out, weights_only=False)
    return sd["model"] if "model" in sd and isinstance(sd["model"], dict) else sd


def _same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        assert torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("name", SETS)
def test_every_set_loads_as_torch_reads_it(name, tmp_path):
    folder = DCP / name
    want = _torch_reads(folder, tmp_path)
    _same(mo.load_state_dict(folder, no_dist=True), want)
    if name != "fsdp2_optim":  # one Adam step after the reference
        _same(want, reference_weights())
    _same(mo.load_state_dict(folder, no_dist=True, verify=True), want)  # the independent (torch.load) path


def test_any_file_of_the_folder_names_it():
    a = mo.inspect(DCP / "fsdp2_w3" / "__2_0.distcp")
    b = mo.inspect(DCP / "fsdp2_w3" / ".metadata")
    assert a.fingerprint() == b.fingerprint() == mo.inspect(DCP / "fsdp2_w3").fingerprint()


def test_column_chunks_are_one_run_per_row():
    layout = mo.inspect(DCP / "fsdp2_dim1")
    t = layout.parts[0].tensors["decoder.layers.0.fc1.weight"]  # [64, 34], Shard(1): two [64, 17] blocks
    assert t.shape == (64, 34) and len(t.extents) == 128
    assert [e.numel for e in t.extents] == [17] * 128
    assert len({e.path for e in t.extents}) == 2


def test_inspect_says_what_the_folder_is(capsys):
    layout = mo.inspect(DCP / "fsdp1_sharded")
    assert layout.flavor == "dcp" and layout.kind == "singleton" and layout.dtypes == ("float32",)
    assert any("written by 2 rank(s)" in n for n in layout.notes)
    assert any("under 'model'" in n for n in layout.notes)
    optim = mo.inspect(DCP / "fsdp2_optim")
    assert any("beside the model's state dict, not read: optim.state." in n for n in optim.notes), optim.notes
    assert any("non-tensor value(s), not read: optim.param_groups" in n for n in optim.notes), optim.notes
    from metaseq_oneload.cli import main

    assert main(["inspect", str(DCP / "fsdp2_w3")]) == 0
    out = capsys.readouterr().out
    assert "dcp" in out and "written by 3 rank(s)" in out


def test_verify_and_convert_against_the_metaseq_corpus(tmp_path):
    rep = mo.verify(DCP / "fsdp2_w2", REPO / "tests" / "fixtures" / "metaseq" / "singleton")
    assert rep.match and rep.identical
    out = tmp_path / "out.pt"
    mo.convert(DCP / "fsdp2_w3", out)
    assert mo.verify(out, DCP / "fsdp2_w3").identical
    _same(torch.load(out, weights_only=True), reference_weights())


def test_a_compressed_folder_is_refused_by_name():
    with pytest.raises(CheckpointLayoutError, match=r"written with the stream\.zstd/1 extension, which metaseq-oneload "
                                                    r"does not decode; load it with torch\.distributed\.checkpoint"):
        mo.load_state_dict(DCP / "compressed", no_dist=True)


def test_the_hugging_face_writer_folder_is_a_hugging_face_folder():
    ref = reference_weights()
    ref.pop("decoder.output_projection.weight")  # safetensors refuses shared tensors: the writer left it out
    _same(mo.load_state_dict(DCP / "hf_writer", no_dist=True), ref)


def test_the_hugging_face_writers_distributed_save_reads_as_torch_reads_it():
    """HuggingFaceStorageWriter(save_distributed=True): chunks in per-rank safetensors files, no
    .metadata; compared with torch's HuggingFaceStorageReader in the same run."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    folder = DCP / "hf_writer_w2"
    got = mo.load_state_dict(folder, no_dist=True)
    want = {k: torch.empty_like(v) for k, v in got.items()}
    dcp.load(want, storage_reader=HuggingFaceStorageReader(str(folder)), no_dist=True)
    _same(got, want)
    ref = reference_weights()
    ref.pop("decoder.output_projection.weight")
    _same(got, ref)
    layout = mo.inspect(folder / "shard-00002-model-00001-of-00001.safetensors")
    assert layout.flavor == "dcp" and any("Hugging Face storage writer" in n for n in layout.notes)
    assert len(layout.parts[0].tensors["decoder.embed_tokens.weight"].extents) == 2  # a row block per rank


# --------------------------------------------------------------------------- attacks on .metadata
def _copy(tmp_path: Path, name: str = "fsdp2_w2") -> Path:
    out = tmp_path / name
    shutil.copytree(DCP / name, out)
    return out


def _rewrite(folder: Path, change) -> None:
    """Load the folder's metadata with torch's pickle (we wrote it), ``change`` it, dump it."""
    path = folder / ".metadata"
    md = pickle.loads(path.read_bytes())
    change(md)
    path.write_bytes(pickle.dumps(md))


def _rekey(md, fqn: str, i: int, offsets: tuple) -> None:
    """Move chunk ``i`` of ``fqn`` to ``offsets``, its storage entry with it."""
    tm = md.state_dict_metadata[fqn]
    old = tm.chunks[i]
    tm.chunks[i] = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=old.sizes)
    info = md.storage_data.pop(MetadataIndex(fqn, old.offsets))
    md.storage_data[MetadataIndex(fqn, offsets)] = info


class _System:
    def __init__(self, cmd):
        self.cmd = cmd

    def __reduce__(self):
        return (os.system, (self.cmd,))


def test_a_metadata_that_runs_code_is_refused_and_runs_nothing(tmp_path):
    folder = _copy(tmp_path)
    marker = tmp_path / "ran"
    _rewrite(folder, lambda md: md.state_dict_metadata.__setitem__("x", _System(f"touch {marker}")))
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata: refused to unpickle the DCP metadata: it names "
                                                    r"(posix|os)\.system, which is not one of DCP's metadata types"):
        mo.load_state_dict(folder, no_dist=True)
    assert not marker.exists()
    # the attack is real: torch's own reader runs it (in a child, which is all it touches)
    code = ("from torch.distributed.checkpoint import FileSystemReader as R; "
            f"R({str(folder)!r}).read_metadata()")
    subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert marker.exists()


def test_a_class_outside_the_allowlist_is_refused_by_name(tmp_path):
    import argparse

    folder = _copy(tmp_path)
    _rewrite(folder, lambda md: setattr(md, "planner_data", argparse.Namespace(a=1)))
    with pytest.raises(UnsafeCheckpointError, match=r"it names argparse\.Namespace, which is not one of DCP's"):
        mo.inspect(folder)


def test_other_opcodes_that_construct_are_refused(tmp_path):
    folder = _copy(tmp_path)
    data = b"\x80\x02(X\x04\x00\x00\x00trueios\nsystem\n."  # PROTO 2, MARK, 'true', INST os.system, STOP
    (folder / ".metadata").write_bytes(data)
    with pytest.raises(UnsafeCheckpointError, match=r"INST opcode"):
        read_metadata(str(folder / ".metadata"))


@pytest.mark.parametrize("cut", [0, 1, 100, -1])
def test_a_truncated_metadata_is_named(tmp_path, cut):
    folder = _copy(tmp_path)
    data = (folder / ".metadata").read_bytes()
    (folder / ".metadata").write_bytes(data[:cut] if cut >= 0 else data[:len(data) // 2])
    with pytest.raises(CheckpointLayoutError, match=r"\.metadata: (the file is empty|not a readable "
                                                    r"torch\.distributed\.checkpoint metadata file: it ends)"):
        mo.inspect(folder)


W = "decoder.layers.0.fc1.weight"  # [64, 34] in two row blocks of 32: (0, 0) and (32, 0)


@pytest.mark.parametrize("change,match", [
    (lambda md: _rekey(md, W, 1, (31, 0)), r"its chunks do not tile its size \[64, 34\]: two chunks overlap at element 1054"),
    (lambda md: _rekey(md, W, 1, (33, 0)), r"reaches outside the tensor's size \[64, 34\]"),
    (lambda md: md.state_dict_metadata[W].chunks.pop(0),
     r"its chunks do not tile its size \[64, 34\]: no chunk holds elements 0\.\.1088"),
    (lambda md: md.state_dict_metadata[W].chunks.pop(1), r"its chunks hold 1088 of its 2176 elements"),
    (lambda md: md.storage_data.pop(MetadataIndex(W, (32, 0))), r"lists a chunk at offsets \[32, 0\] but no item"),
])
def test_chunks_that_do_not_tile_the_tensor_are_refused(tmp_path, change, match):
    folder = _copy(tmp_path)
    _rewrite(folder, change)
    with pytest.raises(CheckpointLayoutError, match=rf"\.metadata: tensor {W}: .*" + match):
        mo.load_state_dict(folder, no_dist=True)


def _item(md, fqn=W, offsets=(32, 0)):
    return md.storage_data[MetadataIndex(fqn, offsets)]


@pytest.mark.parametrize("path", ["../outside.distcp", "/etc/passwd", "sub/__0_0.distcp", ".."])
def test_an_item_outside_the_folder_is_refused(tmp_path, path):
    folder = _copy(tmp_path)
    shutil.copy(folder / "__1_0.distcp", tmp_path / "outside.distcp")
    _rewrite(folder, lambda md: setattr(_item(md), "relative_path", path))
    with pytest.raises(CheckpointLayoutError, match=rf"tensor {W}: the \.metadata places it in '{path}', which is "
                                                    "not a file name inside the checkpoint's folder"):
        mo.inspect(folder)


def test_a_link_out_of_the_folder_is_refused(tmp_path):
    folder = _copy(tmp_path)
    shutil.move(folder / "__1_0.distcp", tmp_path / "elsewhere.distcp")
    os.symlink(tmp_path / "elsewhere.distcp", folder / "__1_0.distcp")
    with pytest.raises(CheckpointLayoutError, match=r"__1_0\.distcp is a link out of the checkpoint's folder"):
        mo.inspect(folder)


def test_an_item_past_the_end_of_its_file_is_refused(tmp_path):
    folder = _copy(tmp_path)
    size = (folder / "__1_0.distcp").stat().st_size
    _rewrite(folder, lambda md: setattr(_item(md), "offset", size - 100))
    with pytest.raises(CheckpointLayoutError, match=rf"__1_0\.distcp \(the item of {W} at bytes {size - 100}\.\..*"
                                                    r"places it past the end of the file"):
        mo.inspect(folder)


def test_an_item_at_the_wrong_bytes_is_refused(tmp_path):
    folder = _copy(tmp_path)
    _rewrite(folder, lambda md: setattr(_item(md), "offset", _item(md).offset + 1))
    with pytest.raises(CheckpointLayoutError, match=rf"the item of {W} .*not a torch\.save archive"):
        mo.inspect(folder)


def test_an_item_of_another_tensor_is_refused(tmp_path):
    folder = _copy(tmp_path)
    other = "decoder.layers.0.fc2.weight"  # [34, 64]: the item holds another shape
    _rewrite(folder, lambda md: md.storage_data.__setitem__(MetadataIndex(W, (32, 0)), _item(md, other, (17, 0))))
    with pytest.raises(CheckpointLayoutError, match=r"holds a float32 tensor of shape \[17, 64\], the \.metadata "
                                                    r"declares float32 \[32, 34\] for this chunk"):
        mo.inspect(folder)


def test_a_dtype_the_items_do_not_hold_is_refused(tmp_path):
    folder = _copy(tmp_path)
    _rewrite(folder, lambda md: setattr(md.state_dict_metadata[W].properties, "dtype", torch.float16))
    with pytest.raises(CheckpointLayoutError, match=r"holds a float32 tensor of shape \[32, 34\], the \.metadata "
                                                    r"declares float16 \[32, 34\]"):
        mo.inspect(folder)


def test_a_damaged_item_archive_is_refused(tmp_path):
    folder = _copy(tmp_path)
    md = pickle.loads((folder / ".metadata").read_bytes())
    item = _item(md)
    data = bytearray((folder / "__1_0.distcp").read_bytes())
    end = item.offset + item.length
    data[end - 22: end] = b"\0" * 22  # the archive's end-of-central-directory record
    (folder / "__1_0.distcp").write_bytes(bytes(data))
    with pytest.raises(CheckpointLayoutError, match=rf"the item of {W} at bytes .*: not a readable torch zip archive"):
        mo.inspect(folder)


def test_a_plain_save_in_tmp_path_reads_as_saved(tmp_path):
    """Not only the corpus: 0-d, bf16, int and empty tensors, nested dicts, non-tensor values."""
    sd = {"w": torch.randn(5, 3), "b": torch.arange(7, dtype=torch.int64), "h": torch.randn(4).bfloat16(),
          "s": torch.tensor(2.5), "e": torch.empty(0, 3), "nested": {"x": torch.ones(2, 2)}, "step": 7}
    dcp.save(sd, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    got = mo.load_state_dict(tmp_path / "ck", no_dist=True)
    want = {k: v for k, v in sd.items() if torch.is_tensor(v)}
    want["nested.x"] = sd["nested"]["x"]
    _same(got, want)


def test_a_dcp_folder_at_an_s3_url_loads_as_the_local_one(monkeypatch):
    pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    from metaseq_oneload import _storage
    from tests.s3_server import S3Endpoint, apply_env

    ep = S3Endpoint()
    try:
        url = ep.upload(DCP / "fsdp2_w3", "ckpt", "fsdp2_w3")
        apply_env(ep.env(), monkeypatch)
        _storage.reset_stats()
        layout = mo.inspect(url)
        assert layout.flavor == "dcp" and layout.fingerprint() == mo.inspect(DCP / "fsdp2_w3").fingerprint()
        assert mo.inspect(url + "/__1_0.distcp").fingerprint() == layout.fingerprint()
        ep.reset()
        _same(mo.load_state_dict(url, no_dist=True), reference_weights())
        served = ep.counters.body_bytes
        files = sum(f.stat().st_size for f in (DCP / "fsdp2_w3").glob("*.distcp"))
        assert served <= 1.05 * files, (served, files)  # each item's bytes once, .metadata cached
    finally:
        ep.stop()


def test_the_safetensors_serialization_reads_where_torch_cannot(tmp_path):
    """FileSystemWriter(serialization_format=SAFETENSORS): each tensor item points at one
    safetensors blob after the pickled values; torch 2.13 writes it and its reader fails on it."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    sd = {"w": torch.randn(6, 4), "h": torch.randn(5).bfloat16(), "n": torch.arange(3), "step": 3}
    writer = FileSystemWriter(str(tmp_path / "st"), serialization_format=SerializationFormat.SAFETENSORS)
    dcp.save(sd, storage_writer=writer, no_dist=True)
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException):  # its reader torch.loads the safetensors bytes
        dcp.load({k: torch.empty_like(v) for k, v in sd.items() if torch.is_tensor(v)}, checkpoint_id=str(tmp_path / "st"),
                 no_dist=True)
    want = {k: v for k, v in sd.items() if torch.is_tensor(v)}
    _same(mo.load_state_dict(tmp_path / "st", no_dist=True, verify=True), want)
    _rewrite(tmp_path / "st", lambda md: setattr(_item(md, "w", (0, 0)), "length", 8))  # a chunk it does not hold
    with pytest.raises(CheckpointLayoutError, match=r"the item of w at bytes \d+\.\.\d+\): not a torch\.save archive, "
                                                    "and not the bytes of the chunk"):
        mo.inspect(tmp_path / "st")


def _with_crafted(folder: Path, planner_data, sentinel: str, replacement: bytes) -> None:
    """The folder's metadata with ``planner_data`` in it, whose ``sentinel`` string's opcode is
    then replaced by ``replacement`` (opcodes pickle.dump cannot write: it recurses)."""
    _rewrite(folder, lambda md: setattr(md, "planner_data", planner_data))
    data = (folder / ".metadata").read_bytes()
    op = b"\x8c" + bytes([len(sentinel)]) + sentinel.encode()
    assert data.count(op) == 1
    (folder / ".metadata").write_bytes(data.replace(op, replacement))


DEEP = b")" + b"\x85" * 300_000  # EMPTY_TUPLE, then TUPLE1 300,000 times: a tuple 300,000 deep


def test_a_deep_tuple_in_the_metadata_is_never_walked(tmp_path):
    folder = _copy(tmp_path)
    _with_crafted(folder, {"decoder.version": "SENTINEL_V"}, "SENTINEL_V", DEEP)
    _same(mo.load_state_dict(folder, no_dist=True), reference_weights())  # planner_data of that shape: ignored


def test_a_deep_tuple_as_a_dict_key_is_refused_before_it_is_hashed(tmp_path):
    folder = _copy(tmp_path)
    _with_crafted(folder, {"SENTINEL_K": ("decoder.version",)}, "SENTINEL_K", DEEP)
    with pytest.raises(CheckpointLayoutError, match=r"not a readable torch\.distributed\.checkpoint metadata file: a "
                                                    r"dict key of type tuple"):
        mo.inspect(folder)


def test_a_read_outside_every_chunk_of_a_distcp_file_is_refused():
    """Whatever computed an extent, the reader reads a .distcp file only inside a chunk's
    elements as the .metadata and each item's archive place them."""
    from metaseq_oneload._reading import Extent, RangeReader

    layout = mo.inspect(DCP / "fsdp2_w2")
    e = layout.parts[0].tensors[W].extents[0]
    out = torch.empty(4)
    with RangeReader() as r:
        r.read_extent(e, 0, out, torch.float32)  # inside: fine
        assert torch.equal(out, reference_weights()[W].reshape(-1)[:4])
        for bad in (e.byte_offset - 64, e.byte_offset + e.numel * 4 - 8):  # the archive's header; past the chunk
            with pytest.raises(CheckpointLayoutError, match=r"do not lie inside one tensor record of the file"):
                r.read_extent(Extent(e.path, e.key, 0, 4, bad), 0, out, torch.float32)


@pytest.mark.parametrize("protocol", [2, 3, 5])
def test_metadata_pickled_with_another_protocol_reads_the_same(tmp_path, protocol):
    """What older Pythons' pickle.dump (3) and newer ones (5) write reads like torch's (4)."""
    folder = _copy(tmp_path)
    md = pickle.loads((folder / ".metadata").read_bytes())
    (folder / ".metadata").write_bytes(pickle.dumps(md, protocol=protocol))
    assert mo.inspect(folder).fingerprint() == mo.inspect(DCP / "fsdp2_w2").fingerprint()


def test_state_saved_beside_top_level_model_keys_is_left_out(tmp_path):
    """torchtitan's layout: the model's FQNs at the top level, the optimizer's under its key."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    dcp.save({**msd, "optimizer": osd}, checkpoint_id=str(tmp_path / "tt"), no_dist=True)
    _same(mo.load_state_dict(tmp_path / "tt", no_dist=True), dict(model.state_dict()))
    assert any("not read: optimizer.state." in n for n in mo.inspect(tmp_path / "tt").notes)


def test_a_plain_save_named_distcp_outside_a_dcp_folder_reads_as_any_file(tmp_path):
    ref = reference_weights()
    torch.save(ref, tmp_path / "model.distcp")
    got = mo.load_state_dict(tmp_path / "model.distcp", no_dist=True)
    _same(got, ref)
