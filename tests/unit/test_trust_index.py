"""Issue 21, class 2: the index beside our outputs (``<prefix>.oneload-index.json``) is a
hint, never the authority for a byte range, a path or a field. Each test edits the index of
a real converted set the way anyone could (the plain digest recomputed) and checks that the
load still gives the source's weights and metadata."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest
import torch

import metaseq_oneload as mo
from metaseq_oneload import _header, _zip
from metaseq_oneload.formats import _index
from tests.conftest import FIXTURES, needs_fixtures

pytestmark = needs_fixtures


@pytest.fixture(autouse=True)
def _own_key(tmp_path, monkeypatch):
    """This user's index key in a folder of the test's own (never the real ~/.cache)."""
    monkeypatch.setenv("METASEQ_ONELOAD_INDEX_KEY", str(tmp_path / "keys" / "index-key"))


def _public_digest(d: dict) -> str:
    """The digest as anyone can recompute it from the index alone (the format's published
    hash of what it says about bytes): an attacker's edit comes with this."""
    body = {k: d[k] for k in ("prefix", "name", "metadata_key", "parts")}
    body["files"] = [[f["name"] for f in row] for row in d["files"]]
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _clear_caches():
    _header._cached_header.cache_clear()
    _zip.zip_index.cache_clear()


def _convert(tmp_path, name: str, **kw):
    out = tmp_path / name
    if kw.pop("consolidated", False):
        mo.consolidate(FIXTURES / "fsdp_dp3", out / "ck.pt", progress=False)
    else:
        mo.convert(FIXTURES / "fsdp_dp3", out / "ck", shards=2, progress=False, **kw)
    return out


def _edit(folder, fn, *, digest="public") -> None:
    path = folder / "ck.oneload-index.json"
    d = json.loads(path.read_text())
    fn(d)
    if digest == "public":
        d["digest"] = _public_digest(d)
    elif digest == "ours":  # as this process signs an index (a writer's bug, not an attacker)
        d.pop("digest")
        d["digest"] = _index._digest(json.loads(json.dumps(d)))
    path.write_text(json.dumps(d))
    _clear_caches()


def _tensor(d: dict, name: str) -> dict:
    return next(t for p in d["parts"] for t in p["tensors"] if t["name"] == name)


def _reference() -> dict:
    return mo.load_state_dict(FIXTURES / "fsdp_dp3")


def _assert_source_weights(folder) -> None:
    sd = mo.load_state_dict(folder, verify=True)
    ref = _reference()
    wrong = sorted(k for k in ref if not torch.equal(sd[k], ref[k]))
    assert wrong == [], f"{len(wrong)} wrong tensors: {wrong[:4]}"


A, B = "decoder.layers.0.self_attn_layer_norm.weight", "decoder.layers.0.self_attn_layer_norm.bias"


@pytest.mark.parametrize("kind", ["consolidated", "flat"])
def test_swapped_extents_with_a_recomputed_digest_give_the_source_weights(tmp_path, kind):
    """Two tensors of one shape trade their extents (different storages in a consolidated
    file, two runs of one flat parameter in a shard): every extent still lies inside a
    record of the right size, only the file's own pickle says which is which."""
    out = _convert(tmp_path, "out", consolidated=kind == "consolidated")

    def swap(d):
        a, b = _tensor(d, A), _tensor(d, B)
        a["extents"], b["extents"] = b["extents"], a["extents"]

    _edit(out, swap)
    _assert_source_weights(out)
    layout = mo.inspect(out)
    assert layout.index is None, "an index edited by someone without this user's key was used"
    assert any("oneload-index.json" in w and "read the headers instead" in w for w in layout.warnings), layout.warnings


