"""fairseq's own loaders, in this process, with ``metaseq_oneload.install()``: every set of
the fairseq corpus (tests/fixtures/fairseq, written by real fairseq-train 0.12.2) gives
fairseq's own reference logits through ``checkpoint_utils.load_model_ensemble_and_task``
with no ``num_shards`` and no ``suffix``, and through ``from_pretrained`` on its folder;
stock fairseq fails on the same calls.

Needs real fairseq (not installable from PyPI on Python 3.11; the README of the corpus says
how it was built); skips otherwise. Run here with::

    cd /work/main && /tmp/fsvenv/bin/python -m pytest -q tests/integration/test_fairseq_load.py
"""

import json

import pytest

from tests.integration.fairseq_run import FAIRSEQ_FIXTURES, skip_reason

pytestmark = pytest.mark.skipif(bool(skip_reason()), reason=skip_reason() or "ready")

CORPUS = json.loads((FAIRSEQ_FIXTURES / "corpus.json").read_text())
SETS = [entry["set"] for entry in CORPUS]


@pytest.fixture(scope="module")
def fairseq_patched():
    import metaseq_oneload

    import tests.integration_shims.fairseq_cpu_shim  # noqa: F401  (CPU FSDP, Megatron imports)
    from fairseq import checkpoint_utils

    metaseq_oneload.install()
    try:
        yield checkpoint_utils
    finally:
        metaseq_oneload.uninstall()


def _logits(model, tokens):
    import torch

    model.eval()
    with torch.no_grad():
        return model(tokens)[0]


def _reference(name):
    import torch

    return torch.load(FAIRSEQ_FIXTURES / name / "reference_logits.pt", weights_only=True)


@pytest.mark.parametrize("name", SETS)
def test_every_set_through_load_model_ensemble_and_task(fairseq_patched, name):
    """No num_shards, no suffix, the un-suffixed name; a model-parallel set is merged into
    its single-process counterpart (no model-parallel group here), whose logits are the
    gathered ones fairseq computed on 2 ranks."""
    import torch

    entry = next(e for e in CORPUS if e["set"] == name)
    models, cfg, task = fairseq_patched.load_model_ensemble_and_task(
        [str(FAIRSEQ_FIXTURES / name / "checkpoint_last.pt")], arg_overrides={"data": str(FAIRSEQ_FIXTURES)})
    ref = _reference(name)
    got = _logits(models[0], ref["tokens"])
    assert got.shape == ref["logits"].shape
    tol = 0.0 if entry["expect"]["model_parallel_size"] == 1 else 1e-5  # merged parts: another summation order
    assert torch.allclose(got, ref["logits"], rtol=0, atol=tol), (name, (got - ref["logits"]).abs().max())


@pytest.mark.parametrize("name", ["fsdp", "mp2_fsdp2"])
def test_any_file_of_the_set_names_it(fairseq_patched, name):
    import torch

    files = sorted((FAIRSEQ_FIXTURES / name).glob("checkpoint_last*.pt"))
    ref = _reference(name)
    models, _, _ = fairseq_patched.load_model_ensemble_and_task(
        [str(files[-1])], arg_overrides={"data": str(FAIRSEQ_FIXTURES)})
    assert torch.allclose(_logits(models[0], ref["tokens"]), ref["logits"], rtol=0, atol=1e-5)


def test_num_shards_that_contradicts_the_files_is_refused(fairseq_patched):
    from metaseq_oneload import CheckpointLayoutError

    with pytest.raises(CheckpointLayoutError, match=r"checkpoint_shard_count=2 but .*part3.* has 3 _part file"):
        fairseq_patched.load_model_ensemble_and_task(
            [str(FAIRSEQ_FIXTURES / "part3" / "checkpoint_last.pt")], arg_overrides={"data": str(FAIRSEQ_FIXTURES)},
            strict=False, num_shards=2)


@pytest.mark.parametrize("name, checkpoint_file", [("fsdp", "checkpoint_last.pt"), ("part3", "checkpoint_last.pt"),
                                                    ("fsdp_wrap", "checkpoint_last-shard1.pt"),
                                                    ("mp2", "checkpoint_last-model_part-1.pt")])
def test_from_pretrained_on_a_sharded_folder(fairseq_patched, name, checkpoint_file):
    import torch
    from fairseq.models.transformer_lm import TransformerLanguageModel

    hub = TransformerLanguageModel.from_pretrained(str(FAIRSEQ_FIXTURES / name), checkpoint_file,
                                                   data_name_or_path=str(FAIRSEQ_FIXTURES))
    ref = _reference(name)
    tol = 1e-5 if name.startswith("mp") else 0.0  # merged model-parallel parts: another summation order
    assert torch.allclose(_logits(hub.models[0], ref["tokens"]), ref["logits"], rtol=0, atol=tol)


def test_stock_fairseq_fails_on_the_same_calls():
    """Without the patch: what the tests above make work (so they can fail)."""
    import metaseq_oneload

    import tests.integration_shims.fairseq_cpu_shim  # noqa: F401
    from fairseq import checkpoint_utils

    was = metaseq_oneload.installed()
    metaseq_oneload.uninstall()
    data = {"data": str(FAIRSEQ_FIXTURES)}
    try:
        with pytest.raises(RuntimeError, match='Unexpected key.*"flat_param_0"'):
            checkpoint_utils.load_model_ensemble_and_task([str(FAIRSEQ_FIXTURES / "fsdp" / "checkpoint_last.pt")], data)
        with pytest.raises(OSError, match="Model file not found"):
            checkpoint_utils.load_model_ensemble_and_task([str(FAIRSEQ_FIXTURES / "mp2" / "checkpoint_last.pt")], data)
        with pytest.raises(OSError, match="Model file not found"):
            checkpoint_utils.load_model_ensemble_and_task([str(FAIRSEQ_FIXTURES / "part3" / "checkpoint_last.pt")],
                                                          data)
    finally:
        if was:
            metaseq_oneload.install()
