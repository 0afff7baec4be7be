"""The target's flat structure, decided in one place (:func:`metaseq_oneload._plan.flat_structure`):
from fairscale's metadata, else from the checkpoint's own flat parameters, else (asked for)
metaseq's wrapping; always checked against the planned tensors. On real metaseq fixtures."""

from __future__ import annotations

import pytest

import metaseq_oneload as mo
from metaseq_oneload import StateDictMismatchError
from metaseq_oneload._plan import FlatStructure, flat_structure, plan_part
from metaseq_oneload._reading import read_header
from tests.conftest import FIXTURES, needs_fixtures

pytestmark = needs_fixtures


def _saved_metadata(layout):
    return read_header(layout.files[0][0].path)[layout.metadata_key]


def test_a_flat_checkpoint_gives_its_own_wrapping_and_its_metadata_the_same():
    layout = mo.inspect(FIXTURES / "fsdp_dp3")
    targets = plan_part(layout, 1, 0)
    from_layout = flat_structure(layout, targets)
    assert from_layout == FlatStructure.from_layout(layout, targets)
    assert [g.key for g in from_layout.groups] == [
        "flat_param_0", "decoder.layers.0.flat_param_0", "decoder.layers.1.flat_param_0"]
    assert flat_structure(layout, targets, _saved_metadata(layout)) == from_layout


def test_unflattened_weights_need_the_wrapping_unless_metaseqs_is_assumed():
    single = mo.inspect(FIXTURES / "singleton")
    targets = plan_part(single, 1, 0)
    with pytest.raises(StateDictMismatchError, match="flat=True needs the target FSDP wrapping"):
        flat_structure(single, targets)
    # metaseq's wrapping, assumed for the consolidated file, is the one its FSDP run saved.
    flat = mo.inspect(FIXTURES / "fsdp_dp3")
    assert flat_structure(single, targets, assume_metaseq=True) == flat_structure(flat, plan_part(flat, 1, 0))
    # Assumed only where the checkpoint says nothing: its own flat parameters win.
    assert flat_structure(flat, plan_part(flat, 1, 0), assume_metaseq=True).groups == \
        flat_structure(flat, plan_part(flat, 1, 0)).groups


def test_metadata_of_another_model_is_refused_naming_the_tensors():
    single = mo.inspect(FIXTURES / "singleton")
    mp2 = mo.inspect(FIXTURES / "mp2_dp2")  # one model-parallel half: half the rows
    with pytest.raises(StateDictMismatchError, match=r"does not match the checkpoint: "
                       r"decoder\.embed_tokens\.weight: checkpoint \(64, 34\) vs target \(32, 34\)"):
        flat_structure(single, plan_part(single, 1, 0), _saved_metadata(mp2))
