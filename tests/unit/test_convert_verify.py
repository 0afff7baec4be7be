"""`verify`: what counts as a match, and how differences are reported (small real files)."""

from __future__ import annotations

import math

import torch

from metaseq_oneload._convert import verify


def _save(path, **tensors) -> str:
    torch.save({"model": tensors}, path)
    return str(path)


def test_identical_and_within_tolerance(tmp_path):
    a = _save(tmp_path / "a.pt", w=torch.arange(12.0).view(3, 4), b=torch.tensor([1.0, 2.0]))
    r = verify(a, _save(tmp_path / "b.pt", w=torch.arange(12.0).view(3, 4), b=torch.tensor([1.0, 2.0])))
    assert r.match and r.identical and r.elements == 14
    r = verify(a, _save(tmp_path / "c.pt", w=torch.arange(12.0).view(3, 4) + 1e-7, b=torch.tensor([1.0, 2.0])),
               atol=1e-6, rtol=0)
    assert r.match and not r.identical
    assert 0 < r.largest(1)[0].max_abs < 1e-6 and r.largest(1)[0].name == "w"


def test_differences_are_located_and_counted(tmp_path):
    a = _save(tmp_path / "a.pt", w=torch.zeros(1000), b=torch.ones(3))
    w = torch.zeros(1000)
    w[17], w[900] = 0.5, -2.0
    r = verify(a, _save(tmp_path / "b.pt", w=w, b=torch.ones(3)), atol=0.1, rtol=0)
    assert not r.match
    d = r.largest(1)[0]
    assert d.name == "w" and d.max_abs == 2.0 and d.mismatched == 2
    assert [x.name for x in r.diffs] == ["w", "b"]


def test_nan_and_inf(tmp_path):
    nan, inf = math.nan, math.inf
    a = _save(tmp_path / "a.pt", x=torch.tensor([nan, inf, -inf, 1.0]))
    assert verify(a, _save(tmp_path / "b.pt", x=torch.tensor([nan, inf, -inf, 1.0]))).match  # NaN equals NaN
    r = verify(a, _save(tmp_path / "c.pt", x=torch.tensor([1.0, inf, inf, nan])), atol=1e9, rtol=1e9)
    assert not r.match and r.diffs[0].mismatched == 3 and r.diffs[0].max_abs == inf


def test_structure_differences(tmp_path):
    a = _save(tmp_path / "a.pt", x=torch.zeros(4), y=torch.zeros(2, 3))
    r = verify(a, _save(tmp_path / "b.pt", x=torch.zeros(4), y=torch.zeros(3, 2), z=torch.zeros(1)))
    assert not r.match
    assert r.only_in_b == ("z",) and r.only_in_a == ()
    assert r.shape_mismatches == (("y", (2, 3), (3, 2)),)


def test_dtypes_compare_by_value(tmp_path):
    a = _save(tmp_path / "a.pt", x=torch.tensor([1.0, 0.5, 3.0]))
    r = verify(a, _save(tmp_path / "b.pt", x=torch.tensor([1.0, 0.5, 3.0], dtype=torch.bfloat16)), atol=0, rtol=0)
    assert r.match and not r.identical and r.diffs[0].dtype_b == "bfloat16"
