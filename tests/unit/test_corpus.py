"""The conformance corpus, one process: every set real metaseq and fairseq writers made
(tests/fixtures/*/corpus.json) is described as its files are, loads to exactly the
weights an independent reading of the files gives, equals the set it was made from,
survives a conversion and back, and (metaseq's OPT-style model) reproduces metaseq's own
logits in Hugging Face OPT.

Bounds: weights are compared exactly (every writer in the corpus only moves bytes, or
casts, which the reference casts the same way). Logits: 1e-5 for fp32 sets, 2e-2 for fp16
and 5e-2 for bf16 ones (the reference logits are fp32 and the weights were rounded once).
"""

from __future__ import annotations

import pytest
import torch

import metaseq_oneload as mo
from tests.corpus import ROOT, assert_same, by_id, canonical, entries, full_weights, reference_logits

ALL = entries()
ENTRIES = [e for e in ALL if not e.refused]
REFUSED = [e for e in ALL if e.refused]
IDS = [e.id for e in ENTRIES]
METASEQ = [e for e in ENTRIES if e.metaseq_model]
_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
_LOGIT_TOL = {torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 5e-2}
# fairseq sets made by different runs with the same seed and batches: bit-equal weights
# (tests/fixtures/fairseq/README.md).
FAIRSEQ_SAME = [("fairseq/ddp2", "fairseq/fsdp"), ("fairseq/ddp2", "fairseq/fsdp_full"),
                ("fairseq/ddp2", "fairseq/fsdp_wrap")]


def test_every_folder_is_in_the_manifest():
    listed = {(e.family, e.set) for e in ALL}
    for family in ("metaseq", "fairseq"):
        for d in sorted((ROOT / family).iterdir()):
            if d.is_dir() and any(p.suffix == ".pt" for p in d.iterdir()):
                assert (family, d.name) in listed, f"{family}/{d.name} is not in {family}/corpus.json"
    assert len(METASEQ) >= 5 and len(ENTRIES) >= 14


@pytest.mark.parametrize("e", ENTRIES, ids=IDS)
def test_inspect_describes_the_files(e):
    layout = mo.inspect(e.path)
    x = e.expect
    got = (layout.kind, layout.model_parallel_size, layout.shards_per_part, layout.flat)
    assert got == (x["kind"], x["model_parallel_size"], x["shards_per_part"], x["flat"]), (e.id, e.notes)
    assert list(layout.dtypes) == sorted(x["dtypes"]), e.id
    stale = x.get("stale_metadata")
    if isinstance(stale, bool):
        assert bool(layout.stale_metadata) == stale, (e.id, layout.stale_metadata)
    elif stale is not None:
        assert sorted(layout.stale_metadata) == sorted(stale), (e.id, layout.stale_metadata)
    # Stale metadata is said, in the JSON too, never refused.
    assert layout.to_dict()["stale_metadata"] == list(layout.stale_metadata)
    assert len(layout.notes) >= len(layout.stale_metadata)


@pytest.mark.parametrize("e", REFUSED, ids=[e.id for e in REFUSED])
def test_what_is_no_checkpoint_is_refused_clearly(e):
    with pytest.raises(mo.CheckpointLayoutError, match=r"not a model checkpoint: its top level is \['weights'\]"):
        mo.inspect(e.path)
    with pytest.raises(mo.CheckpointLayoutError, match=r"part-0\.pt: not a model checkpoint"):
        mo.load_state_dict(e.path)


@pytest.mark.parametrize("e", ENTRIES, ids=IDS)
def test_load_equals_an_independent_reading(e):
    got = canonical(mo.load_state_dict(e.path))
    assert_same(got, full_weights(e), what=e.id)


@pytest.mark.parametrize("e", [e for e in ENTRIES if e.family == "metaseq" and e.source in {x.set for x in METASEQ}
                               and e.source != e.set], ids=lambda e: e.id)
