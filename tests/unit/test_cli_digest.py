"""``metaseq_oneload.digest`` and ``metaseq-oneload digest``: the canonical digest read
through the executor equals the reference (``_digest.digest_tensor``) over what a
one-process ``load_state_dict`` returns, whatever the layout and the chunking; what a set
records is compared with the bytes, never used instead of them."""

from __future__ import annotations

import json
import os

import pytest
import torch

import metaseq_oneload as oneload
from bench._synth import metaseq_lm, write_metaseq
from metaseq_oneload import DigestError, OptionError
from metaseq_oneload.cli import main
from metaseq_oneload._digest import digest_tensor, model_digest
from metaseq_oneload._digest_verb import FORMAT, read_digest_file

FIX = os.path.join(os.path.dirname(__file__), "..", "fixtures", "metaseq")


def _reference(path) -> dict:
    return {n: digest_tensor(n, t) for n, t in oneload.load_state_dict(path).items()}


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """A metaseq LM of ~13 MiB as 2 model-parallel parts x 2 flat shards: tensors of several
    MiB, split across files, padded, tied."""
    d = tmp_path_factory.mktemp("big")
    full = metaseq_lm(layers=2, dim=256, ffn=1100, vocab=2600, positions=62)
    write_metaseq(str(d / "checkpoint_last"), full, model_parallel=2, shards=2, flat=True)
    return d


@pytest.mark.parametrize("chunk_mb,threads", [(1, 3), (2, 1), (64, None)])
def test_the_verb_equals_the_reference_over_the_loaded_state_dict(big, chunk_mb, threads):
    ref = _reference(big)
    seen = []
    r = oneload.digest(big, chunk_mb=chunk_mb, threads=threads, progress=lambda done, total: seen.append((done, total)))
    assert {t.name: t.digest for t in r.tensors} == ref
    assert "decoder.output_projection.weight" in ref  # the tied name is part of the model
    assert r.model == model_digest(ref)
    assert r.nbytes == sum(t.nbytes for t in r.tensors) > 8 << 20
    assert max(t.nbytes for t in r.tensors) > 2 << 20  # tensors of several chunks
    assert r.bytes_read >= r.nbytes - dict((t.name, t.nbytes) for t in r.tensors)["decoder.output_projection.weight"]
    assert seen and seen[-1][0] == seen[-1][1] and all(a <= b for a, b in seen)
    assert r.recorded is None and r.match
    assert r.files_of("decoder.layers.0.fc1.weight")  # where its bytes were read


