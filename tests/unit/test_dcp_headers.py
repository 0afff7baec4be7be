"""What describing a DCP folder costs in requests, and what a rank that adopts its layout
reads (issue 23's benchmark): on an object store the items' archives are fetched a batch at
a time, neighbours in one request, instead of a request or two per item in turn; a rank
that adopts the layout another rank described checks its reads against the chunks that
rank verified instead of parsing every item again, and still against the parsed items for
any read outside them."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

import metaseq_oneload as mo
from metaseq_oneload import CheckpointLayoutError, _dcp_items
from metaseq_oneload.formats import adopt, to_wire
from metaseq_oneload.formats.dcp import describe_with_optimizer
from metaseq_oneload._reading import Extent, RangeReader
from tests.conftest import REPO

DCP = REPO / "tests" / "fixtures" / "dcp"
W = "decoder.layers.0.fc1.weight"


def _forget_parsed_items() -> None:
    for f in (_dcp_items._archive, _dcp_items._head):
        f.cache_clear()
    getattr(_dcp_items, "_VOUCHED", {}).clear()


def test_describing_an_s3_folder_fetches_item_headers_in_few_requests(tmp_path, monkeypatch):
    pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    from metaseq_oneload import _storage
    from tests.s3_server import S3Endpoint, apply_env

    torch.manual_seed(0)
    sd = {f"l{i}.w": torch.randn(32, 64) for i in range(160)}  # 160 items of 8 KiB in one file
    dcp.save(sd, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    ep = S3Endpoint()
    try:
        url = ep.upload(tmp_path / "ck", "ckpt", "many")
        apply_env(ep.env(), monkeypatch)
        _forget_parsed_items()
        _storage._CACHE.clear()
        ep.reset()
        layout = mo.inspect(url)
        c = ep.counters
        size = sum(f.size for f in layout.all_files)
        # one request per item (the end of each archive) before; a batch of 64 neighbours now
        assert c.gets <= 12, c.gets
        assert c.body_bytes <= 1.05 * size + (64 << 10), (c.body_bytes, size)
        assert layout.fingerprint() == mo.inspect(tmp_path / "ck").fingerprint()
        got = mo.load_state_dict(url, no_dist=True)
        assert all(torch.equal(got[k], v) for k, v in sd.items())
    finally:
        ep.stop()


def test_an_adopting_rank_reads_what_the_describer_checked_without_parsing_items():
    folder = DCP / "fsdp2_optim"
    layout = mo.inspect(folder)
    wire = to_wire(layout, str(folder))
    _forget_parsed_items()
    adopted = adopt(wire, str(folder))
    t = adopted.parts[0].tensors[W]
    with RangeReader() as r:
        out = torch.empty(t.extents[0].numel)
        r.read_extent(t.extents[0], 0, out, torch.float32)
        assert _dcp_items._archive.cache_info().misses == 0  # no item parsed on this rank
        assert torch.equal(out, mo.load_state_dict(folder, no_dist=True)[W].reshape(-1)[:out.numel()])
        # an optimizer tensor of the same file, not in the model's layout: the items are parsed
        full, shadows = describe_with_optimizer(str(folder))
        name = next(n for n in shadows.tensors if any(e.path.endswith(".distcp") for e in
                                                       full.parts[0].tensors[n].extents))
        e = full.parts[0].tensors[name].extents[0]
        out = torch.empty(min(4, e.numel))
        r.read_extent(e, 0, out, full.parts[0].tensors[name].dtype)
        assert torch.equal(out, _dcp_items.chunk_tensor(e.path, e.key)[e.elem_offset:e.elem_offset + out.numel()])
        # and a read outside every chunk is still refused, as the parsed items place them
        e = t.extents[0]
        for bad in (e.byte_offset - 64, e.byte_offset + e.numel * 4 - 8):
            with pytest.raises(CheckpointLayoutError, match=r"do not lie inside one tensor record of the file"):
                r.read_extent(Extent(e.path, e.key, 0, 4, bad), 0, torch.empty(4), torch.float32)


def test_a_vouched_file_that_changed_is_parsed_again(tmp_path):
    sd = {"a": torch.randn(8, 4), "b": torch.randn(16)}
    dcp.save(sd, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    layout = mo.inspect(tmp_path / "ck")
    adopt(to_wire(layout, str(tmp_path / "ck")), str(tmp_path / "ck"))
    path = layout.all_files[0].path
    assert _dcp_items.vouched_spans(path) is not None
    with open(path, "ab") as f:  # another version of the file: nothing vouched for it
        f.write(b"\0")
    assert _dcp_items.vouched_spans(path) is None


def test_the_spans_of_a_file_that_changed_are_dropped_not_kept_beside_the_new_ones(tmp_path):
    """A long-lived process re-describes a folder whose file is rewritten again and again
    (a checkpoint saved over in place): one entry for the file, never one per version."""
    sd = {"a": torch.randn(8, 4), "b": torch.randn(16)}
    dcp.save(sd, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    _forget_parsed_items()
    path = mo.inspect(tmp_path / "ck").all_files[0].path
    for _ in range(4):
        with open(path, "ab") as f:  # another version of the file
            f.write(b"\0")
        assert _dcp_items.vouched_spans(path) is None  # what was vouched for the last one is not taken
        mo.inspect(tmp_path / "ck")  # vouches for this version
        assert _dcp_items.vouched_spans(path) is not None
    assert len(_dcp_items._VOUCHED) == 1, list(_dcp_items._VOUCHED)


def test_vouched_spans_are_kept_for_the_last_files_only(tmp_path, monkeypatch):
    monkeypatch.setattr(_dcp_items, "_VOUCHED_MAX", 3, raising=False)
    _forget_parsed_items()
    paths = []
    for i in range(5):
        p = tmp_path / f"__{i}_0.distcp"
        p.write_bytes(b"\0" * 64)
        paths.append(str(p))
        _dcp_items.vouch({str(p): ([0], [64])})
    assert len(_dcp_items._VOUCHED) == 3
    assert [_dcp_items.vouched_spans(p) is not None for p in paths] == [False, False, True, True, True]
