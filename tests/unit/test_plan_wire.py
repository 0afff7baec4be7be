"""The plan travels from data-parallel rank 0 to its group as JSON (``_planner.to_wire``):
only the plan's own frozen types come back, and names read from a checkpoint (tensor names,
which key the exchange's mappings) are data, never type tags."""

from __future__ import annotations

import dataclasses

import pytest

import metaseq_oneload as mo
from metaseq_oneload import _planner
from tests.conftest import FIXTURES, needs_fixtures

pytestmark = needs_fixtures


def _exchange_part():
    part = mo.plan_load(FIXTURES / "singleton", world=4, nodes=2, storage="shared").parts[0]
    assert part.exchange is not None, part.mode
    return part


@pytest.mark.parametrize("name", ["__t", "__m", "PartPlan", '{"__t": "RankPlan"}'])
def test_a_tensor_name_that_looks_like_a_tag_travels_as_a_name(name):
    part = _exchange_part()
    crafted = dataclasses.replace(part, exchange=dataclasses.replace(
        part.exchange, itemsizes={name: 2, **part.exchange.itemsizes}))
    back = _planner.from_wire(_planner.to_wire(crafted))
    assert back == crafted and back.exchange.itemsizes[name] == 2


def test_only_the_plan_s_types_come_back():
    wire = _planner.to_wire(_exchange_part())
    assert _planner.from_wire(wire) == _exchange_part()
    for payload in (b'{"__t": "OrderedDict"}', b'{"__t": "os.system", "x": 1}', b'[1, 2]', b'{"a": 1}'):
        with pytest.raises((KeyError, ValueError, TypeError)):
            _planner.from_wire(payload)