def _poison_copy(out, other):
    """A copy of the set whose files keep every zip record where it was, with other bytes in
    every tensor record: an extent moved there reads inside a record, and wrong values."""
    shutil.copytree(out, other)
    for p in other.glob("*.pt"):
        index = _zip._parse_zip(str(p))
        with open(p, "r+b") as f:
            for rec in index.records.values():
                if rec.name.startswith("data/") and rec.size:
                    f.seek(rec.data_offset)
                    f.write(torch.full((rec.size // 4,), 7.0).numpy().tobytes()[: rec.size])
    return other


@pytest.mark.parametrize("digest", ["public", "ours"])
@pytest.mark.parametrize("where", ["absolute", "dotdot", "link_out", "not_listed"])
def test_an_extent_that_points_outside_the_set_is_never_read(tmp_path, where, digest):
    out = _convert(tmp_path, "out")
    other = _poison_copy(out, tmp_path / "other")
    victim = "ck-model_part-0-shard0.pt"
    if where == "absolute":
        target = str(other / victim)
    elif where == "dotdot":
        target = os.path.join("..", "other", victim)
    elif where == "link_out":
        os.symlink(other / victim, out / "elsewhere.bin")
        target = "elsewhere.bin"
    else:  # a file in the folder that is not one of the set's
        shutil.copy(other / victim, out / "stray.bin")
        target = "stray.bin"

    def redirect(d):
        for p in d["parts"]:
            for t in p["tensors"]:
                for e in t["extents"]:
                    if e[0] == victim:
                        e[0] = target

    _edit(out, redirect, digest=digest)
    _assert_source_weights(out)
    layout = mo.inspect(out)
    assert layout.index is None
    assert {os.path.dirname(e.path) for p in layout.parts for t in p.tensors.values() for e in t.extents} == {str(out)}
    assert any("read the headers instead" in w for w in layout.warnings), layout.warnings


def test_an_extent_outside_its_record_is_never_read(tmp_path):
    """Signed as this process signs (a writer's bug): the extent still must lie inside one
    stored tensor record of its file."""
    out = _convert(tmp_path, "out")

    def shift(d):
        e = _tensor(d, "decoder.embed_tokens.weight")["extents"][0]
        assert e[2] == 0  # the first element of its record
        e[4] -= 64  # into the zip header in front of the record
    _edit(out, shift, digest="ours")
    _assert_source_weights(out)
    layout = mo.inspect(out)
    assert layout.index is None
    assert any("record" in w for w in layout.warnings), layout.warnings


def test_fields_the_digest_did_not_cover_are_not_trusted(tmp_path):
    out = _convert(tmp_path, "out")
    before = mo.inspect(out)

    def lie(d):
        d["num_updates"] = 999
        d["cfg"]["model_parallel_size"] = 7
        d["cfg"]["distributed_world_size"] = 14
        d["model_args"]["decoder_layers"] = 99
        d["flavor"] = "fairseq"

    _edit(out, lie, digest=None)  # these fields were never in the digest: left as it was
    layout = mo.inspect(out)
    assert layout.index is None
    assert (layout.num_updates, layout.cfg, layout.flavor) == (before.num_updates, before.cfg, before.flavor)
    assert layout.num_updates != 999 and layout.cfg.model_parallel_size != 7
    assert layout.model_args().get("decoder_layers") == before.model_args().get("decoder_layers") != 99


def test_an_index_of_another_key_is_ignored_and_said(tmp_path, monkeypatch):
    """Another user's (or machine's) index, unedited, is not this user's to trust: the
    headers are read, and the warning says why."""
    out = _convert(tmp_path, "out")
    monkeypatch.setenv("METASEQ_ONELOAD_INDEX_KEY", str(tmp_path / "someone_else" / "index-key"))
    if hasattr(_index, "_key"):
        _index._key(create=True)  # the other user has a key of their own
    _clear_caches()
    layout = mo.inspect(out)
    assert layout.index is None
    assert any("not signed with this user's index key" in w for w in layout.warnings), layout.warnings
    _assert_source_weights(out)


def test_a_valid_index_still_saves_every_header_read(tmp_path, monkeypatch):
    out = _convert(tmp_path, "out")
    calls = []
    real = _header.torch_load
    monkeypatch.setattr(_header, "torch_load", lambda path, **kw: calls.append(path) or real(path, **kw))
    _clear_caches()
    layout = mo.inspect(out)
    assert layout.index == str(out / "ck.oneload-index.json") and calls == []
