"""Issue 24: convert, consolidate and export-hf record the content identity of what they write.

Every recorded digest is checked against the reference implementation (``_digest.digest_tensor``)
over the output's tensors as torch / safetensors / fairscale read them in the same test, and the
content digests against an MP=1 ``load_state_dict`` of the output and of the source. The
synthetic model's tensors span several 1 MiB leaves and its k/v/q thirds and flat-shard cuts
fall inside leaves, so fragments from different files are joined."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

import metaseq_oneload as mo
from bench._synth import metaseq_lm, write_metaseq
from metaseq_oneload import _header, _zip
from metaseq_oneload._convert import consolidate, convert
from metaseq_oneload._digest import LEAF, digest_tensor, model_digest
from metaseq_oneload._hf_export import export_hf
from metaseq_oneload.formats import _index, discover
from tests.conftest import FIXTURES, SETS, raw_load

INDEX = "ck.oneload-index.json"


@pytest.fixture(autouse=True)
def _own_key(tmp_path, monkeypatch):
    """This user's index key in a folder of the test's own (never the real ~/.cache)."""
    monkeypatch.setenv("METASEQ_ONELOAD_INDEX_KEY", str(tmp_path / "keys" / "index-key"))


def synth_model():
    """dim 520: a k/v/q third is 1,081,600 bytes (a leaf and a bit), fc1 4.3 MB, so tensors
    span several leaves and their cuts (thirds, flat shards, model parts) fall inside leaves."""
    return metaseq_lm(layers=2, dim=520, ffn=2080, vocab=1000, positions=62)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    root = tmp_path_factory.mktemp("digest_outputs")
    write_metaseq(str(root / "src"), synth_model(), shards=3)
    return str(root / "src-model_part-0-shard0.pt")


def content_of(path) -> dict:
    """{name: digest} of what a single-process MP=1 load returns: the canonical tensors."""
    return {n: digest_tensor(n, t) for n, t in mo.load_state_dict(path, no_dist=True).items()}


@pytest.fixture(scope="module")
def source_content(source):
    return content_of(source)


def _fairscale_part(paths) -> dict:
    """fairscale's own unflattening of one model part's flat shards."""
    from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP

    objs = [raw_load(p) for p in paths]
    return FSDP.consolidate_shard_weights([o["model"] for o in objs], [o["shard_metadata"] for o in objs])


def _clear():
    _header._cached_header.cache_clear()
    _zip.zip_index.cache_clear()


@pytest.mark.parametrize("M,N,kw", [(1, 1, {}), (1, 3, {}), (2, 1, {}), (2, 2, {}), (1, 1, {"qkv": "split"}),
                                    (1, 2, {"dtype": "bf16"})],
                         ids=["1x1", "1x3flat", "mp2", "mp2x2flat", "qkv-split", "bf16flat"])
def test_convert_records_the_digests_of_what_it_wrote(tmp_path, source, source_content, M, N, kw):
    r = convert(source, tmp_path / "ck", model_parallel=M, shards=N, jobs=2, progress=False, **kw)
    index = json.loads((tmp_path / INDEX).read_text())
    layout = discover(r.files[0])
    assert layout.index is not None  # the index, with its digests, is what discovery used
    recorded = {(p["index"], t["name"]): t["digest"] for p in index["parts"] for t in p["tensors"]}
    assert recorded == {(t.part, t.name): t.digest for p in layout.parts for t in p.tensors.values()}
    assert all(recorded.values()) and len(recorded) == sum(len(p.tensors) for p in layout.parts)
    # Stored digests: the tensors of each part as torch (unflattened) or fairscale (flat) read them.
    for m, row in enumerate(layout.files):
        paths = [f.path for f in row]
        tensors = _fairscale_part(paths) if N > 1 else raw_load(paths[0])["model"]
        for name, t in layout.parts[m].tensors.items():
            assert recorded[(m, name)] == digest_tensor(name, tensors[name], part=m if M > 1 else None), name
    if M > 1:  # canonical digests need every part's bytes at once: not recorded, and said so
        assert "content" not in index and r.digest is None
        assert any("content digest not recorded" in n for n in r.notes)
        return
    content = index["content"]
    loaded = content_of(r.files[0])
    assert content["tensors"] == loaded and content["model"] == model_digest(loaded) == r.digest
    assert _index.recorded_content(layout)["model"] == r.digest
    if "dtype" not in kw:  # the output carries the source's content identity, whatever its layout
        assert content["tensors"] == source_content


def test_consolidate_records_the_source_content_for_every_fixture(tmp_path):
    for name in SETS:
        src = FIXTURES / name
        r = consolidate(src, tmp_path / name / "ck.pt", progress=False)
        expected = content_of(src)
        assert r.digest == model_digest(expected), name
        assert json.loads((tmp_path / name / INDEX).read_text())["content"]["tensors"] == expected, name


def test_safetensors_outputs_record_digests_in_their_sidecars(tmp_path, source, source_content):
    from safetensors.torch import load_file

    r = convert(source, tmp_path / "ck", shards=1, format="safetensors", progress=False)
    sidecar = json.loads(open(r.sidecars[0]).read())["oneload_digest"]
    tensors = load_file(r.files[0])
    assert sidecar["stored"] == {n: digest_tensor(n, t) for n, t in tensors.items()}
    assert sidecar["content"]["tensors"] == source_content and r.digest == model_digest(source_content)


def test_export_hf_records_its_own_and_the_source_digest(tmp_path):
    source = FIXTURES / "mp2_dp2"  # two model parts of flat shards, merged and unflattened on the way
    source_content = content_of(source)
    r = export_hf(source, tmp_path / "hf", max_shard_size=60_000, progress=False)
    files = [f for f in r.files if f.endswith(".safetensors")]
    assert len(files) > 1  # the folder digest is in every file, each file's tensors in its own
    seen = {}
    for f in files:
        with safe_open(str(tmp_path / "hf" / f), "pt") as s:
            md = s.metadata()
            mine = json.loads(md["oneload.tensor_digests"])
            assert mine == {k: digest_tensor(k, s.get_tensor(k)) for k in s.keys()}
            assert md["oneload.digest"] == r.digest and md["oneload.source_digest"] == r.source_digest
            seen.update(mine)
    exported = content_of(tmp_path / "hf")
    assert seen == exported and r.digest == model_digest(exported)
    # HF renames tensors and splits qkv_proj: its own digest is not the source's, which is recorded too.
    assert r.source_digest == model_digest(source_content) != r.digest
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["oneload.digest"] == r.digest


def test_export_hf_in_another_dtype_records_no_source_digest(tmp_path):
    r = export_hf(FIXTURES / "singleton", tmp_path / "hf", dtype=torch.bfloat16, progress=False)
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as s:
        md = s.metadata()
    assert "oneload.source_digest" not in md and r.source_digest is None
    assert any("source_digest" in w for w in r.warnings)
    assert md["oneload.digest"] == r.digest == model_digest(content_of(tmp_path / "hf"))


def test_an_edited_content_claim_is_a_claim(tmp_path):
    """Re-signed with this user's key, an edited digest still describes the layout (the index is
    a layout hint): it is reported as recorded, and only a digest-checked load or `verify`
    compares it with the bytes (tests/unit/test_digest_load.py)."""
    r = consolidate(FIXTURES / "fsdp_dp3", tmp_path / "ck.pt", progress=False)
    path = tmp_path / INDEX
    d = json.loads(path.read_text())
    d["content"]["model"] = "blake3:" + "ab" * 32
    d["parts"][0]["tensors"][0]["digest"] = "blake3:" + "cd" * 32
    d.pop("digest")
    d["digest"] = _index._digest(json.loads(json.dumps(d)))
    path.write_text(json.dumps(d))
    _clear()
    layout = discover(r.files[0])
    assert layout.index is not None
    assert _index.recorded_content(layout)["model"] == "blake3:" + "ab" * 32
    first = d["parts"][0]["tensors"][0]["name"]
    assert layout.parts[0].tensors[first].digest == "blake3:" + "cd" * 32
    # A malformed digest is not an index of ours: the headers are read instead.
    d["parts"][0]["tensors"][0]["digest"] = "md5:0"
    d.pop("digest")
    d["digest"] = _index._digest(json.loads(json.dumps(d)))
    path.write_text(json.dumps(d))
    _clear()
    layout = discover(r.files[0])
    assert layout.index is None and any("not a digest" in w for w in layout.warnings)


def test_leaves_cut_by_flat_shards_are_joined_and_released(source):
    """The cut between two flat shards falls inside a leaf: each writer hands over a fragment,
    and the leaf is hashed (its fragments dropped) as soon as both are there."""
    from metaseq_oneload._digest_record import WriteDigests

    t = torch.arange(3 * LEAF // 2 + 7, dtype=torch.int8)
    d = WriteDigests()
    j = d.stored(0, "x", t.dtype, t.shape, multi_part=False)
    d.route(0, "x", j)
    item = type("Item", (), {})
    cuts = [0, 1000, LEAF + 5, t.numel()]
    for s in (1, 0, 2):  # shards written in any order
        i = item()
        i.name, i.start = "x", cuts[s]
        d.tap(0, s)(i, t[cuts[s]: cuts[s + 1]])
    assert not j._pending  # no fragment held once its leaf was complete
    assert d.stored_digests()[(0, "x")] == digest_tensor("x", t)


def test_the_command_line_shows_what_was_recorded(tmp_path, capsys):
    from metaseq_oneload.cli import main

    assert main(["consolidate", str(FIXTURES / "mp2_dp2"), str(tmp_path / "ck.pt"), "--json", "--no-progress"]) == 0
    digest = json.loads(capsys.readouterr().out)["digest"]
    assert digest == json.loads((tmp_path / INDEX).read_text())["content"]["model"]
    assert main(["export-hf", str(FIXTURES / "mp2_dp2"), str(tmp_path / "hf"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert f"{digest} (the source's content)" in out  # the export carries its source's identity


def test_a_dcp_output_reports_the_content_digest_it_wrote(tmp_path, source, source_content):
    r = convert(source, tmp_path / "dcp", format="dcp", shards=2, progress=False)
    assert r.digest == model_digest(source_content)  # dim-0 chunks cut inside leaves, joined
    assert r.digest == model_digest(content_of(tmp_path / "dcp"))  # what a load of the folder returns