def test_cli_table_and_json(big, capsys):
    assert main(["digest", str(big), "--no-progress"]) == 0
    out = capsys.readouterr().out
    r = oneload.digest(big, progress=False)
    assert r.model in out and "decoder.layers.1.fc2.weight" in out
    assert "no content digest recorded" in out
    assert main(["digest", str(big), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["format"] == FORMAT and d["model"] == r.model and d["match"] is True
    assert [t["name"] for t in d["tensors"]] == [t.name for t in r.tensors]
    assert all(t["shape"] == list(x.shape) for t, x in zip(d["tensors"], r.tensors))


def test_recorded_digest_is_compared_and_a_flipped_bit_names_tensor_and_file(tmp_path, capsys):
    out = tmp_path / "c.pt"
    oneload.consolidate(os.path.join(FIX, "reshard_mp2_flat"), str(out))
    r = oneload.digest(out)
    assert r.recorded is not None and r.recorded.compared and r.recorded.matched and r.match
    assert r.recorded.claim.model == r.model  # the writer recorded what the bytes hold
    assert main(["digest", str(out), "--no-progress"]) == 0
    assert "MATCH: the digest recorded by" in capsys.readouterr().out
    # One bit inside one tensor's bytes: the index stays valid (it hashes the pickle and the
    # record table, not the data), the claim no longer holds.
    layout = oneload.inspect(out)
    st = layout.parts[0].tensors["decoder.layers.1.fc1.weight"]
    ext = st.extents[0]
    with open(out, "r+b") as f:
        f.seek(ext.byte_offset + 37)
        b = f.read(1)
        f.seek(ext.byte_offset + 37)
        f.write(bytes([b[0] ^ 0x10]))
    r = oneload.digest(out)
    assert not r.match and r.recorded.differing == ("decoder.layers.1.fc1.weight",)
    assert r.recorded.model_matches is False
    assert r.recorded.claim.model != r.model
    assert main(["digest", str(out), "--no-progress"]) == 1
    text = capsys.readouterr().out
    assert "DIFFER" in text and f"decoder.layers.1.fc1.weight: recorded " in text and str(out) in text
    assert main(["digest", str(out), "--json"]) == 1
    d = json.loads(capsys.readouterr().out)
    assert d["match"] is False and d["recorded"]["differing"] == ["decoder.layers.1.fc1.weight"]
    assert d["recorded"]["claim"]["checked"] is False  # a claim, labelled as such


def test_a_digest_file_reads_back_and_damage_is_refused(big, tmp_path, capsys):
    assert main(["digest", str(big), "--json"]) == 0
    f = tmp_path / "d.json"
    f.write_text(capsys.readouterr().out)
    model, named, _ = read_digest_file(f)
    assert model == oneload.digest(big).model and len(named) == 2 * 12 + 6
    assert read_digest_file(model)[0] == model
    doc = json.loads(f.read_text())
    doc["tensors"][3]["digest"] = doc["tensors"][4]["digest"]
    f.write_text(json.dumps(doc))
    with pytest.raises(DigestError, match="not the one its tensor digests give"):
        read_digest_file(f)
    f.write_text(json.dumps({"format": "other"}))
    with pytest.raises(DigestError, match="not a digest file"):
        read_digest_file(f)
    with pytest.raises(DigestError, match="expected 'blake3:' followed by 64 hex"):
        read_digest_file("blake3:abc")


def test_bad_options_and_paths_are_refusals(tmp_path, capsys):
    with pytest.raises(OptionError, match="threads=0"):
        oneload.digest(os.path.join(FIX, "singleton"), threads=0)
    assert main(["digest", os.path.join(FIX, "singleton"), "--threads", "0"]) == 2
    assert "--threads 0" in capsys.readouterr().err
    assert main(["digest", str(tmp_path / "nothing")]) == 2
    assert "nothing" in capsys.readouterr().err


def test_tied_and_empty_tensors(tmp_path):
    sd = {"a": torch.randn(3, 4), "e": torch.zeros(0, 5), "s": torch.tensor(7, dtype=torch.int64),
          "b": torch.rand(9) > 0.5, "h": torch.randn(5).bfloat16()}
    torch.save(sd, tmp_path / "m.pt")
    r = oneload.digest(tmp_path / "m.pt", progress=False)
    assert {t.name: t.digest for t in r.tensors} == {n: digest_tensor(n, t) for n, t in sd.items()}
    assert {t.name: (t.dtype, t.shape) for t in r.tensors}["e"] == ("float32", (0, 5))


def _flip_one_bit(path, name: str, bit: int = 0) -> None:
    st = oneload.inspect(path).parts[0].tensors[name]
    ext = st.extents[0]
    with open(ext.path, "r+b") as f:
        f.seek(ext.byte_offset + 5 * 4)  # element 5's lowest mantissa byte (little-endian fp32)
        b = f.read(1)
        f.seek(ext.byte_offset + 5 * 4)
        f.write(bytes([b[0] ^ (1 << bit)]))


def test_verify_against_a_digest_reads_only_path_and_names_the_tensor(tmp_path, capsys):
    src = os.path.join(FIX, "reshard_mp2_flat")
    assert main(["digest", src, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    doc["path"] = str(tmp_path / "gone")  # the digested checkpoint need not exist any more
    ref = tmp_path / "ref.json"
    ref.write_text(json.dumps(doc))
    copy = tmp_path / "c.pt"
    oneload.consolidate(src, str(copy))
    r = oneload.verify(copy, ref)
    assert r.against_digest and r.match and r.identical and r.digest_a == r.digest_b == doc["model"]
    assert r.claims and r.claims[0][0] == "a" and r.claims[0][4] is True  # convert's record, a claim that holds
    assert oneload.verify(copy, doc["model"]).match
    # A flip in the lowest mantissa bit: within any tolerance, but not the same content.
    _flip_one_bit(copy, "decoder.layers.0.fc2.weight")
    r = oneload.verify(copy, ref)
    assert not r.match and r.digest_mismatches == ("decoder.layers.0.fc2.weight",) and r.digest_a != r.digest_b
    assert r.claims[0][4] is False  # the recorded digest no longer describes the bytes
    assert main(["verify", str(copy), str(ref), "--no-progress"]) == 1
    out = capsys.readouterr().out
    assert "differ: decoder.layers.0.fc2.weight" in out and "DIFFER" in out and "not re-read" in out
    assert main(["verify", str(copy), doc["model"], "--no-progress"]) == 1
    assert "which tensors differ is not known" in capsys.readouterr().out
    # Both sides checkpoints: compared as before (within tolerance), and the digests say more.
    r = oneload.verify(copy, src)
    assert r.match and not r.identical
    assert r.digest_b == doc["model"] != r.digest_a == oneload.digest(copy).model
    assert main(["verify", str(copy), src, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["digest_a"] == r.digest_a and d["digest_b"] == r.digest_b
    with pytest.raises(DigestError, match="expected 'blake3:' followed by 64 hex"):
        oneload.verify(copy, "blake3:1234")


def test_inspect_shows_a_recorded_digest_as_a_claim(tmp_path, capsys):
    out = tmp_path / "c.pt"
    oneload.consolidate(os.path.join(FIX, "singleton"), str(out))
    computed = oneload.digest(out).model
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "recorded digest  (a claim by its writer, not checked" in text and f"model    {computed}" in text
    assert main(["inspect", str(out), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)["recorded_digest"]
    assert d["model"] == computed and d["checked"] is False and len(d["tensors"]) == 30
    # A set without one says nothing about digests.
    assert main(["inspect", os.path.join(FIX, "singleton")]) == 0
    assert "recorded digest" not in capsys.readouterr().out
    assert main(["inspect", os.path.join(FIX, "singleton"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["recorded_digest"] is None


def test_an_export_hf_folder_records_its_digest_and_its_source_s(tmp_path, capsys):
    src = os.path.join(FIX, "reshard_mp2_flat")
    out = tmp_path / "hf"
    oneload.export_hf(src, str(out), progress=False)
    r = oneload.digest(out)
    claim = r.recorded.claim
    assert r.match and r.recorded.compared and claim.model == r.model
    assert claim.source_digest == oneload.digest(src).model != r.model  # HF names, split qkv
    assert main(["inspect", str(out)]) == 0
    assert f"{claim.source_digest} (the checkpoint it was made from)" in capsys.readouterr().out
    name = "model.decoder.layers.1.fc1.weight"
    st = oneload.inspect(out).parts[0].tensors[name]
    with open(st.extents[0].path, "r+b") as f:
        f.seek(st.extents[0].byte_offset + 8)
        b = f.read(1)
        f.seek(st.extents[0].byte_offset + 8)
        f.write(bytes([b[0] ^ 1]))
    assert main(["digest", str(out), "--no-progress"]) == 1
    text = capsys.readouterr().out
    assert f"{name}: recorded" in text and "model.safetensors" in text.split(f"{name}: recorded")[1].splitlines()[0]


def test_a_malformed_recorded_digest_is_no_claim_and_no_crash(tmp_path, capsys):
    from safetensors.torch import save_file

    p = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(3)}, str(p), metadata={"oneload.digest": "md5:abc",
                                                      "oneload.tensor_digests": "{not json"})
    r = oneload.digest(p)
    claim = r.recorded.claim
    assert claim.model is None and claim.tensors == () and not r.recorded.compared and r.match
    assert any("md5:abc" in x for x in claim.problems) and any("not JSON" in x for x in claim.problems)
    assert main(["inspect", str(p)]) == 0
    assert "problem" in capsys.readouterr().out
    save_file({"w": torch.ones(3)}, str(p), metadata={"oneload.digest": digest_tensor("w", torch.ones(3))})
    assert main(["digest", str(p), "--no-progress"]) == 1  # a well-formed claim the bytes do not have
    assert "model: recorded" in capsys.readouterr().out


def test_a_truncated_file_is_a_refusal_not_a_hang(big, tmp_path, capsys):
    f = tmp_path / "m.pt"
    torch.save({"w": torch.randn(3 << 18), "b": torch.randn(7)}, f)  # 3 MiB: several chunks of 1 MiB
    layout = oneload.inspect(f)
    ext = layout.parts[0].tensors["w"].extents[0]
    with open(f, "r+b") as fh:
        fh.truncate(ext.byte_offset + (2 << 20))
    with pytest.raises(oneload.OneloadError):
        oneload.digest(f, chunk_mb=1, threads=2)
    assert main(["digest", str(f), "--chunk-mb", "1"]) == 2
    assert "m.pt" in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["a\0b", "\ud800"])
def test_a_claim_naming_a_tensor_the_digest_cannot_name_is_a_problem_not_a_crash(tmp_path, capsys, bad):
    from safetensors.torch import save_file

    w = torch.arange(6, dtype=torch.float16).reshape(2, 3)
    p = tmp_path / "model.safetensors"
    named = {"w": digest_tensor("w", w), bad: digest_tensor("w", w)}
    save_file({"w": w}, str(p), metadata={"oneload.digest": model_digest({"w": named["w"]}),
                                          "oneload.tensor_digests": json.dumps(named)})
    assert main(["inspect", str(p)]) == 0
    assert "rename the tensor" in capsys.readouterr().out
    r = oneload.digest(p, progress=False)
    assert r.match and r.recorded.claim.tensors == (("w", named["w"]),)
    assert any("rename the tensor" in x for x in r.recorded.claim.problems)
    assert main(["digest", str(p), "--no-progress"]) == 0


def test_a_tensor_named_with_a_lone_surrogate_is_a_digest_error(tmp_path):
    import struct

    head = b'{"\\ud800":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'
    head += b" " * (-len(head) % 8)
    p = tmp_path / "model.safetensors"
    p.write_bytes(struct.pack("<Q", len(head)) + head + b"\0" * 8)
    assert list(oneload.load_state_dict(p)) == ["\ud800"]  # it loads: only the digest cannot name it
    with pytest.raises(DigestError, match="lone surrogate"):
        oneload.digest(p, progress=False)


def test_a_digest_file_whose_tensors_field_is_not_a_list_is_refused(tmp_path, capsys):
    src = os.path.join(FIX, "singleton", "checkpoint_2_consolidated.pt")
    f = tmp_path / "d.json"
    f.write_text(json.dumps({"format": FORMAT, "model": "blake3:" + "0" * 64, "tensors": 5}))
    with pytest.raises(DigestError, match=r'd\.json: its "tensors" field is a int'):
        read_digest_file(f)
    assert main(["verify", src, str(f)]) == 2
    assert 'its "tensors" field is a int' in capsys.readouterr().err


def test_a_safetensors_convert_output_keeps_its_tie_and_matches_its_digest(tmp_path, capsys):
    src = os.path.join(FIX, "fsdp_dp3")
    out = str(tmp_path / "ck")
    assert main(["convert", src, out, "--format", "safetensors", "--shards", "1"]) == 0
    capsys.readouterr()
    ref = oneload.load_state_dict(src)
    got = oneload.load_state_dict(out + ".safetensors")
    assert "decoder.output_projection.weight" in ref and set(got) == set(ref)
    assert all(torch.equal(got[n], ref[n]) for n in ref)
    assert main(["digest", out + ".safetensors", "--no-progress"]) == 0
    assert "MATCH" in capsys.readouterr().out
    assert main(["verify", src, out + ".safetensors"]) == 0


def test_a_safetensors_sidecar_tie_is_checked(tmp_path):
    from safetensors.torch import save_file

    from metaseq_oneload import CheckpointLayoutError

    p = tmp_path / "ck.safetensors"
    save_file({"a": torch.ones(2, 3), "b": torch.zeros(3, 2)}, str(p), metadata={"metaseq_oneload": "ck.json"})
    side = {"format": "metaseq-oneload/safetensors-sidecar/1", "weights": "ck.safetensors"}
    for tied, why in [({"c": "missing"}, "which no weight file holds"), ({"b": "a"}, "same dtype and shape"),
                      ({"a": "a"}, "itself"), ({"c": 3}, "not an object of tensor names")]:
        (tmp_path / "ck.json").write_text(json.dumps({**side, "tied": tied}))
        with pytest.raises(CheckpointLayoutError, match=why):
            oneload.load_state_dict(p)
    (tmp_path / "ck.json").write_text(json.dumps({**side, "tied": {"c": "a"}}))
    sd = oneload.load_state_dict(p)
    assert set(sd) == {"a", "b", "c"} and torch.equal(sd["c"], sd["a"])
    (tmp_path / "ck.json").write_text(json.dumps({**side, "weights": "other.safetensors", "tied": {"c": "a"}}))
    assert set(oneload.load_state_dict(p)) == {"a", "b"}  # a sidecar of another file ties nothing here


def test_splitting_a_tensor_without_a_rule_is_a_refusal(tmp_path, capsys):
    src = os.path.join(os.path.dirname(__file__), "..", "fixtures", "fairseq", "plain")
    assert main(["convert", src, str(tmp_path / "p"), "-m", "2"]) == 2
    assert "no model-parallel split rule is known" in capsys.readouterr().err