def test_equals_the_set_it_was_made_from(e):
    src = full_weights(by_id(f"metaseq/{e.source}"))
    dtype = _DTYPES.get(e.weights)
    if dtype is not None:
        src = {k: v.to(dtype) if v.is_floating_point() else v for k, v in src.items()}
    mine = full_weights(e)
    # A writer may drop the tied alias (reshard_fsdp --unflatten-weights does): the rest is equal.
    assert_same(mine, {k: v for k, v in src.items() if k in mine or not k.endswith("output_projection.weight")},
                what=f"{e.id} vs {e.source}")


@pytest.mark.parametrize("a,b", FAIRSEQ_SAME, ids=[f"{a}={b}" for a, b in FAIRSEQ_SAME])
def test_fairseq_runs_with_the_same_batches_are_bit_equal(a, b):
    assert_same(full_weights(by_id(b)), full_weights(by_id(a)), what=f"{b} vs {a}")


def _other_layout(e) -> dict:
    """A layout different from the saved one that the model can take."""
    if e.mp == 1 and not e.expect["flat"]:
        return {"model_parallel": 1, "shards": 3, "flat": True}
    if e.expect["flat"]:
        return {"model_parallel": e.mp, "shards": 1, "flat": False}
    return {"model_parallel": 1, "shards": 1, "flat": False}


@pytest.mark.parametrize("e", ENTRIES, ids=IDS)
def test_convert_there_and_back_verifies(tmp_path, e):
    before = {p.name: p.stat().st_mtime_ns for p in e.folder.iterdir()}
    there = mo.convert(e.path, tmp_path / "there" / "ckpt", **_other_layout(e))
    assert there.files
    source = mo.inspect(e.path)
    uneven = any(len({p.tensors[n].shape for p in source.parts}) > 1 for n in source.parts[0].tensors)
    back_args = dict(model_parallel=e.mp, shards=e.expect["shards_per_part"], flat=e.expect["flat"])
    if uneven:
        # Parts of unequal size (reshard_mp's torch.chunk where the heads do not divide):
        # they load, but that model-parallel size cannot be written again, and says so.
        with pytest.raises(mo.CheckpointLayoutError, match=f"do(es)? not split over {e.mp} model-parallel parts"):
            mo.convert(tmp_path / "there", tmp_path / "back" / "ckpt", **back_args)
        targets = (tmp_path / "there",)
    else:
        assert mo.convert(tmp_path / "there", tmp_path / "back" / "ckpt", **back_args).files
        targets = (tmp_path / "there", tmp_path / "back")
    for target in targets:
        report = mo.verify(e.path, target, atol=0, rtol=0)
        assert report.match, (e.id, target.name, report.only_in_a, report.only_in_b, report.shape_mismatches,
                              [d.name for d in report.diffs if d.mismatched][:5])
    if not uneven:
        layout = mo.inspect(tmp_path / "back")
        assert (layout.model_parallel_size, layout.shards_per_part, layout.flat) == (
            e.mp, e.expect["shards_per_part"], e.expect["flat"])
    assert {p.name: p.stat().st_mtime_ns for p in e.folder.iterdir()} == before  # the source is untouched


@pytest.mark.parametrize("e", METASEQ, ids=[e.id for e in METASEQ])
def test_export_hf_reproduces_metaseqs_logits(tmp_path, e):
    pytest.importorskip("transformers")
    from transformers import OPTForCausalLM

    mo.export_hf(e.path, tmp_path / "opt", progress=False)
    ref = reference_logits(e)
    model = OPTForCausalLM.from_pretrained(tmp_path / "opt").eval()
    dtype = next(model.parameters()).dtype
    with torch.no_grad():
        logits = model(ref["tokens"]).logits.float()
    diff = float((logits - ref["logits"].float()).abs().max())
    assert diff <= _LOGIT_TOL[dtype], (e.id, str(dtype), diff)
