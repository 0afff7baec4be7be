"""The index our writers leave beside a set (formats/_index.py): used when it agrees with
the files (no header is unpickled), ignored with a warning when it is stale, and equal to
what the headers say."""

from __future__ import annotations

import json
import os
import shutil

import torch

import metaseq_oneload as mo
from metaseq_oneload import _header
from metaseq_oneload.formats import _torchsave
from metaseq_oneload.formats import metaseq as metaseq_format
from tests.conftest import FIXTURES, needs_fixtures, raw_load

pytestmark = needs_fixtures


def _count_unpickling(monkeypatch) -> list:
    calls = []
    real = _header.torch_load

    def counting(path, **kw):
        calls.append(os.path.basename(path))
        return real(path, **kw)

    monkeypatch.setattr(_header, "torch_load", counting)
    _header._cached_header.cache_clear()
    return calls


def test_convert_leaves_an_index_that_loads_without_unpickling(tmp_path, monkeypatch):
    mo.convert(FIXTURES / "mp2_dp2", tmp_path / "out" / "ck", model_parallel=2, shards=3, progress=False)
    index = tmp_path / "out" / "ck.oneload-index.json"
    d = json.loads(index.read_text())
    assert d["save_id"] == raw_load(tmp_path / "out" / "ck-model_part-0-shard0.pt")["oneload_save"]["save_id"]
    assert [len(row) for row in d["files"]] == [3, 3]
    calls = _count_unpickling(monkeypatch)
    layout = mo.inspect(tmp_path / "out")
    assert layout.index == str(index) and calls == []
    from_headers = metaseq_format._from_headers(_torchsave.read_set(tmp_path / "out"), False)
    assert layout == from_headers and layout.fingerprint() == from_headers.fingerprint()
    assert layout.model_args() == {k: v for k, v in from_headers.model_args().items() if k in layout.model_args()}
    sd = mo.load_state_dict(tmp_path / "out", verify=True)
    ref = mo.load_state_dict(FIXTURES / "mp2_dp2")
    assert set(sd) == set(ref) and all(torch.equal(sd[k], ref[k]) for k in ref)


def test_a_copied_folder_keeps_its_index(tmp_path):
    mo.convert(FIXTURES / "fsdp_dp3", tmp_path / "out" / "ck", shards=2, progress=False)
    shutil.copytree(tmp_path / "out", tmp_path / "copy")
    layout = mo.inspect(tmp_path / "copy")
    assert layout.index == str(tmp_path / "copy" / "ck.oneload-index.json")
    assert all(f.path.startswith(str(tmp_path / "copy")) for f in layout.all_files)


def test_a_stale_index_is_ignored_and_said(tmp_path, monkeypatch):
    mo.convert(FIXTURES / "fsdp_dp3", tmp_path / "out" / "ck", shards=2, progress=False)
    shard = tmp_path / "out" / "ck-model_part-0-shard1.pt"
    obj = raw_load(shard)
    obj["extra_state"]["edited"] = True  # same tensors, another pickle
    torch.save(obj, shard)
    calls = _count_unpickling(monkeypatch)
    layout = mo.inspect(tmp_path / "out")
    assert layout.index is None and len(calls) == 2
    assert any("ck.oneload-index.json: stale (ck-model_part-0-shard1.pt changed" in w and "read the headers instead" in w
               for w in layout.warnings), layout.warnings
    (tmp_path / "out" / "ck.oneload-index.json").write_text("{not json")
    layout = mo.inspect(tmp_path / "out")
    assert layout.index is None and any("unreadable" in w for w in layout.warnings)


def test_an_edited_index_is_not_trusted(tmp_path):
    mo.convert(FIXTURES / "fsdp_dp3", tmp_path / "out" / "ck", shards=2, progress=False)
    index = tmp_path / "out" / "ck.oneload-index.json"
    d = json.loads(index.read_text())
    ext = d["parts"][0]["tensors"][0]["extents"][0]
    ext[4] += 4  # a byte offset moved: the files still match, the index does not
    index.write_text(json.dumps(d))
    layout = mo.inspect(tmp_path / "out")
    assert layout.index is None
    assert any("not signed with this user's index key" in w and "edited" in w for w in layout.warnings), layout.warnings
